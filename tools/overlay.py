"""Turn upstream PEFT into ours: copy upstream's package, drop in our DoRA files, add the glue.

Used by `setup.py` (on the pinned wheel) and by `tools/make_hf_patch.py` (on the pinned sdist), so the wheel we
build and the `hf.patch` we publish carry exactly the same change.
"""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path

from . import upstream


OVERLAY_FILES = (
    "tuners/lora/dora.py",
    "tuners/lora/dora_batch.py",
    "tuners/lora/dora_cache.py",
    "tuners/lora/dora_decode.py",
    "tuners/lora/dora_dispatch.py",
    "tuners/lora/dora_dist.py",
    "tuners/lora/dora_fused.py",
    "tuners/lora/dora_graph.py",
    "tuners/lora/dora_launch.py",
    "tuners/lora/dora_norm.py",
    "tuners/lora/dora_norm_triton.py",
    "tuners/lora/dora_quant.py",
    "tuners/lora/dora_settings.py",
)
GLUE_FILE = "tuners/lora/variants.py"
# Upstream resolves every DoRA variant through `variants.Dora*Variant` at call time (layer.py, bnb.py, gptq.py,
# hqq.py), so rebinding those names at the end of variants.py routes all of DoRA to our dora.py.
GLUE = """

# peft-dora-fast: DoRA runs on the factored norm and fused kernels of dora.py; route every variant lookup there.
from .dora import (  # noqa: E402, F401, F811
    DoraConv1dVariant,
    DoraConv2dVariant,
    DoraConv3dVariant,
    DoraEmbeddingVariant,
    DoraLinearVariant,
)
"""
# Upstream's docstrings that describe its DoRA where ours differs: (file, upstream's text, ours).
DOC_EDITS = (
    (
        "helpers.py",
        "With active caching, the materialized LoRA weight (B @ A) and the weight norm (base weight + LoRA weight) are\n"  # noqa: E501
        "    cached.",
        "With active caching, the weight norm of (base weight + LoRA weight) is cached; this DoRA never materializes\n"
        "    the LoRA weight (B @ A), so there is nothing else to cache.",
    ),
)
# Upstream's code, changed where a DoRA Linear does better on its own: (file, upstream's text, ours). The LoRA Linear's
# forward casts x to the adapter's dtype (fp32 by default) before every adapter; under autocast the branch's matmul
# casts it back, an exact round trip of two copies of x per module and forward (and two more in the backward) that
# DoRA skips where it may (``DoraLinearVariant.casts_own_input``): with one line here, its variant casts for itself.
CODE_EDITS = (
    (
        "tuners/lora/layer.py",
        "                x = self._cast_input_dtype(x, lora_A.weight.dtype)\n"
        "                if active_adapter not in self.lora_variant:  # vanilla LoRA\n",
        "                if not getattr(self.lora_variant.get(active_adapter), \"casts_own_input\", False):\n"
        "                    x = self._cast_input_dtype(x, lora_A.weight.dtype)\n"
        "                if active_adapter not in self.lora_variant:  # vanilla LoRA\n",
    ),
)
GLUE_ANCHORS = ("from .dora import ", "class DoraLinearVariant(", "class DoraEmbeddingVariant(",
                "class DoraConv1dVariant(", "class DoraConv2dVariant(", "class DoraConv3dVariant(")


def apply_overlay(pkg_dir: Path, ours: Path = upstream.REPO_ROOT / "peft") -> None:
    """Overlay our files and the glue onto an upstream `peft` package directory, in place."""
    for rel in OVERLAY_FILES:
        shutil.copyfile(ours / rel, pkg_dir / rel)
    variants = pkg_dir / GLUE_FILE
    text = variants.read_text()
    missing = [a for a in GLUE_ANCHORS if a not in text]
    if missing:
        raise RuntimeError(f"{variants} is not upstream PEFT {upstream.UPSTREAM_VERSION}'s: missing {missing}")
    if GLUE.strip() not in text:
        variants.write_text(text.rstrip("\n") + "\n" + GLUE)
    for rel, before, after in DOC_EDITS + CODE_EDITS:
        path = pkg_dir / rel
        text = path.read_text()
        if after not in text:
            if text.count(before) != 1:
                raise RuntimeError(
                    f"{path} is not upstream PEFT {upstream.UPSTREAM_VERSION}'s: {before!r} found "
                    f"{text.count(before)} times, not once"
                )
            path.write_text(text.replace(before, after))


def unpack_wheel(wheel: Path, dest: Path) -> Path:
    """Extract the `peft` package (not its dist-info) of the upstream wheel into `dest`; return the package dir."""
    with zipfile.ZipFile(wheel) as zf:
        members = [m for m in zf.namelist() if m.startswith("peft/")]
        zf.extractall(dest, members)
    return dest / "peft"


def build_tree(dest: Path) -> Path:
    """Fresh overlaid package in `dest/peft` from the pinned upstream wheel."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    pkg = unpack_wheel(upstream.wheel(), dest)
    apply_overlay(pkg)
    return pkg


def upstream_requirements(wheel: Path) -> list[str]:
    """Upstream's runtime requirements (no extras), read from the wheel's METADATA."""
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        lines = zf.read(meta).decode().splitlines()
    reqs = [ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("Requires-Dist:")]
    return [r for r in reqs if "extra ==" not in r]
