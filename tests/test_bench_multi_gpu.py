"""The multi-GPU training benchmark (``benchmarks/bench_multi_gpu.py``): its configuration, plan and refusals, ratios
and the worst-case headline from synthetic records, and one run of the whole launcher on CPU (two gloo processes per
torchrun launch, FSDP2, a tiny Llama; ours and LoRA from the installed peft, upstream too where
``PEFT_UPSTREAM_WHEEL`` names its wheel)."""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile

import pytest
from dora_testing import REPO_ROOT


sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import bench_multi_gpu  # noqa: E402


def _cfg(*argv):
    return bench_multi_gpu.resolve_config(bench_multi_gpu.parse_args(list(argv)))


def test_config_plan_and_engines():
    cfg = _cfg()
    ck = cfg["model"]["config_kwargs"]
    assert (ck["hidden_size"], ck["intermediate_size"], ck["num_attention_heads"], ck["num_key_value_heads"]) == (
        4096, 14336, 32, 8)  # fmt: skip
    assert (ck["vocab_size"], ck["num_hidden_layers"], cfg["ranks"], cfg["seq"], cfg["batch"]) == (
        128256, 4, [16, 128], 4096, 1)  # fmt: skip
    assert _cfg("--shape", "70b")["model"]["config_kwargs"]["hidden_size"] == 8192
    assert _cfg("--shape", "tiny")["model"]["config_kwargs"]["num_hidden_layers"] == 2
    jobs = bench_multi_gpu.plan_jobs(_cfg("--rounds", "2"))
    assert [(j["round"], j["impl"]) for j in jobs] == [
        (0, "upstream"), (0, "ours"), (0, "lora"), (1, "lora"), (1, "ours"), (1, "upstream")]  # fmt: skip
    assert 60 < sum(bench_multi_gpu.estimate_s(cfg, j) for j in jobs) < 540  # the default run fits one call
    assert [_cfg("--engine", e)["engine"] for e in ("fsdp1", "zero2", "zero3")] == ["fsdp1", "zero2", "zero3"]
    with pytest.raises(SystemExit, match="choose from"):
        _cfg("--impls", "ours,qlora")
    with pytest.raises(SystemExit, match="only a GPU run"):
        bench_multi_gpu.main(["--device", "cpu", "--shape", "tiny", "--headline"])


def _rec(impl, rank, rnd, ms, peak=100.0, ok=True, losses=(2.0, 1.9)):
    return {"impl": impl, "rank": rank, "round": rnd, "mode": "bf16", "measure": "train", "median_ms": ms,
            "min_ms": ms, "max_ms": ms, "peak_delta_mb": peak, "losses": list(losses), "step0_loss": losses[0],
            "grad_proof": {"ok": ok, "bad_names": []}}  # fmt: skip


def test_ratios_are_medians_of_per_round_ratios_and_the_headline_is_the_worst_rank():
    cfg = _cfg("--ranks", "16,128")
    recs = [
        _rec("ours", 16, 0, 11.0, 105.0),
        _rec("ours", 16, 1, 24.0, 105.0),
        _rec("lora", 16, 0, 10.0),
        _rec("lora", 16, 1, 20.0),
        _rec("upstream", 16, 0, 33.0, 150.0, losses=(2.001, 1.95)),
        _rec("upstream", 16, 1, 40.0, 150.0, losses=(2.001, 1.95)),
        _rec("ours", 128, 0, 13.0, 120.0),
        _rec("lora", 128, 0, 10.0),
        _rec("upstream", 128, 0, 26.0, 200.0),
    ]
    doc = {"kind": "gpu", "config": cfg, "records": recs}  # fmt: skip
    r16, r128 = bench_multi_gpu.summarize(doc)
    assert r16["dora_over_lora"]["ours"] == pytest.approx(1.15)  # rounds 1.1 and 1.2, not 17.5 / 15
    assert r16["speedup_vs_upstream"] == pytest.approx((3.0 + 40 / 24) / 2, abs=1e-4)
    assert r16["peak_delta_over_lora_pct"] == pytest.approx({"ours": 5.0, "upstream": 50.0})
    assert r16["loss_max_abs_diff_vs_upstream"]["ours"] == pytest.approx(0.05)
    assert bench_multi_gpu.headline_values(doc) == pytest.approx({
        "fsdp2_dora_over_lora_train": 1.3, "fsdp2_train_speedup_vs_upstream": 2.0,
        "multi_gpu_peak_delta_over_lora_pct": 20.0})  # fmt: skip
    recs[6]["grad_proof"]["ok"] = False  # a step that did not train leaves no worst case
    assert bench_multi_gpu.headline_values(doc)["fsdp2_dora_over_lora_train"] is None


@pytest.mark.slow
def test_cpu_smoke_runs_the_whole_launcher(tmp_path):
    """Two torchrun launches (three with upstream) of two gloo processes each: FSDP2 over a tiny Llama, every step's
    gradients proved over the shards, per-step losses all-reduced, the JSON free of machine paths."""
    upstream = os.environ.get("PEFT_UPSTREAM_WHEEL")
    impls = ["ours", "lora"] + (["upstream"] if upstream else [])
    out = tmp_path / "multi_gpu.json"
    rc = bench_multi_gpu.main([
        "--device", "cpu", "--shape", "tiny", "--layers", "2", "--ranks", "4", "--seq", "16", "--steps", "2",
        "--warmup", "1", "--rounds", "1", "--nproc", "2", "--impls", ",".join(impls), "--use-installed",
        "--workdir", str(tmp_path / "work"), "--out", str(out),
    ])  # fmt: skip
    doc = json.loads(out.read_text())
    assert rc == 0 and not doc["errors"], doc["errors"]
    assert doc["kind"] == "cpu_smoke" and {r["impl"] for r in doc["records"]} == set(impls)
    assert all(x["world"] == 2 and x["backend"] == "gloo" for x in doc["launches"])
    for r in doc["records"]:
        assert r["grad_proof"]["ok"] and r["grad_proof"]["steps"] == 3, r["grad_proof"]
        assert r["grad_proof"]["tensors"] == 14 * (3 if r["impl"] != "lora" else 2)
        assert len(r["losses"]) == 3 and all(math.isfinite(x) for x in r["losses"])
        assert len(r["samples_ms"]) == 2 and r["peak_delta_mb"] is None  # no CUDA memory on CPU
    ours = next(r for r in doc["records"] if r["impl"] == "ours")
    assert len(ours["norm_counts"]) == 3 and ours["norm_counts"][0].get("norm_computed") == 14
    (row,) = doc["summary"]
    assert row["dora_over_lora"]["ours"] is not None and math.isfinite(row["dora_over_lora"]["ours"])
    if upstream:
        assert row["speedup_vs_upstream"] is not None
        assert row["loss_max_abs_diff_vs_upstream"]["ours"] < 1e-3  # the same seeded model and data
    text = out.read_text()  # no machine paths: the checkout, /tmp and site-packages are placeholders
    assert str(REPO_ROOT) not in text and tempfile.gettempdir() + "/" not in text, text[:2000]
    assert "site-packages/" not in text.replace("<site-packages>/", ""), text[:2000]
