"""Build `peft` = pinned upstream PEFT wheel + our DoRA overlay (see tools/overlay.py and the README)."""

import sys
from pathlib import Path

from setuptools import find_packages, setup


ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from tools import overlay, upstream  # noqa: E402


DORA_VERSION = "0.1.0"
STAGING = "build/overlay"

overlay.build_tree(ROOT / STAGING)

setup(
    name="peft",
    version=f"{upstream.UPSTREAM_VERSION}+dora.{DORA_VERSION}",
    description="Hugging Face PEFT with DoRA on a factored norm and fused Triton kernels",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    package_dir={"": STAGING},
    packages=find_packages(STAGING),
    package_data={"": ["*.cu", "*.cpp", "py.typed"]},
    install_requires=overlay.upstream_requirements(upstream.wheel()),
    # bitsandbytes pinned: QDoRA reads its packed 4-bit storage and LLM.int8 scales (peft/tuners/lora/dora_quant.py)
    extras_require={"triton": ["triton>=3.0"], "bnb": ["bitsandbytes==0.50.2"]},
    zip_safe=False,
)
