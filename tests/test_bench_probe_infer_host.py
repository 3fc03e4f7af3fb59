"""``benchmarks/probe_infer_host.py`` on CPU: every variant runs at a grid point (one decoder layer of the tiny grid
shape: the code paths at a smoke test's cost; a 1B-shaped layer took two minutes of CI), and the record keeps, per
kind and variant, the host and wall times, the time inside the adapted layers and its rounds."""

from __future__ import annotations

import json
import subprocess
import sys

from dora_testing import REPO_ROOT


LABEL = "tiny_llama bf16 r8 seq16 b1 qv drop0"


def test_probe_records_every_kind_and_variant(tmp_path):
    out = tmp_path / "probe.json"
    cmd = [
        sys.executable, str(REPO_ROOT / "benchmarks" / "probe_infer_host.py"), "--device", "cpu", "--layers", "1",
        "--rounds", "2", "--calls", "1", "--points", LABEL, "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    point = json.loads(out.read_text())["points"][LABEL]
    assert set(point) == {"lora default", "lora gc_off", "dora default", "dora gc_off", "dora small"}
    for row in point.values():
        assert row["layer_calls"] == 2  # q and v of the one layer
        assert 0 < row["inside_layers_ms"] <= row["host_ms"] <= row["wall_ms"]
        assert len(row["rounds_host_ms"]) == 2
