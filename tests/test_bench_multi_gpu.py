"""The multi-GPU training benchmark (``benchmarks/bench_multi_gpu.py``): its configuration, plan and refusals, ratios
and the worst-case headline from synthetic records, and one run of the whole launcher on CPU (two gloo processes per
torchrun launch, FSDP2, a tiny Llama; ours and LoRA from the installed peft, upstream too where
``PEFT_UPSTREAM_WHEEL`` names its wheel; then the single-process and the sharded-norm references)."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
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
        (0, "upstream"), (0, "ours"), (0, "lora"), (1, "lora"), (1, "ours"), (1, "upstream"),
        (0, "single"), (0, "norm_check")]  # fmt: skip
    assert 60 < sum(bench_multi_gpu.estimate_s(cfg, j) for j in jobs) < 400  # the default run fits one call
    single, norms = (bench_multi_gpu.job_spec(cfg, j) for j in jobs[-2:])
    assert (single["task"], single["impl"]["name"], single["impl"]["ours"], single["nproc"], single["batch"]) == (
        "single", "single", True, 1, 2)  # fmt: skip
    assert (norms["task"], norms["nproc"], norms["precision"], norms["ranks"]) == ("norm_check", 2, "fp32", [16])
    assert bench_multi_gpu.job_spec(cfg, jobs[0])["task"] == "train"

    def refs(*argv):
        return [j["impl"] for j in bench_multi_gpu.plan_jobs(_cfg(*argv)) if j["impl"] in bench_multi_gpu.REFERENCES]

    assert refs("--no-single") == ["norm_check"] and refs("--no-norm-check") == ["single"]
    assert refs("--engine", "zero3") == refs("--engine", "fsdp1") == ["single"]  # the norm check is FSDP2's
    assert refs("--impls", "upstream,lora") == []  # both references are ours
    assert [_cfg("--engine", e)["engine"] for e in ("fsdp1", "zero2", "zero3")] == ["fsdp1", "zero2", "zero3"]
    with pytest.raises(SystemExit, match="choose from"):
        _cfg("--impls", "ours,qlora")
    assert _cfg("--quant", "nf4")["references"] == ["single"]  # no dense norm to check a quantized base against
    for refused in (("--engine", "fsdp1"), ("--precision", "mp")):
        with pytest.raises(SystemExit, match="FSDP2 with --precision bf16 only"):
            _cfg("--quant", "nf4", *refused)
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
    doc = {"kind": "gpu", "config": cfg, "records": recs, "env": {"gpu": "NVIDIA H100 80GB HBM3"}}  # fmt: skip
    r16, r128 = bench_multi_gpu.summarize(doc)
    assert r16["dora_over_lora"]["ours"] == pytest.approx(1.15)  # rounds 1.1 and 1.2, not 17.5 / 15
    assert r16["speedup_vs_upstream"] == pytest.approx((3.0 + 40 / 24) / 2, abs=1e-4)
    assert r16["peak_delta_over_lora_pct"] == pytest.approx({"ours": 5.0, "upstream": 50.0})
    assert r16["loss_max_abs_diff_vs_upstream"]["ours"] == pytest.approx(0.05)
    assert bench_multi_gpu.headline_values(doc) == pytest.approx({
        "fsdp2_dora_over_lora_train": 1.3, "fsdp2_train_speedup_vs_upstream": 2.0,
        "multi_gpu_peak_delta_over_lora_pct": 20.0, "multi_gpu_gpu": "2x NVIDIA H100 80GB HBM3"})  # fmt: skip
    assert r16["loss_max_abs_diff_vs_single_gpu"] is None  # the references did not run: no keys
    assert not {"multi_gpu_loss_max_abs_diff_vs_single_gpu", "sharded_norm_rel_err_vs_unsharded"} & set(
        bench_multi_gpu.headline_values(doc))  # fmt: skip
    recs += [_rec("single", 16, 0, 20.0, losses=(2.0, 1.8999)), _rec("single", 128, 0, 20.0, losses=(2.0003, 1.9))]
    doc["norm_check"] = {"max_rel_err": 1.234567e-7, "modules": 28, "row_sharded": 28}
    assert bench_multi_gpu.summarize(doc)[0]["loss_max_abs_diff_vs_single_gpu"] == pytest.approx(1e-4)
    headline = bench_multi_gpu.headline_values(doc)
    assert headline["multi_gpu_loss_max_abs_diff_vs_single_gpu"] == pytest.approx(3e-4)  # the worst rank
    assert headline["sharded_norm_rel_err_vs_unsharded"] == pytest.approx(1.23e-7)
    quant = dict(doc, config=_cfg("--ranks", "16,128", "--quant", "nf4"))  # QDoRA vs QLoRA: keys of their own
    assert {"qdora_fsdp2_over_qlora_train", "qdora_fsdp2_train_speedup_vs_upstream",
            "qdora_fsdp2_loss_max_abs_diff_vs_single_gpu"} <= set(bench_multi_gpu.headline_values(quant))  # fmt: skip
    assert not {"fsdp2_dora_over_lora_train", "sharded_norm_rel_err_vs_unsharded"} & set(
        bench_multi_gpu.headline_values(dict(quant, norm_check=None)))  # fmt: skip
    # the 70B-class runs (issue 23's keys): eight_gpu_*, whatever the number of GPUs, which eight_gpu_gpu names
    big = dict(doc, config=_cfg("--ranks", "16,128", "--shape", "70b", "--nproc", "4", "--meta-init"))
    assert bench_multi_gpu.headline_values(dict(big, norm_check=None)) == pytest.approx({
        "eight_gpu_fsdp2_dora_over_lora_train": 1.3, "eight_gpu_fsdp2_speedup_vs_upstream": 2.0,
        "eight_gpu_fsdp2_peak_delta_over_lora_pct": 20.0, "eight_gpu_gpu": "4x NVIDIA H100 80GB HBM3",
        "eight_gpu_fsdp2_loss_max_abs_diff_vs_single_gpu": 3e-4})  # fmt: skip
    big_quant = dict(big, config=_cfg("--ranks", "16,128", "--shape", "70b", "--quant", "nf4", "--meta-init"))
    assert {"eight_gpu_qdora_fsdp2_over_qlora_train", "eight_gpu_gpu"} <= set(
        bench_multi_gpu.headline_values(big_quant)
    )
    recs[6]["grad_proof"]["ok"] = False  # a step that did not train leaves no worst case
    assert bench_multi_gpu.headline_values(doc)["fsdp2_dora_over_lora_train"] is None
    # a run of ours and its references alone sets their keys and leaves the ratios of other runs alone
    alone = dict(doc, config=_cfg("--ranks", "16,128", "--impls", "ours"))
    assert set(bench_multi_gpu.headline_values(alone)) == {
        "multi_gpu_loss_max_abs_diff_vs_single_gpu", "sharded_norm_rel_err_vs_unsharded"}  # fmt: skip


def test_headline_from_several_runs_takes_the_worst_of_each_key(tmp_path, monkeypatch):
    """Runs of one engine in both precisions set the same keys: the headline keeps the worst (smallest speed-up,
    largest ratio, peak and error), an unknown value in either makes it unknown, and the GPUs are named per engine."""
    runs = {
        "bf16.json": ({"fsdp2_dora_over_lora_train": 1.12, "fsdp2_train_speedup_vs_upstream": 1.25,
                       "multi_gpu_peak_delta_over_lora_pct": 0.5, "multi_gpu_gpu": "2x H200"}, "fsdp2"),
        "mp.json": ({"fsdp2_dora_over_lora_train": 1.23, "fsdp2_train_speedup_vs_upstream": 1.06,
                     "multi_gpu_peak_delta_over_lora_pct": None, "multi_gpu_gpu": "2x H200"}, "fsdp2"),
        "zero3.json": ({"zero3_dora_over_lora_train": 0.99, "multi_gpu_gpu": "2x H100"}, "zero3"),
    }  # fmt: skip
    for name, (_, engine) in runs.items():
        (tmp_path / name).write_text(json.dumps({"kind": "gpu", "config": {"engine": engine}, "name": name}))
    monkeypatch.setattr(bench_multi_gpu, "headline_values", lambda doc: dict(runs[doc["name"]][0]))
    headline = tmp_path / "headline.json"
    headline.write_text(json.dumps({"multi_gpu_peak_delta_over_lora_pct": 9.9, "other": 1}))
    bench_multi_gpu.headline_from([str(tmp_path / n) for n in runs], headline)
    assert json.loads(headline.read_text()) == {
        "fsdp2_dora_over_lora_train": 1.23, "fsdp2_train_speedup_vs_upstream": 1.06, "zero3_dora_over_lora_train": 0.99,
        "multi_gpu_gpu": "2x H200 (fsdp2); 2x H100 (zero3)", "other": 1}  # fmt: skip


def test_pool_runs_joins_rounds_of_one_configuration(tmp_path):
    """Pooled runs are one run of all their rounds (renumbered in order), so the ratios are medians over every round,
    not over the first run's; a run of another configuration or GPU is refused."""
    cfg = _cfg("--ranks", "16", "--engine", "zero3", "--rounds", "1")
    first = [_rec("ours", 16, 0, 14.0), _rec("lora", 16, 0, 10.0), _rec("upstream", 16, 0, 20.0)]
    second = [_rec(i, 16, r, ms) for r, (o, lo) in enumerate(((9.0, 10.0), (12.0, 10.0))) for i, ms in
              (("ours", o), ("lora", lo), ("upstream", 20.0))]  # fmt: skip

    def run(name, records, rounds, **env):
        doc = {"kind": "gpu", "config": dict(cfg, rounds=rounds), "records": records, "env": {"gpu": "H200", **env},
               "runs": [{"argv": [name]}], "launches": [{"impl": r["impl"], "round": r["round"]} for r in records],
               "errors": [], "skipped": []}  # fmt: skip
        (tmp_path / name).write_text(json.dumps(doc))
        return str(tmp_path / name)

    a, b = run("a.json", first, 1), run("b.json", second, 2)
    assert bench_multi_gpu.summarize(json.loads(open(a).read()))[0]["dora_over_lora"]["ours"] == pytest.approx(1.4)
    pooled = bench_multi_gpu.pool_runs([a, b])
    assert sorted({r["round"] for r in pooled["records"]}) == [0, 1, 2] and pooled["config"]["rounds"] == 3
    assert [r["argv"] for r in pooled["runs"]] == [["a.json"], ["b.json"]]
    assert pooled["config"]["pooled_from"] == ["a.json", "b.json"]
    assert bench_multi_gpu.summarize(pooled)[0]["dora_over_lora"]["ours"] == pytest.approx(1.2)  # 1.4, 0.9, 1.2
    other = dict(json.loads(open(b).read()), config=dict(cfg, rounds=2, precision="mp"))
    (tmp_path / "c.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="another configuration .precision"):
        bench_multi_gpu.pool_runs([a, str(tmp_path / "c.json")])
    with pytest.raises(SystemExit, match="ran on H100"):
        bench_multi_gpu.pool_runs([a, run("d.json", second, 2, gpu="H100")])


@pytest.mark.slow
def test_cpu_smoke_runs_the_whole_launcher(tmp_path):
    """Three torchrun launches (four with upstream) of two gloo processes each: FSDP2 over a tiny Llama, every step's
    gradients proved over the shards, per-step losses all-reduced, the JSON free of machine paths; then the references:
    ours in one process on the global batch (the same losses) and the sharded norm against the whole one."""
    upstream = os.environ.get("PEFT_UPSTREAM_WHEEL")
    impls = ["ours", "ours_whole_norm", "lora"] + (["upstream"] if upstream else [])
    out = tmp_path / "multi_gpu.json"
    rc = bench_multi_gpu.main([
        "--device", "cpu", "--shape", "tiny", "--layers", "2", "--ranks", "4", "--seq", "16", "--steps", "2",
        "--warmup", "1", "--rounds", "1", "--nproc", "2", "--impls", ",".join(impls), "--use-installed",
        "--workdir", str(tmp_path / "work"), "--out", str(out), "--pairs", "2",
    ])  # fmt: skip
    doc = json.loads(out.read_text())
    assert rc == 0 and not doc["errors"], doc["errors"]
    assert doc["kind"] == "cpu_smoke" and {r["impl"] for r in doc["records"]} == {*impls, "single"}
    assert [x["impl"] for x in doc["launches"]][-2:] == ["single", "norm_check"]
    assert all(x["world"] == (1 if x["impl"] == "single" else 2) and x["backend"] == "gloo" for x in doc["launches"])
    # every DoRA launch also stepped its DoRA against a LoRA twin model in ABBA pairs (two warm-up steps each, then
    # two pairs), every step's gradients proved, the twin's too; LoRA's own launch and the references did not
    paired = [r for r in doc["records"] if r["measure"] == "train_step_paired"]
    assert sorted(r["impl"] for r in paired) == sorted(i for i in impls if i != "lora")
    for r in paired:
        assert r["grad_proof"]["ok"] and r["grad_proof"]["steps"] == 4 and r["grad_proof"]["tensors"] == 42
        assert r["lora_grad_proof"]["ok"] and r["lora_grad_proof"]["tensors"] == 28
        assert len(r["samples_ms"]) == len(r["lora_samples_ms"]) == len(r["pair_ratios"]) == 2
        assert r["ratio_median"] == pytest.approx(statistics.median(d / lo for d, lo in
                                                  zip(r["samples_ms"], r["lora_samples_ms"])), rel=1e-3)  # fmt: skip
    for r in (r for r in doc["records"] if r["measure"] == "train"):
        assert r["grad_proof"]["ok"] and r["grad_proof"]["steps"] == 3, r["grad_proof"]
        assert r["grad_proof"]["tensors"] == 14 * (3 if r["impl"] != "lora" else 2)
        assert len(r["losses"]) == 3 and all(math.isfinite(x) for x in r["losses"])
        assert len(r["samples_ms"]) == 2 and r["peak_delta_mb"] is None  # no CUDA memory on CPU
        # the host's issue time of a step, per process: on a CPU the step itself (nothing runs behind the host)
        world = 1 if r["impl"] == "single" else 2
        assert len(r["host_issue_ms_per_rank"]) == world and all(0 < t for t in r["host_issue_ms_per_rank"])
        assert min(r["host_issue_ms_per_rank"]) <= 1.5 * max(r["local_ms_per_rank"])
        assert r["allocator_per_step_per_rank"] == [None] * world  # the CUDA allocator's counts: none on CPU
    ours = next(r for r in doc["records"] if r["impl"] == "ours")
    assert len(ours["norm_counts"]) == 3 and ours["norm_counts"][0].get("norm_computed") == 14
    # PEFT_DORA_SHARDED_NORM=0 reaches its workers (and only theirs): the whole norm, no all-gather, the same losses
    whole = next(r for r in doc["records"] if r["impl"] == "ours_whole_norm")
    assert all(c.get("norm_gathers") for c in ours["norm_counts"]), ours["norm_counts"]
    assert not any(c.get("norm_gathers") for c in whole["norm_counts"]), whole["norm_counts"]
    assert whole["losses"] == pytest.approx(ours["losses"], abs=1e-5)
    (row,) = doc["summary"]
    assert all(math.isfinite(row["dora_over_lora"][i]) for i in ("ours", "ours_whole_norm"))
    assert all(math.isfinite(row["dora_over_lora_paired"][i]) for i in ("ours", "ours_whole_norm"))
    # the headline's ratio is the pairs' where the run has them, the separate launches' beside it
    assert doc["headline"]["fsdp2_dora_over_lora_train"] == pytest.approx(
        row["dora_over_lora_paired"]["ours"], abs=1e-4
    )
    assert doc["headline"]["fsdp2_dora_over_lora_train_separate"] == pytest.approx(
        row["dora_over_lora"]["ours"], abs=1e-4
    )
    assert all(row["host_issue_ms"][i] > 0 for i in impls)
    # the same rows in one process: equal to the losses' 1e-6 rounding here; one process's rows alone differ by ~1e-2
    assert row["loss_max_abs_diff_vs_single_gpu"] <= 1e-4
    norms = doc["norm_check"]
    assert norms["modules"] == 14 and norms["row_sharded"] > 0 and norms["max_rel_err"] <= 1e-6, norms
    assert doc["headline"]["sharded_norm_rel_err_vs_unsharded"] == pytest.approx(norms["max_rel_err"], abs=1e-9)
    assert doc["headline"]["multi_gpu_loss_max_abs_diff_vs_single_gpu"] <= 1e-4
    if upstream:
        assert row["speedup_vs_upstream"] is not None and row["speedup_vs_upstream_paired"] is not None
        assert row["loss_max_abs_diff_vs_upstream"]["ours"] < 1e-3  # the same seeded model and data
    text = out.read_text()  # no machine paths: the checkout, /tmp and site-packages are placeholders
    assert str(REPO_ROOT) not in text and tempfile.gettempdir() + "/" not in text, text[:2000]
    assert "site-packages/" not in text.replace("<site-packages>/", ""), text[:2000]


@pytest.mark.slow
def test_cpu_smoke_meta_init(tmp_path):
    """``--meta-init`` (FSDP2 for models one GPU cannot hold whole): the decoder layers built on the meta device and
    only each process's shards made real; ours and LoRA train on the same frozen base (its sum over the shards) and
    every step's gradients are proved; no single-process reference; refused with FSDP1 and ZeRO-2."""
    out = tmp_path / "meta.json"
    rc = bench_multi_gpu.main([
        "--device", "cpu", "--shape", "tiny", "--layers", "2", "--ranks", "4", "--seq", "16", "--steps", "2",
        "--warmup", "1", "--rounds", "1", "--nproc", "2", "--impls", "ours,lora", "--use-installed", "--meta-init",
        "--no-norm-check", "--workdir", str(tmp_path / "work"), "--out", str(out), "--pairs", "1",
    ])  # fmt: skip
    doc = json.loads(out.read_text())
    assert rc == 0 and not doc["errors"], doc["errors"]
    assert doc["config"]["meta_init"] and {r["impl"] for r in doc["records"]} == {"ours", "lora"}
    train = [r for r in doc["records"] if r["measure"] == "train"]
    ours, lora = sorted(train, key=lambda r: r["impl"] != "ours")
    assert ours["base_sum"] == lora["base_sum"] and math.isfinite(ours["base_sum"]) and ours["base_sum"] != 0
    for r in (ours, lora):
        assert r["grad_proof"]["ok"] and all(math.isfinite(x) for x in r["losses"]), r
    # ours against a LoRA twin model that the meta-init built and sharded beside it, both proved
    (paired,) = [r for r in doc["records"] if r["measure"] == "train_step_paired"]
    assert paired["impl"] == "ours" and paired["grad_proof"]["ok"] and paired["lora_grad_proof"]["ok"]
    for engine in ("fsdp1", "zero2"):  # they hold whole parameters before they shard
        with pytest.raises(SystemExit, match="meta-init"):
            _cfg("--meta-init", "--engine", engine)
    assert _cfg("--meta-init", "--engine", "zero3")["references"] == []  # built under zero.Init (GPUs only)
    with pytest.raises(SystemExit, match="zero.Init, which needs GPUs"):
        _cfg("--meta-init", "--engine", "zero3", "--device", "cpu")


def test_cpu_smoke_pairs_under_zero3(tmp_path):
    """``--pairs`` under DeepSpeed ZeRO-3: ours and its LoRA twin as two DeepSpeed engines in one launch, stepped in
    ABBA pairs, each side's gradients proved between a backward and its step (after the pairs, untimed); with ours
    alone in the run the headline's ratio is the pairs'."""
    pytest.importorskip("deepspeed")
    out = tmp_path / "zero3.json"
    rc = bench_multi_gpu.main([
        "--device", "cpu", "--shape", "tiny", "--layers", "2", "--ranks", "4", "--seq", "16", "--steps", "1",
        "--warmup", "1", "--rounds", "1", "--nproc", "2", "--impls", "ours", "--use-installed", "--engine", "zero3",
        "--no-single", "--pairs", "2", "--workdir", str(tmp_path / "work"), "--out", str(out),
    ])  # fmt: skip
    doc = json.loads(out.read_text())
    assert rc == 0 and not doc["errors"], doc["errors"]
    (paired,) = [r for r in doc["records"] if r["measure"] == "train_step_paired"]
    assert paired["grad_proof"]["ok"] and paired["grad_proof"]["tensors"] == 42
    assert paired["lora_grad_proof"]["ok"] and paired["lora_grad_proof"]["tensors"] == 28
    assert len(paired["pair_ratios"]) == 2 and all(x > 0 for x in paired["pair_ratios"])
    assert doc["headline"]["zero3_dora_over_lora_train"] == pytest.approx(paired["ratio_median"], abs=1e-4)
    assert "zero3_dora_over_lora_train_separate" not in doc["headline"]  # no LoRA launch to time it against


@pytest.mark.slow
def test_cpu_smoke_qdora_under_fsdp2(tmp_path):
    """``--quant nf4``: the decoder projections bitsandbytes NF4 in bf16 storage, QDoRA and QLoRA under FSDP2 on two
    gloo processes, every step proved, and ours in one process on the global batch with the same losses."""
    pytest.importorskip("bitsandbytes")
    out = tmp_path / "multi_gpu_qdora.json"
    rc = bench_multi_gpu.main([
        "--device", "cpu", "--shape", "tiny", "--layers", "2", "--ranks", "4", "--seq", "16", "--steps", "1",
        "--warmup", "1", "--rounds", "1", "--nproc", "2", "--impls", "ours,lora", "--use-installed", "--quant", "nf4",
        "--workdir", str(tmp_path / "work"), "--out", str(out), "--pairs", "1",
    ])  # fmt: skip
    doc = json.loads(out.read_text())
    assert rc == 0 and not doc["errors"], doc["errors"]
    assert {r["impl"] for r in doc["records"]} == {"ours", "lora", "single"} and "norm_check" not in doc
    assert all(r["grad_proof"]["ok"] for r in doc["records"])
    (paired,) = [r for r in doc["records"] if r["measure"] == "train_step_paired"]  # QDoRA against a QLoRA twin
    assert paired["impl"] == "ours" and paired["lora_grad_proof"]["ok"]
    ours = next(r for r in doc["records"] if r["impl"] == "ours" and r["measure"] == "train")
    assert ours["tiers"].get("w_sq_reused") and ours["tiers"].get("norm_reused")  # kept on the packed shards
    assert doc["summary"][0]["loss_max_abs_diff_vs_single_gpu"] <= 1e-4
    assert set(doc["headline"]) >= {"qdora_fsdp2_over_qlora_train", "qdora_fsdp2_loss_max_abs_diff_vs_single_gpu"}


def test_quantized_layers_builds_a_layer_at_a_time():
    """``--quant`` with ``--meta-init``: each decoder layer made, drawn per parameter name and quantized before the next
    (a 70B model is whole per process only 4-bit); the same values in every process and implementation, a model that
    runs."""
    pytest.importorskip("bitsandbytes")
    import multi_gpu_worker
    import torch

    spec = bench_multi_gpu.resolve_config(bench_multi_gpu.parse_args(
        ["--device", "cpu", "--shape", "tiny", "--layers", "2", "--quant", "nf4", "--meta-init"]))  # fmt: skip
    cpu = torch.device("cpu")
    one, two = (multi_gpu_worker.quantized_layers(spec, cpu, torch.float32) for _ in range(2))
    assert len(one.model.layers) == 2 and one.config.num_hidden_layers == 2
    quantized = [m for m in one.model.layers.modules() if type(m).__name__ == "Linear4bit"]
    assert len(quantized) == 14 and not any(type(m) is torch.nn.Linear for m in one.model.layers.modules())
    for a, b in zip(one.state_dict().values(), two.state_dict().values()):  # bit for bit (packed data can read NaN)
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    ids = torch.randint(0, 128, (1, 8))
    assert torch.isfinite(one(input_ids=ids).logits).all()


def test_compute_gaps_tells_host_from_collective_waits():
    """profile_multi_gpu.compute_gaps on a synthetic trace: a gap whose kernel was launched late is the host's, one
    whose kernel was queued early waits on the collective that ended in it; gaps under 2 µs are launch latency."""
    import profile_multi_gpu

    def kernel(name, ts, dur, stream, corr):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
                "args": {"stream": stream, "correlation": corr}}  # fmt: skip

    def launch(ts, dur, corr):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": dur,
                "args": {"correlation": corr}}  # fmt: skip

    events = [
        kernel("gemm_a", 0, 100, 7, 1), launch(0, 5, 1),
        kernel("gemm_b", 130, 100, 7, 2), launch(120, 5, 2),  # launched at 125, 25 µs after gemm_a ended: host
        kernel("ncclDevKernel_AllGather", 200, 150, 20, 3), launch(10, 5, 3),
        kernel("gemm_c", 400, 50, 7, 4), launch(50, 5, 4),  # queued long before: waited on the all-gather
        kernel("gemm_d", 451, 10, 7, 5), launch(60, 5, 5),  # 1 µs: latency, not counted
        kernel("gemm_e", 480, 10, 7, 6), launch(465, 5, 6),  # launched at 470, gemm_d ended at 461: 9 host, 10 wait
    ]  # fmt: skip
    with_host = events + [
        {"ph": "X", "cat": "cpu_op", "name": "outer", "ts": 90, "dur": 60, "tid": None},
        {"ph": "X", "cat": "cpu_op", "name": "inner", "ts": 100, "dur": 20, "tid": None},
        {"ph": "X", "cat": "python_function", "name": "peft/tuners/lora/dora.py(1): f", "ts": 95, "dur": 40},
        {"ph": "X", "cat": "python_function", "name": "torch/x.py(2): g", "ts": 105, "dur": 10},
    ]  # the first host gap [100, 125], its middle 112.5: inside "inner", and inside g called from our f
    host = profile_multi_gpu.compute_gaps({"traceEvents": with_host}, steps=1)
    assert host["host_gaps_by_op_ms"] == {"inner": pytest.approx(0.025), "(no host op)": pytest.approx(0.009)}
    assert host["host_gaps_by_frame_ms"] == {"torch/x.py(2): g": pytest.approx(0.025)}
    assert host["host_gaps_by_peft_frame_ms"] == {"peft/tuners/lora/dora.py(1): f": pytest.approx(0.025)}
    # a Triton kernel is launched through the driver API: its late launch is the host's too
    driver = [dict(e, cat="cuda_driver") if e.get("args", {}).get("correlation") == 2 and e["cat"] == "cuda_runtime"
              else e for e in events]  # fmt: skip
    assert profile_multi_gpu.compute_gaps({"traceEvents": driver}, steps=1)[
        "idle_waiting_for_host_ms"
    ] == pytest.approx(0.034)
    out = profile_multi_gpu.compute_gaps({"traceEvents": events}, steps=1)
    assert out["stream"] == 7
    assert out["busy_ms"] == pytest.approx(0.27)
    assert out["idle_waiting_for_host_ms"] == pytest.approx((25 + 9) / 1000)
    assert out["idle_waiting_on_other_streams_ms"] == pytest.approx((5 + 170 + 10) / 1000)
    assert out["waits_by_kernel_ms"]["20:ncclDevKernel_AllGather"] == pytest.approx(0.17)
    assert out["waits_by_kernel_ms"]["(nothing ended on another stream)"] == pytest.approx(0.015)
    assert out["host_gaps_by_op_ms"] == {"(no host op)": pytest.approx(0.034)}
    assert profile_multi_gpu.compute_gaps({"traceEvents": []}, steps=1) == {}


def test_pinned_impls_put_each_process_on_its_own_share_of_the_cores():
    """``ours_pinned`` / ``lora_pinned`` set ``BENCH_PIN_CORES=1`` for their workers: each local process runs on its
    own contiguous share of the cores it was allowed (by ``LOCAL_RANK``), and without the variable nothing is pinned."""
    assert bench_multi_gpu.IMPLS["ours_pinned"]["env"] == {"BENCH_PIN_CORES": "1"}
    assert not bench_multi_gpu.IMPLS["lora_pinned"]["dora"]
    code = (
        "import json, os, sys; sys.path.insert(0, sys.argv[1]); import multi_gpu_worker as w; "
        "before = sorted(os.sched_getaffinity(0)); got = w.pin_cores(); "
        "print(json.dumps([before, got, sorted(os.sched_getaffinity(0))]))"
    )
    bench = str(REPO_ROOT / "benchmarks")

    def affinity(**pin) -> tuple:  # (cores before, pin_cores()'s answer, cores after) of a fresh process
        env = {k: v for k, v in os.environ.items() if k != "BENCH_PIN_CORES"}
        done = subprocess.run([sys.executable, "-c", code, bench], capture_output=True, text=True,
                              env=dict(env, **pin), timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.splitlines()[-1])

    for local in (0, 1):
        before, got, after = affinity(BENCH_PIN_CORES="1", LOCAL_RANK=str(local), LOCAL_WORLD_SIZE="2")
        if len(before) < 2:
            assert got is None
            continue
        share = len(before) // 2
        assert got == after == before[local * share : (local + 1) * share]
    before, got, after = affinity()  # unset: nothing pinned
    assert got is None and after == before
