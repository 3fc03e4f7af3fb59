"""DoRA under DeepSpeed ZeRO-3 on two GPUs (NCCL, ``torchrun``): the fused training nodes test the magnitudes for
zeros once per optimizer step for all of them (``dora_dist.PartitionZeroTest``: each rank's partitions, one
all-reduce), so a step waits for the GPU at most once more than plain LoRA's under the same engine; before, every
node read its gathered magnitude on the host (14 syncs per step of this 2-layer model); and the checkpoint's
recompute reuses its forward's norm.

Needs two CUDA devices and DeepSpeed (carried as a wheel where the GPU tests run):
``pytest -m gpu tests/tuners/lora/test_dora_deepspeed_gpu.py``.
"""

import pytest
import torch
from test_dora_fsdp2_cpu import MODULES, _train


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]


def test_zero3_on_gpus_tests_the_magnitudes_once_per_step(tmp_path):
    pytest.importorskip("deepspeed")
    flags = ("--device", "cuda", "--engine", "zero3", "--optim", "sgd", "--checkpointing", "1")
    ours = _train(tmp_path, 2, *flags)
    lora = _train(tmp_path, 2, *flags, "--dora", "0")
    assert ours["fsdp"] == "zero3" and len(ours["losses"]) == 20
    assert all(c.get("tier_fused_backward") for c in ours["counts"]), ours["counts"][:2]  # the fused nodes ran
    assert all(c["zero_tests"] == 1 for c in ours["counts"][1:]), [c["zero_tests"] for c in ours["counts"]]
    # each norm computed once per step: the checkpoint's recompute reuses its forward's (dora_dist.partition_stand_ins)
    norms = {(c.get("norm_computed"), c.get("norm_reused")) for c in ours["counts"]}
    assert norms == {(MODULES, MODULES)}, norms
    # steps after the first: LoRA's host syncs under ZeRO-3 (DeepSpeed's own), and at most the one test more
    assert ours["syncs"] and max(ours["syncs"]) <= max(lora["syncs"]) + 1, (ours["syncs"], lora["syncs"])
