"""The norm path benchmark (``benchmarks/bench_norm.py``) on the CPU: ``--tiny`` runs every path under the Triton
interpreter (a subprocess: the interpreter must be chosen before Triton is imported) and writes the record: each
path takes every shape, each agrees with the fp64 norm, and each rank and adapter dtype gets a layer sum and a
fastest path; a GPU run refuses to start without CUDA."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from dora_testing import REPO_ROOT


SCRIPT = REPO_ROOT / "benchmarks" / "bench_norm.py"


def _run(tmp_path, *args, interpret: bool = True):
    env = (
        dict(os.environ, TRITON_INTERPRET="1")
        if interpret
        else {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    )
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=600)


def test_tiny_run_times_every_path_and_checks_it(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "bench_norm.json"
    run = _run(tmp_path, "--tiny", "--ranks", "4", "--reps", "1", "--out", str(out))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["kind"] == "cpu_smoke" and doc["schema"] == "bench_norm/1"
    paths = {"kernel", "split", "split_kept", "torch"}
    assert len(doc["rows"]) == 2 * 3 * len(paths)  # two adapter dtypes, three projections
    for row in doc["rows"]:
        assert row["supported"] and math.isfinite(row["us"]) and row["us"] > 0, row
        assert row["max_rel_err"] <= 1e-5, row
    assert [(x["adapter"], x["rank"]) for x in doc["layers"]] == [("fp32", 4), ("bf16", 4)]
    for layer in doc["layers"]:
        assert set(layer["layer_us"]) == paths and layer["fastest"] in paths


def test_gpu_run_needs_cuda(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the refusal is for machines without one")
    run = _run(tmp_path, interpret=False)
    assert run.returncode != 0 and "needs a CUDA GPU" in run.stderr
