"""``benchmarks/host_eager.py``, the CPU stand-in for DoRA's host cost per module: it runs the tiers it says it runs
(the fused tiers' Python with no-op launches, or the PyTorch tiers), on plain and NF4 bases, and writes its record."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from dora_testing import REPO_ROOT


_docs: dict = {}  # the records of this session by their flags: a record several tests check is made once


def _run(tmp_path, *flags) -> dict:
    if flags in _docs:
        return _docs[flags]
    out = tmp_path / "host.json"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PEFT_DORA_FUSED")}
    cmd = [sys.executable, str(REPO_ROOT / "benchmarks" / "host_eager.py"), "--modules", "3", "--rounds", "2"]
    done = subprocess.run([*cmd, "--calls", "1", *flags, "--out", str(out)], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["kind"] == "host_eager" and len(doc["rounds_us_per_module"]["dora"]) == 2
    assert all(v > 0 for v in doc["median_us_per_module"].values())
    assert doc["dora_extra_us_per_module"] == pytest.approx(
        doc["median_us_per_module"]["dora"] - doc["median_us_per_module"]["lora"], abs=0.02
    )
    _docs[flags] = doc
    return doc


def test_fused_training_tiers_with_no_op_launches(tmp_path):
    pytest.importorskip("triton")
    doc = _run(tmp_path, "--measure", "train", "--tiers", "fused")
    assert set(doc["tiers"]) == {"fused_backward"}, doc["tiers"]


def test_fused_dropout_training_takes_the_node(tmp_path):
    """LoRA dropout (upstream's semantics) in the fused training node: W·dropout(x) is one more matmul per pass than
    without dropout, not the composition's dozen element-wise ops and their backward."""
    pytest.importorskip("triton")
    plain = _run(tmp_path, "--measure", "train", "--tiers", "fused")["aten_ops_per_module"]
    doc = _run(tmp_path, "--measure", "train", "--tiers", "fused", "--dropout", "0.05")
    assert set(doc["tiers"]) == {"fused_backward"}, doc["tiers"]
    dropped = doc["aten_ops_per_module"]
    assert dropped["dora"] - dropped["lora"] <= plain["dora"] - plain["lora"] + 6, (plain, dropped)


def test_graphs_take_the_gpu_norm_path(tmp_path):
    """``--graphs``: a training norm is "captured" and replayed as a no-op through the layer's record, as on a GPU,
    once per module and step (the recompute takes the forward's norm back): fewer ops than computing it eagerly."""
    pytest.importorskip("triton")
    eager_norms = _run(tmp_path, "--measure", "train", "--tiers", "fused")
    doc = _run(tmp_path, "--measure", "train", "--tiers", "fused", "--graphs")
    assert eager_norms["norm_graph_replays"] == 0
    assert doc["norm_graph_replays"] == 3 * 2 * doc["config"]["calls"]  # modules x rounds x calls
    assert doc["aten_ops_per_module"]["dora"] < eager_norms["aten_ops_per_module"]["dora"]


def test_train_forward_times_a_training_steps_forward_after_each_step(tmp_path):
    """``--measure train-forward``: a training forward alone (autograd on, under the step's checkpointing), each after
    an untimed optimizer step that changes no value, which DoRA's step hook sees as between training steps; each
    forward replays its norm graph, as a training step's forward does (one replay per module and call)."""
    pytest.importorskip("triton")
    doc = _run(tmp_path, "--measure", "train-forward", "--tiers", "fused", "--graphs")
    assert set(doc["tiers"]) == {"fused_backward"}, doc["tiers"]
    assert doc["norm_graph_replays"] == 3 * 2 * doc["config"]["calls"]  # modules x rounds x calls
    assert doc["dora_optimizer_steps_seen"] == 2 * doc["config"]["calls"]  # one null step before each timed forward
    step = _run(tmp_path, "--measure", "train", "--tiers", "fused", "--graphs")
    # the forward alone dispatches a part of the step's ops (no backward, no optimizer)
    assert doc["aten_ops_per_module"]["dora"] < step["aten_ops_per_module"]["dora"] / 2


def test_reentrant_train_forward_follows_whole_training_steps(tmp_path):
    """``--measure train-forward --reentrant``: the forward runs without autograd and is answered from the training
    record that the previous step's recompute made, so each timed forward follows a whole untimed training step
    (its backward takes the fused node; one AdamW step per timed forward), not a null step after which no recompute
    ever ran and every forward took the full path."""
    pytest.importorskip("triton")
    doc = _run(tmp_path, "--measure", "train-forward", "--tiers", "fused", "--graphs", "--reentrant")
    assert doc["tiers"].get("fused_backward", 0) > 0 and "fused_forward" in doc["tiers"], doc["tiers"]
    assert doc["dora_optimizer_steps_seen"] == 2 * doc["config"]["calls"]  # rounds x calls


def test_eager_eval_tiers(tmp_path):
    doc = _run(tmp_path, "--measure", "eval", "--tiers", "eager")
    assert set(doc["tiers"]) == {"eager"}, doc["tiers"]


def test_nf4_base_fused_eval(tmp_path):
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("triton")
    doc = _run(tmp_path, "--measure", "eval", "--tiers", "fused", "--base", "nf4", "--bias")
    assert doc["config"]["base"] == "nf4" and set(doc["tiers"]) <= {"small_forward", "fused_forward", "decode"}
    assert sum(doc["tiers"].values()) > 0


def test_norm_once_probe_removes_the_norms_ops(tmp_path):
    """``--probe norm-once`` keeps each layer's first norm: DoRA's per-module ops drop by the norm's, LoRA's stay."""
    pytest.importorskip("triton")
    plain = _run(tmp_path, "--measure", "train", "--tiers", "fused")
    probe = _run(tmp_path, "--measure", "train", "--tiers", "fused", "--probe", "norm-once")
    assert probe["config"]["probe"] == "norm-once"
    assert probe["aten_ops_per_module"]["lora"] == plain["aten_ops_per_module"]["lora"]
    assert probe["aten_ops_per_module"]["dora"] <= plain["aten_ops_per_module"]["dora"] - 5, (plain, probe)


@pytest.mark.parametrize("bias", (False, True), ids=("no_bias", "bias"))
def test_small_tier_eval_dispatches_fewer_ops_than_lora(tmp_path, bias):
    """An eval forward of few tokens takes the small tier, whose s·g folded into B's matmul (and the bias term into
    its bias) leaves one op after the two matmuls where LoRA's ``result + lora_B(lora_A(x)) * s`` takes two: fewer
    ATen ops per module than LoRA's, with or without a bias (every op is a launch on a GPU, host time where the step
    waits on the host)."""
    pytest.importorskip("triton")
    doc = _run(tmp_path, "--measure", "eval", "--tiers", "fused", *(("--bias",) if bias else ()))
    assert set(doc["tiers"]) == {"small_forward"}, doc["tiers"]
    ops = doc["aten_ops_per_module"]
    assert ops["dora"] < ops["lora"], ops


@pytest.mark.parametrize("base", ("plain", "nf4"))
def test_autocast_eval_and_training(tmp_path, base):
    """``--autocast``: fp32 adapters beside the base's bf16, the step under bf16 autocast (the grid's autocast mode,
    the QLoRA recipe on an NF4 base). An eval forward takes the small tier and dispatches fewer ATen ops than LoRA's
    (no cast of x: DoRA casts its own input); a training step takes the fused node."""
    pytest.importorskip("triton")
    if base == "nf4":
        pytest.importorskip("bitsandbytes")
    common = ("--tiers", "fused", "--base", base, "--dtype", "bfloat16", "--autocast")
    doc = _run(tmp_path, "--measure", "eval", *common)
    assert doc["config"]["autocast"] is True and set(doc["tiers"]) == {"small_forward"}, doc["tiers"]
    assert doc["aten_ops_per_module"]["dora"] < doc["aten_ops_per_module"]["lora"], doc["aten_ops_per_module"]
    doc = _run(tmp_path, "--measure", "train", *common)
    assert set(doc["tiers"]) == {"fused_backward"}, doc["tiers"]


def test_autocast_answers_the_device_less_query_as_cuda_does_on_a_gpu(monkeypatch):
    """``--autocast``: PEFT's bitsandbytes layers ask ``torch.is_autocast_enabled()`` without a device, which on a GPU
    answers for CUDA autocast (on: no cast of ``x`` to the adapters' fp32); the stand-in makes the question answer for
    the CPU's autocast, which its steps run under, and leaves questions naming a device alone."""
    import torch

    monkeypatch.syspath_prepend(str(REPO_ROOT / "benchmarks"))
    import host_eager

    monkeypatch.setattr(torch, "is_autocast_enabled", torch.is_autocast_enabled)  # undone after the test
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not torch.is_autocast_enabled()  # what a CPU answers by itself: CUDA's autocast is off
        host_eager._emulate_cuda_autocast_query()
        assert torch.is_autocast_enabled() and torch.is_autocast_enabled("cpu")
        assert not torch.is_autocast_enabled("cuda")
    assert not torch.is_autocast_enabled()


def test_compare_train_record_runs_the_same_ops_without_the_record(tmp_path):
    """``--compare-train-record``: a third model, DoRA with its training record and the direct node apply switched
    off, alternated with the other two; it dispatches the same ATen ops per module as DoRA with them (the record
    skips Python, not work), and its extra over LoRA's is reported beside DoRA's."""
    pytest.importorskip("triton")
    doc = _run(tmp_path, "--measure", "train", "--tiers", "fused", "--graphs", "--compare-train-record")
    ops = doc["aten_ops_per_module"]
    assert set(ops) == {"lora", "dora", "dora_full"} and ops["dora"] == ops["dora_full"], ops
    assert doc["dora_full_extra_us_per_module"] == pytest.approx(
        doc["median_us_per_module"]["dora_full"] - doc["median_us_per_module"]["lora"], abs=0.02
    )
    assert set(doc["tiers"]) == {"fused_backward"}, doc["tiers"]
