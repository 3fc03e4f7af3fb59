"""``PEFT_DORA_NORM_BATCH`` (``dora_batch``): where it applies here, and its cases under the Triton interpreter
(``dora_norm_batch_cases.py``, in a child process: the fused training node that asks the batch runs only there on a
CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dora_testing import run_under_interpreter
from torch import nn

from peft.tuners.lora import dora_batch


HERE = Path(__file__).resolve().parent


def test_norm_batch_cases_under_interpreter():
    pytest.importorskip("triton")
    run_under_interpreter(HERE / "dora_norm_batch_cases.py")


def test_batch_is_off_by_default_and_outside_training_forwards(dora_env):
    p = nn.Parameter(torch.randn(4, 4))
    dora_env("PEFT_DORA_NORM_BATCH", None)
    assert not dora_batch.applies(p, p, p)
    dora_env("PEFT_DORA_NORM_BATCH", "1")
    assert dora_batch.applies(p, p, p)
    with torch.no_grad():
        assert not dora_batch.applies(p, p, p)
    assert not dora_batch.applies(p.detach(), p, p)  # not a parameter: its identity stands for nothing
    dora_env("PEFT_DORA_NORM_GRAPH", "0")
    assert not dora_batch.applies(p, p, p)
    dora_env("PEFT_DORA_NORM_GRAPH", None)
    dora_env("PEFT_DORA_NORM_BATCH", "2")
    with pytest.raises(ValueError, match="PEFT_DORA_NORM_BATCH"):
        dora_batch.applies(p, p, p)
