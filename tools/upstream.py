"""The pinned upstream PEFT release: where the build and the tests get it from.

The build overlays our DoRA on upstream's wheel; the tests use the same wheel (and the sdist, for upstream's own
test-suite and for `hf.patch`) as the oracle. Both artefacts are fetched with pip (no dependencies, so no second
torch download) and checked against the sha256 pinned here. Offline builds point `PEFT_UPSTREAM_WHEEL` /
`PEFT_UPSTREAM_SDIST` at local files; those are checked against the same pins.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path


UPSTREAM_VERSION = "0.21.2"
WHEEL_NAME = f"peft-{UPSTREAM_VERSION}-py3-none-any.whl"
SDIST_NAME = f"peft-{UPSTREAM_VERSION}.tar.gz"
SHA256 = {
    WHEEL_NAME: "106ab6077ff72c54d21577f9af5970e34bac7582cb14209f7b2b511e322a4eae",
    SDIST_NAME: "b803ccfb3f3f316004d850284306687833a2235ea278fb56abc856203456142e",
}
ENV_VARS = {WHEEL_NAME: "PEFT_UPSTREAM_WHEEL", SDIST_NAME: "PEFT_UPSTREAM_SDIST"}
REPO_ROOT = Path(__file__).resolve().parent.parent
CACHE_DIR = Path(os.environ.get("PEFT_UPSTREAM_CACHE", REPO_ROOT / ".upstream"))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _checked(path: Path, name: str) -> Path:
    actual = _sha256(path)
    if actual != SHA256[name]:
        raise RuntimeError(f"{path}: sha256 {actual} does not match the pinned {SHA256[name]} of {name}")
    return path


def fetch(name: str) -> Path:
    """Return a verified local copy of the pinned upstream wheel or sdist, downloading it once if needed."""
    override = os.environ.get(ENV_VARS[name])
    if override:
        return _checked(Path(override), name)
    cached = CACHE_DIR / name
    if cached.exists():
        return _checked(cached, name)
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    fmt = ["--only-binary=:all:"] if name.endswith(".whl") else ["--no-binary=:all:"]
    with tempfile.TemporaryDirectory(dir=CACHE_DIR) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-build-isolation", *fmt, "-d", tmp,
               f"peft=={UPSTREAM_VERSION}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        got = Path(tmp) / name
        if proc.returncode != 0 or not got.exists():
            raise RuntimeError(
                f"could not download {name} with pip (set {ENV_VARS[name]} to a local copy for offline builds):\n"
                + proc.stdout + proc.stderr
            )
        _checked(got, name)
        os.replace(got, cached)
    return cached


def wheel() -> Path:
    return fetch(WHEEL_NAME)


def sdist() -> Path:
    return fetch(SDIST_NAME)


def extract_sdist(dest: Path, *subdirs: str) -> Path:
    """Extract `subdirs` (e.g. "src/peft", "tests") of the pinned sdist into `dest`, without the top-level
    `peft-<version>/` folder; return `dest`."""
    top = f"peft-{UPSTREAM_VERSION}/"
    wanted = tuple(top + s.strip("/") + "/" for s in subdirs)
    dest = Path(dest)
    with tarfile.open(sdist()) as tf:
        members = []
        for m in tf.getmembers():
            if not (m.isfile() or m.isdir()) or not m.name.startswith(wanted):
                continue
            m.name = m.name[len(top):]
            members.append(m)
        tf.extractall(dest, members, filter="data")
    return dest


if __name__ == "__main__":
    for n in sys.argv[1:] or ["wheel", "sdist"]:
        print({"wheel": wheel, "sdist": sdist}[n]())
