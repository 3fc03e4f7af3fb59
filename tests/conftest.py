"""Test-wide setup. ``tests/`` holds shared helpers (``import dora_testing``) for test modules in sub-folders; the
package under test is always the installed ``peft``, never the repository's overlay folder."""

import os
import sys
from pathlib import Path

import pytest


sys.path.insert(0, str(Path(__file__).resolve().parent))
# Unit tests must see the defaults, whatever the developer's shell exports.
for _name in (
    "PEFT_DORA_FUSED",
    "PEFT_DORA_FUSED_BACKWARD",
    "PEFT_DORA_NORM_CACHE",
    "PEFT_DORA_NORM_KERNEL",
    "PEFT_DORA_NORM_CHUNK_MB",
    "PEFT_DORA_FWD_CHUNK_MB",
):
    os.environ.pop(_name, None)


@pytest.fixture
def dora_env():
    """``dora_env(NAME, value)`` sets (or, with None, unsets) a ``PEFT_DORA_*`` variable for one test. Afterwards
    every ``PEFT_DORA_*`` variable is as before the test (also those set by the code under test, e.g.
    ``set_dora_norm_threshold_mb``), and the cached snapshot of the environment is dropped."""
    from peft.tuners.lora import dora

    before = {k: v for k, v in os.environ.items() if k.startswith("PEFT_DORA_")}

    def set_env(name, value):
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
        dora._invalidate_fused_cache()

    yield set_env
    for name in [k for k in os.environ if k.startswith("PEFT_DORA_")]:
        del os.environ[name]
    os.environ.update(before)
    dora._invalidate_fused_cache()


@pytest.fixture
def dora_switches():
    """``dora_switches(decode_kernels=False, ...)`` sets DoRA settings fields (``dora_settings.override``) until the
    test ends; a later call wins over an earlier one."""
    import contextlib

    from peft.tuners.lora import dora_settings

    with contextlib.ExitStack() as stack:
        yield lambda **fields: stack.enter_context(dora_settings.override(**fields))
