"""The build and its published forms: `hf.patch` is fresh and applies to upstream, the installed `peft` is the
overlaid wheel (never the repo's overlay folder), and `pip wheel` of the repo carries our files and the glue."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from dora_testing import REPO_ROOT

from tools import make_hf_patch, overlay, upstream


OURS = REPO_ROOT / "peft"
PROBE = "import peft, peft.tuners.lora.dora as d; print(peft.__file__); print(d.__file__)"


def _git(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    return subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True)


# ---------------------------------------------------------------------------------------------------- hf.patch


def test_hf_patch_is_fresh():
    committed = make_hf_patch.PATCH.read_bytes().decode()
    assert committed == make_hf_patch.generate(), "hf.patch is stale: run `python tools/make_hf_patch.py`"


def test_hf_patch_check_flags_a_stale_patch(tmp_path, monkeypatch):
    stale = tmp_path / "hf.patch"
    stale.write_bytes(make_hf_patch.PATCH.read_bytes().replace(b"DoRA", b"DORA", 1))
    monkeypatch.setattr(make_hf_patch, "PATCH", stale)
    assert make_hf_patch.main(["--check"]) == 1
    stale.write_bytes(make_hf_patch.generate().encode())
    assert make_hf_patch.main(["--check"]) == 0


def test_hf_patch_applies_to_upstream_source(tmp_path):
    upstream.extract_sdist(tmp_path, "src/peft")
    assert _git(tmp_path, "init", "-q").returncode == 0
    patch = str(make_hf_patch.PATCH)
    check = _git(tmp_path, "apply", "--check", patch)
    assert check.returncode == 0, check.stderr
    applied = _git(tmp_path, "apply", patch)
    assert applied.returncode == 0, applied.stderr
    # The patched tree is exactly what the build produces from the wheel.
    built = overlay.build_tree(tmp_path / "built")
    lora = Path("tuners/lora")
    for name in (*(Path(rel).name for rel in overlay.OVERLAY_FILES), "variants.py"):
        assert (tmp_path / "src/peft" / lora / name).read_bytes() == (built / lora / name).read_bytes(), name


# ---------------------------------------------------------------------------------- installed package vs overlay


def test_overlay_folder_holds_only_our_files():
    files = {p.relative_to(OURS).as_posix() for p in OURS.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert files == set(overlay.OVERLAY_FILES)
    assert not list(OURS.rglob("__init__.py")), "an __init__.py would let the overlay folder shadow the install"


@pytest.mark.parametrize("how", ["cwd", "sys.path", "PYTHONPATH"])
def test_installed_package_wins_over_the_overlay_folder(how):
    # `python -c` puts the cwd (the repo root) first on sys.path; the other two put the repo root there explicitly.
    code = f"import sys; sys.path.insert(0, {str(REPO_ROOT)!r}); {PROBE}" if how == "sys.path" else PROBE
    env = dict(os.environ)
    if how == "PYTHONPATH":
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    pkg_init, dora_file = (Path(line).resolve() for line in proc.stdout.split())
    assert pkg_init.name == "__init__.py" and not pkg_init.is_relative_to(OURS), pkg_init
    assert dora_file == pkg_init.parent / "tuners/lora/dora.py"
    for rel in overlay.OVERLAY_FILES:
        assert (pkg_init.parent / rel).read_bytes() == (OURS / rel).read_bytes(), f"installed {rel} is not ours"
    assert overlay.GLUE.strip() in (pkg_init.parent / overlay.GLUE_FILE).read_text()


def test_installed_version_has_dora_local_label():
    version = importlib.metadata.version("peft")
    assert version.startswith(f"{upstream.UPSTREAM_VERSION}+dora."), version


# --------------------------------------------------------------------------------------------------- the wheel


@pytest.mark.slow
def test_pip_wheel_of_the_repo(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-q",
        "-w",
        str(tmp_path),
        str(REPO_ROOT),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (whl,) = tmp_path.glob("peft-*.whl")
    assert whl.name.startswith(f"peft-{upstream.UPSTREAM_VERSION}+dora.")
    with zipfile.ZipFile(whl) as zf:
        names = zf.namelist()
        assert {n.split("/")[0] for n in names} == {"peft", whl.name.split("-py3")[0] + ".dist-info"}
        for rel in overlay.OVERLAY_FILES:
            assert zf.read(f"peft/{rel}") == (OURS / rel).read_bytes(), rel
        assert overlay.GLUE.strip() in zf.read(f"peft/{overlay.GLUE_FILE}").decode()
        # Everything else is upstream's wheel, file for file.
        with zipfile.ZipFile(upstream.wheel()) as up:
            theirs = {n for n in up.namelist() if n.startswith("peft/")}
            ours = {n for n in names if n.startswith("peft/")}
            assert ours == theirs | {f"peft/{r}" for r in overlay.OVERLAY_FILES}
            edited = [rel for rel, _, _ in overlay.DOC_EDITS + overlay.CODE_EDITS]
            changed = {f"peft/{r}" for r in (*overlay.OVERLAY_FILES, overlay.GLUE_FILE, *edited)}
            for rel, before, after in overlay.DOC_EDITS:
                text = zf.read(f"peft/{rel}").decode()
                assert after in text and before not in text, rel
            for rel, before, after in overlay.CODE_EDITS:  # ours keeps upstream's line, indented under a condition
                text = zf.read(f"peft/{rel}").decode()
                assert text.count(after) == 1, rel
                assert up.read(f"peft/{rel}").decode().replace(before, after) == text, rel
            for n in sorted(theirs - changed):
                assert zf.read(n) == up.read(n), n
