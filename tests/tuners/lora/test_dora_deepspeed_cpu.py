"""DoRA under DeepSpeed ZeRO-2 and ZeRO-3 on CPU (its CPU accelerator, gloo, two processes, ``fork_launcher.py``)
against upstream PEFT's DoRA under the same engine.

ZeRO-3 partitions every parameter and gathers it on access (its parameter dict does) or around a module's forward,
and partitions it again after; ZeRO-2 partitions the optimizer state and gradients. Our DoRA must read the gathered
tensors (a bare read of the parameter dict gives ZeRO-3's empty partition) and keep no norm across ZeRO-3's gathers
but for a checkpoint's recompute, keyed on the partitions.
Twenty SGD steps of a tiny Llama give upstream's losses under the same engine, the first one also the single
process's (DeepSpeed's updates then differ slightly from a plain ``optimizer.step()``, for plain LoRA too); the
trained adapters and the eval logits around in-place edits of B and m equal upstream's. ``zero3_init_flag``
(``deepspeed.zero.Init``) does not run on PyTorch 2.13, where DeepSpeed 0.19.8's constructor patch fails its
signature check; the GPU machine's PyTorch is older.
"""

import os

import pytest
import torch
from test_dora_fsdp2_cpu import MODULES, _train
from test_dora_interchange import upstream_env  # noqa: F401  (the fixture: a pure upstream install)


@pytest.mark.parametrize("engine", ("zero2", "zero3"))
def test_deepspeed_training_equals_upstream(tmp_path, upstream_env, engine):  # noqa: F811
    flags = ("--engine", engine, "--optim", "sgd")
    ours = _train(tmp_path, 2, *flags)
    upstream = _train(tmp_path, 2, *flags, env=upstream_env[1])
    single = _train(tmp_path, 1, "--optim", "sgd")
    assert ours["fsdp"] == engine and ours["world"] == 2 and len(ours["losses"]) == 20
    assert "norm_computed" not in upstream["counts"][0] and ours["counts"][0].get("norm_computed")  # theirs, ours
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(upstream["losses"]), rtol=1e-5, atol=1e-5)
    assert abs(ours["losses"][0] - single["losses"][0]) < 1e-5
    assert sorted(ours["adapter"]) == sorted(upstream["adapter"])
    for name, value in upstream["adapter"].items():
        torch.testing.assert_close(ours["adapter"][name], value, rtol=1e-4, atol=1e-5, msg=name)
    for a, b in zip(ours["eval"]["logits"], upstream["eval"]["logits"]):  # around in-place edits of B, then of m
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert (ours["eval"]["logits"][0] - ours["eval"]["logits"][1]).abs().max() > 1e-2  # the edits changed them
    if engine == "zero3":  # nothing kept across ZeRO-3's gathers: every norm computed in every forward
        assert all(c.get("norm_computed") == 14 and not c.get("norm_reused") for c in ours["counts"])


def test_zero3_fused_tiers_test_the_magnitudes_once_per_step(tmp_path, upstream_env):  # noqa: F811
    """The fused training nodes (Triton under ``TRITON_INTERPRET=1`` on CPU tensors) under ZeRO-3 with checkpointing:
    upstream's losses, and the magnitudes' zero test once per step for all of them (``PartitionZeroTest``: each
    rank's partitions, one all-reduce), not once per module and step (a host sync each on a GPU), as before.

    The checkpoint's recompute reuses its forward's norm, kept on W's, A's and B's partitions
    (``dora_dist.partition_stand_ins``), not computed again in the backward. Every odd step scales each rank's
    partition of every A between the forward and the backward (``--edit-partitions``): the recompute then reads other
    A than the forward did, recomputes the norm as upstream's does (its losses, checkpointed too, are the reference),
    and a norm reused there would be stale."""
    pytest.importorskip("deepspeed")
    flags = ("--engine", "zero3", "--optim", "sgd", "--checkpointing", "1", "--edit-partitions", "1", "--steps", "8")
    fused = _train(tmp_path, 2, *flags, env=dict(os.environ, TRITON_INTERPRET="1"))
    upstream = _train(tmp_path, 2, *flags, env=upstream_env[1])
    torch.testing.assert_close(torch.tensor(fused["losses"]), torch.tensor(upstream["losses"]), rtol=1e-5, atol=1e-5)
    counts = fused["counts"]
    assert all(c.get("tier_fused_backward") == 2 * MODULES for c in counts), counts[:2]  # forward and recompute
    norms = [(c.get("norm_computed"), c.get("norm_reused")) for c in counts]
    assert norms[0::2] == [(MODULES, MODULES)] * (len(counts) // 2), norms  # the forward's norm, reused
    assert norms[1::2] == [(2 * MODULES, None)] * (len(counts) // 2), norms  # A edited since: computed again
    assert counts[0]["zero_tests"] == MODULES  # the first step: each new magnitude joins the test once
    assert all(c["zero_tests"] == 1 for c in counts[1:]), [c["zero_tests"] for c in counts]
