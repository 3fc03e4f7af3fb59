"""``PEFT_DORA_NORM_BATCH`` (``dora_batch``): where it applies here, and its cases under the Triton interpreter
(``dora_norm_batch_cases.py``, in a child process: the fused training node that asks the batch runs only there on a
CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from peft.tuners.lora import dora_batch


HERE = Path(__file__).resolve().parent


def test_norm_batch_cases_under_interpreter():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PEFT_DORA_")}
    env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, "-m", "pytest", str(HERE / "dora_norm_batch_cases.py"), "-q", "-p", "no:cacheprovider",
           "-o", "addopts=", "--rootdir", str(HERE.parents[1])]  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=HERE.parents[1], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]


def test_batch_is_off_by_default_and_outside_training_forwards(dora_env):
    p = nn.Parameter(torch.randn(4, 4))
    dora_env("PEFT_DORA_NORM_BATCH", None)
    assert not dora_batch.applies(p, p, p)
    dora_env("PEFT_DORA_NORM_BATCH", "1")
    assert dora_batch.applies(p, p, p)
    with torch.no_grad():
        assert not dora_batch.applies(p, p, p)
    assert not dora_batch.applies(p.detach(), p, p)  # not a parameter: its identity stands for nothing
    dora_env("PEFT_DORA_NORM_BATCH", "2")
    with pytest.raises(ValueError, match="PEFT_DORA_NORM_BATCH"):
        dora_batch.applies(p, p, p)
