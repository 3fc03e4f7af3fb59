"""The QDoRA benchmark (``benchmarks/bench_qdora.py``): its plan and split into device calls, ratios taken per round,
the worst-case headline, merging and the fidelity metrics; unloading adapters from a quantized base; and one run of
the whole pipeline on CPU (slow: a model build and two worker subprocesses)."""

from __future__ import annotations

import json
import math
import shlex
import sys
from pathlib import Path

import pytest
import torch
from dora_testing import REPO_ROOT

from tools import upstream


sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import bench_qdora  # noqa: E402
import qdora_worker  # noqa: E402


def _cfg(*argv):
    return bench_qdora.resolve_config(bench_qdora.parse_args(list(argv)))


def test_default_config_is_llama31_8b_shaped_and_tiny_is_small():
    cfg = _cfg()
    m = cfg["model"]
    assert (m["hidden_size"], m["intermediate_size"], m["num_attention_heads"], m["num_key_value_heads"]) == (
        4096, 14336, 32, 8)  # fmt: skip
    assert (m["vocab_size"], m["num_hidden_layers"], m["rope_scaling"]["rope_type"]) == (128256, 4, "llama3")
    assert (cfg["quants"], cfg["ranks"], cfg["seq"], cfg["batch"]) == (
        ["nf4", "fp4", "int8"],
        [16, 64, 128, 384],
        4096,
        1,
    )
    assert cfg["fidelity"]["rank"] == 16 and cfg["fidelity"]["quant"] == "nf4" and cfg["fidelity"]["seq"] == 256
    tiny = _cfg("--tiny", "--device", "cpu")
    assert (tiny["model"]["hidden_size"], tiny["model"]["num_hidden_layers"], tiny["seq"], tiny["ranks"]) == (
        64, 2, 32, [4, 8])  # fmt: skip
    assert all(bench_qdora.estimate_s(tiny, j) == 0 for j in bench_qdora.plan_jobs(tiny))
    assert _cfg("--warmup", "0")["warmup"] == 1  # the static allocation must hold AdamW's state
    with pytest.raises(SystemExit, match="choose from"):
        _cfg("--quants", "nf4,q3")


def test_plan_alternates_impls_over_rounds_and_splits_the_default_run_into_calls():
    cfg = _cfg("--rounds", "3")
    jobs = bench_qdora.plan_jobs(cfg)
    assert [(j["round"], j["impl"]) for j in jobs] == [
        (0, "ours"), (0, "upstream"), (1, "upstream"), (1, "ours"), (2, "ours"), (2, "upstream")]  # fmt: skip
    assert [j["fidelity"] for j in jobs] == [True, True] + [False] * 4
    assert jobs[0]["kinds"] == ["qdora", "qlora"] and jobs[1]["kinds"] == ["qdora"]
    assert _cfg("--upstream-qlora")["kinds"]["upstream"] == ["qdora", "qlora"]

    cfg = _cfg()
    total = bench_qdora.BUILD_S + sum(bench_qdora.estimate_s(cfg, j) for j in bench_qdora.plan_jobs(cfg))
    assert total > 540  # the default run does not fit one 10-minute call
    calls = bench_qdora.plan_calls(cfg, 510)
    assert sorted(q for c in calls for q in c["quants"]) == sorted(cfg["quants"])
    assert all(c["s"] <= 510 for c in calls) and sum(c["fidelity"] for c in calls) == 1
    for k, call in enumerate(calls, 1):
        cmd = bench_qdora.call_command(cfg, call, k, " --ours-wheel o.whl --upstream-wheel u.whl")
        assert len(cmd) < 2000 and f"--out $OUT/qdora_{k}.json" in cmd
        words = shlex.split(cmd.split("2>&1")[0])
        again = _cfg(*words[words.index("benchmarks/bench_qdora.py") + 1 :])
        assert again["quants"] == call["quants"] and bool(again["fidelity"]) == call["fidelity"]
        assert {key: again[key] for key in ("ranks", "rounds", "modes", "seq", "model")} == {
            key: cfg[key] for key in ("ranks", "rounds", "modes", "seq", "model")}  # fmt: skip


def _rec(impl, kind, quant, rank, rnd, train, peak=100.0, ok=True, mode="autocast"):
    """A worker record: infer = train / 4, decode = train / 10."""
    return {
        "impl": impl, "kind": kind, "quant": quant, "mode": mode, "rank": rank, "round": rnd, "step0_loss": 2.0,
        "train": {"median_ms": train, "peak_delta_mb": peak, "static_mb": 1000.0,
                  "grad_proof": {"ok": ok, "bad_names": [] if ok else ["lora_A.default.weight"]}},
        "infer": {"median_ms": train / 4}, "decode": {"median_ms": train / 10},
    }  # fmt: skip


def _doc(records, quants=("nf4",), ranks=(16,), fidelity=None, kind="gpu"):
    cfg = dict(_cfg(), quants=list(quants), ranks=list(ranks), modes=["autocast"], fidelity=fidelity)
    return {"kind": kind, "env": {"gpu": "G"}, "config": cfg, "impls": {}, "records": records, "fidelity": {},
            "runs": [], "errors": [], "skipped": []}  # fmt: skip


def _point(quant, rank, ours, lora, up, peak=(105.0, 100.0, 150.0), rounds=(0, 1)):
    """Per-round train times of ours QDoRA, ours QLoRA and upstream QDoRA at one point."""
    return [
        _rec(impl, kind, quant, rank, k, ms[i], peak=p)
        for i, k in enumerate(rounds)
        for impl, kind, ms, p in (("ours", "qdora", ours, peak[0]), ("ours", "qlora", lora, peak[1]),
                                  ("upstream", "qdora", up, peak[2]))
    ]  # fmt: skip


def test_ratios_are_medians_of_per_round_ratios():
    doc = _doc(_point("nf4", 16, ours=[11.0, 24.0], lora=[10.0, 20.0], up=[33.0, 40.0]))
    (row,) = bench_qdora.summarize(doc)
    # per round 1.1 and 1.2 (the ratio of the medians would be 17.5 / 15)
    assert row["qdora_over_qlora"]["ours"] == pytest.approx({"train": 1.15, "infer": 1.15, "decode": 1.15})
    assert row["qdora_over_qlora"]["upstream"]["train"] == pytest.approx((3.3 + 2.0) / 2)  # over ours' QLoRA
    assert row["speedup_vs_upstream"]["train"] == pytest.approx((3.0 + 40 / 24) / 2)
    assert row["peak_delta_over_qlora_pct"] == pytest.approx({"ours": 5.0, "upstream": 50.0})
    assert row["ms"]["ours_qdora"]["train"] == 17.5 and row["step0_loss"]["upstream_qdora"] == 2.0
    # upstream's own QLoRA, where it ran one, is its baseline
    doc["records"] += [_rec("upstream", "qlora", "nf4", 16, k, 30.0, peak=140.0) for k in (0, 1)]
    (row,) = bench_qdora.summarize(doc)
    assert row["qdora_over_qlora"]["upstream"]["train"] == pytest.approx((1.1 + 40 / 30) / 2)
    assert row["peak_delta_over_qlora_pct"]["upstream"] == pytest.approx(100 * (150 / 140 - 1))
    # an implementation that ran in other rounds only: the ratio of the medians
    doc = _doc(_point("nf4", 16, [11.0], [10.0], [30.0], rounds=(0,)) + [_rec("ours", "qdora", "nf4", 16, 1, 13.0)])
    doc["records"] = [
        r for r in doc["records"] if not (r["impl"] == "ours" and r["kind"] == "qdora" and r["round"] == 0)
    ]
    assert bench_qdora.summarize(doc)[0]["qdora_over_qlora"]["ours"]["train"] == pytest.approx(1.3)


def test_qdora_over_qlora_comes_from_each_impls_pairs_where_they_ran():
    """QDoRA/QLoRA of each measure: the median over every pair of every round with the impl's own twin (upstream's
    too, over its LoRA twin, not ours' QLoRA a minute apart); the separately timed measures only where a round has no
    pairs, and none where a training pair failed its gradient proof."""
    doc = _doc(_point("nf4", 16, ours=[11.0, 24.0], lora=[10.0, 20.0], up=[33.0, 40.0]))
    pairs = {("ours", 0): [1.02, 1.04], ("ours", 1): [0.98, 1.30, 1.01], ("upstream", 0): [2.0], ("upstream", 1): [3.0]}
    for r in doc["records"]:
        if r["kind"] == "qdora":
            ratios = pairs[(r["impl"], r["round"])]
            r["decode_paired"] = {"pair_ratios": ratios, "ratio_median": 0.0}  # not read
            r["train_paired"] = {"pair_ratios": [x + 0.1 for x in ratios], "grad_proof": {"dora": {"ok": True}}}
    (row,) = bench_qdora.summarize(doc)
    assert row["qdora_over_qlora"]["ours"]["decode"] == pytest.approx(1.02)  # median of the five
    assert row["qdora_over_qlora"]["upstream"]["decode"] == pytest.approx(2.5)
    assert row["qdora_over_qlora"]["ours"]["train"] == pytest.approx(1.12)
    assert row["qdora_over_qlora"]["ours"]["infer"] == pytest.approx(1.15)  # no infer pairs: per round as before
    # upstream over ours: the ratio of their paired QDoRA/QLoRA where both ran pairs (the grid's speed-up), the
    # separately timed times' per-round ratio beside it and where pairs are missing
    assert row["speedup_vs_upstream"]["decode"] == pytest.approx(2.5 / 1.02)
    assert row["speedup_vs_upstream"]["train"] == pytest.approx(2.6 / 1.12)
    assert row["speedup_vs_upstream_separate"]["decode"] == pytest.approx((3.0 + 40 / 24) / 2)
    assert row["speedup_vs_upstream"]["infer"] == pytest.approx((3.0 + 40 / 24) / 2)  # no infer pairs: per round
    assert bench_qdora.headline_values(doc)["qdora_over_qlora_decode"] == 1.02
    doc["records"][0]["train_paired"]["grad_proof"]["dora"]["ok"] = False
    assert bench_qdora.summarize(doc)[0]["qdora_over_qlora"]["ours"]["train"] is None
    assert bench_qdora.summarize(doc)[0]["speedup_vs_upstream"]["train"] is None
    del doc["records"][0]["decode_paired"]  # a round without pairs: back to the separately timed decodes
    assert bench_qdora.summarize(doc)[0]["qdora_over_qlora"]["ours"]["decode"] == pytest.approx(1.15)


def test_headline_is_the_worst_case_over_4bit_and_ranks():
    records = (
        _point("nf4", 16, ours=[12.0, 12.0], lora=[10.0, 10.0], up=[24.0, 24.0])  # 1.2, speed-up 2.0
        + _point("nf4", 384, ours=[10.5, 10.5], lora=[10.0, 10.0], up=[15.0, 15.0], peak=(130.0, 100.0, 200.0))
        + _point("fp4", 16, ours=[11.0, 11.0], lora=[10.0, 10.0], up=[33.0, 33.0])
        + _point("fp4", 384, ours=[10.0, 10.0], lora=[10.0, 10.0], up=[30.0, 30.0])
        + _point("int8", 16, ours=[14.0, 14.0], lora=[10.0, 10.0], up=[14.0, 14.0])  # not in the qdora_* keys
        + _point("int8", 384, ours=[13.0, 13.0], lora=[10.0, 10.0], up=[13.0, 13.0])
    )
    doc = _doc(records, quants=("nf4", "fp4", "int8"), ranks=(16, 384))
    doc["records"] += [dict(r, mode="none", train=dict(r["train"], median_ms=99.0)) for r in records[:3]]  # ignored
    doc["config"]["modes"] = ["autocast", "none"]
    head = bench_qdora.headline_values(doc)
    assert (head["qdora_over_qlora_train"], head["qdora_over_qlora_train_at"]) == (1.2, "nf4 r16")
    assert head["qdora_over_qlora_infer"] == 1.2 and head["qdora_over_qlora_decode"] == 1.2
    assert (head["qdora_peak_delta_over_qlora_pct"], head["qdora_peak_delta_over_qlora_pct_at"]) == (30.0, "nf4 r384")
    assert (head["qdora_train_speedup_vs_upstream"], head["qdora_train_speedup_vs_upstream_at"]) == (
        round(15 / 10.5, 4), "nf4 r384")  # fmt: skip
    assert (head["qdora_int8_over_lora_train"], head["qdora_int8_over_lora_train_at"]) == (1.4, "int8 r16")
    assert "qdora_err_vs_fp32_ratio_to_upstream" not in head  # no fidelity configured: not a key of this run
    # a 4-bit-only run leaves the int8 key out; a point missing leaves no worst case (None: the key is dropped)
    four = _doc(records[:6], quants=("nf4", "fp4"), ranks=(16, 384))
    assert "qdora_int8_over_lora_train" not in bench_qdora.headline_values(four)
    assert bench_qdora.headline_values(_doc(records[:3], quants=("nf4", "fp4")))["qdora_over_qlora_train"] is None


def test_headline_of_several_runs_takes_each_keys_worst_and_names_its_run(tmp_path):
    long = _doc(_point("nf4", 16, ours=[10.5, 10.5], lora=[10.0, 10.0], up=[20.0, 20.0]))  # 1.05, speed-up 1.9
    short = _doc(_point("nf4", 16, ours=[15.0, 15.0], lora=[10.0, 10.0], up=[18.0, 18.0]))  # 1.5, speed-up 1.2
    short["env"]["gpu"] = "H"
    head = bench_qdora.worst_of_runs([("qdora.json", long), ("qdora_seq1024.json", short)])
    assert head["qdora_over_qlora_train"] == 1.5 and head["qdora_over_qlora_train_at"] == "nf4 r16 (qdora_seq1024.json)"
    assert head["qdora_train_speedup_vs_upstream"] == 1.2  # the smaller speed-up is the worse one
    assert head["qdora_gpu"] == "G / H"
    short["records"] = [r for r in short["records"] if r["kind"] != "qlora"]  # a run that lost its QLoRA
    assert bench_qdora.worst_of_runs([("a", long), ("b", short)])["qdora_over_qlora_train"] is None
    path = tmp_path / "headline.json"
    path.write_text(json.dumps({"qdora_over_qlora_train": 9.0, "by_hand": 1}))
    argv = ["--headline", str(path), "--headline-of"]
    for name, doc in (
        ("qdora.json", long),
        ("qdora_seq1024.json", _doc(_point("nf4", 16, [12.0] * 2, [10.0] * 2, [24.0] * 2))),
    ):
        (tmp_path / name).write_text(json.dumps(doc))
        argv.append(str(tmp_path / name))
    assert bench_qdora.main(argv) == 0
    written = json.loads(path.read_text())
    assert written["qdora_over_qlora_train"] == 1.2 and written["by_hand"] == 1
    # a run that left a key unmeasured drops it, and with it where an older run had measured it
    (tmp_path / "qdora_seq1024.json").write_text(json.dumps(short))
    assert written["qdora_over_qlora_train_at"] == "nf4 r16 (qdora_seq1024.json)"
    assert bench_qdora.main(argv) == 0
    written = json.loads(path.read_text())
    assert "qdora_over_qlora_train" not in written and "qdora_over_qlora_train_at" not in written


def test_a_training_step_that_failed_its_gradient_proof_leaves_the_headline(tmp_path):
    records = _point("nf4", 16, ours=[20.0, 11.0], lora=[10.0, 10.0], up=[30.0, 30.0])
    records[0]["train"]["grad_proof"] = {"ok": False, "bad_names": ["lora_A.default.weight"]}  # ours QDoRA round 0
    doc = _doc(records)
    (row,) = bench_qdora.summarize(doc)
    assert row["qdora_over_qlora"]["ours"]["train"] is None and row["speedup_vs_upstream"]["train"] is None
    assert row["qdora_over_qlora"]["ours"]["infer"] == pytest.approx((2.0 + 1.1) / 2)  # its other measures stand
    path = tmp_path / "headline.json"
    path.write_text(json.dumps({"by_hand": 1, "qdora_over_qlora_train": 1.05}))
    bench_qdora.update_headline(doc, path)
    written = json.loads(path.read_text())
    assert written["by_hand"] == 1 and "qdora_over_qlora_train" not in written  # no older value stays
    assert written["qdora_over_qlora_infer"] == 1.55
    # the driver reports it as an error, and a worker that died without a word as one too
    run = _doc([])
    bench_qdora.absorb(run, {"records": records[:1], "errors": [], "skipped": []}, {"impl": "ours", "round": 0}, 0)
    bench_qdora.absorb(run, {"records": [], "errors": [], "skipped": []}, {"impl": "upstream", "round": 0}, -9)
    assert [e["task"] for e in run["errors"]] == ["grad_proof", "worker"] and len(run["records"]) == 1


def test_update_headline_refuses_cpu_numbers_outside_cpu_smoke(tmp_path):
    doc = _doc(_point("nf4", 16, [11.0, 11.0], [10.0, 10.0], [30.0, 30.0]), kind="cpu_smoke")
    with pytest.raises(SystemExit, match="cpu_smoke"):
        bench_qdora.update_headline(doc, tmp_path / "headline.json")
    assert bench_qdora.update_headline(doc, tmp_path / "cpu_smoke" / "headline.json")["qdora_over_qlora_train"] == 1.1


def test_merge_takes_each_point_from_the_latest_run():
    a = _doc(_point("nf4", 16, [11.0, 11.0], [10.0, 10.0], [30.0, 30.0]), fidelity={"rank": 16})
    a["fidelity"] = {"ours_err_over_upstream_err": {"logits": 0.9}}
    b = _doc(_point("nf4", 16, [12.0, 12.0], [10.0, 10.0], [30.0, 30.0]) + _point("fp4", 64, [13.0] * 2, [10.0] * 2,
             [30.0] * 2), quants=("fp4", "nf4"), ranks=(64, 16))  # fmt: skip
    merged = bench_qdora.merge_docs([a, b])
    assert merged["config"]["quants"] == ["nf4", "fp4"] and merged["config"]["ranks"] == [16, 64]
    rows = {(r["quant"], r["rank"]): r for r in bench_qdora.summarize(merged)}
    assert rows[("nf4", 16)]["qdora_over_qlora"]["ours"]["train"] == pytest.approx(1.2)  # b's, not a's
    assert rows[("fp4", 64)]["qdora_over_qlora"]["ours"]["train"] == pytest.approx(1.3)
    assert merged["fidelity"] == a["fidelity"] and merged["config"]["fidelity"] == {"rank": 16}  # b has none
    assert bench_qdora.headline_values(merged)["qdora_err_vs_fp32_ratio_to_upstream"] == 0.9
    c = _doc([])
    c["config"]["seq"] = 512
    with pytest.raises(SystemExit, match="cannot merge"):
        bench_qdora.merge_docs([a, c])


def test_fidelity_metrics_compare_each_impl_with_the_fp32_reference(tmp_path):
    g = torch.Generator().manual_seed(0)
    ref = {"logits": torch.randn(4, 10, generator=g), "loss": 2.0,
           "grads": {k: torch.randn(50, generator=g) for k in qdora_worker.GRAD_KINDS}}  # fmt: skip

    def off(scale):
        return {"logits": ref["logits"] * (1 + scale), "loss": 2.0 + scale,
                "grads": {k: v * (1 + scale) for k, v in ref["grads"].items()}}  # fmt: skip

    files = {}
    for name, payload in (("reference", ref), ("upstream", off(2e-3)), ("ours", off(1e-3))):
        files[name] = tmp_path / f"{name}.pt"
        torch.save(payload, files[name])
    assert bench_qdora.fidelity_metrics({"ours": files["ours"]}) == {}  # nothing to compare with yet
    metrics = bench_qdora.fidelity_metrics(files)
    assert metrics["ours"]["logits"]["rel"] == pytest.approx(1e-3, rel=1e-3)  # fp32 payloads
    assert metrics["upstream"]["grad_magnitude"]["max_abs"] == pytest.approx(
        2e-3 * ref["grads"]["magnitude"].abs().max().item(), rel=1e-3)  # fmt: skip
    assert set(metrics["ours_err_over_upstream_err"]) == {"logits", "grad_lora_A", "grad_lora_B", "grad_magnitude"}
    assert all(v == pytest.approx(0.5, rel=1e-3) for v in metrics["ours_err_over_upstream_err"].values())


def test_unload_gives_back_the_quantized_base(tmp_path):
    """What the worker relies on to load each quantization once: a QDoRA model unloaded and wrapped again computes
    what a freshly loaded one does, and the bnb layers are back (the installed peft, on bitsandbytes' CPU backend)."""
    pytest.importorskip("bitsandbytes")
    cfg = _cfg("--tiny", "--device", "cpu")
    qdora_worker.build_model({"model": cfg["model"], "seed": 0, "device": "cpu", "dir": str(tmp_path)})
    ids = qdora_worker.token_batch(cfg, 16, "cpu")

    def logits(base, dora=True):
        model = qdora_worker.wrap(base, 4, dora)
        qdora_worker.seed_adapters(model, 0, cfg["model"]["initializer_range"])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(input_ids=ids, use_cache=False).logits
        return out, model.unload()

    for quant in ("nf4", "int8"):
        base = qdora_worker.load_quantized(str(tmp_path), quant, torch.device("cpu"))
        n = qdora_worker.quantized_layers(base)
        first, base = logits(base)
        _, base = logits(base, dora=False)
        again, base = logits(base)
        assert qdora_worker.quantized_layers(base) == n == 14 and not any(hasattr(m, "lora_A") for m in base.modules())
        fresh, _ = logits(qdora_worker.load_quantized(str(tmp_path), quant, torch.device("cpu")))
        torch.testing.assert_close(again, first, rtol=0, atol=0)
        torch.testing.assert_close(fresh, first, rtol=0, atol=0)


@pytest.mark.slow
def test_cpu_smoke_runs_the_whole_pipeline(tmp_path):
    """``--device cpu --tiny`` end to end: model build, both installs, a worker per implementation (one round), both
    quantization families, fidelity with the fp32 reference, JSON, plot and headline. Ours is the installed package
    (an install directory: the same path as a built wheel's ``--target``)."""
    pytest.importorskip("bitsandbytes")
    import peft

    out = tmp_path / "cpu_smoke" / "qdora.json"
    headline = tmp_path / "cpu_smoke" / "headline.json"
    rc = bench_qdora.main([
        "--device", "cpu", "--tiny", "--quants", "nf4,int8", "--ranks", "4", "--rounds", "1",
        "--workdir", str(tmp_path / "work"), "--out", str(out), "--headline", str(headline),
        "--ours-wheel", str(Path(peft.__file__).resolve().parent.parent), "--upstream-wheel", str(upstream.wheel()),
    ])  # fmt: skip
    doc = json.loads(out.read_text())
    assert doc["kind"] == "cpu_smoke" and doc["env"]["bitsandbytes"]
    text = out.read_text()  # no machine paths: the checkout, install targets and site-packages are placeholders
    assert str(REPO_ROOT) not in text and "site-packages/" not in text.replace("<site-packages>/", ""), text[:2000]
    # upstream's own dequantize_module_weight re-wraps an Int8Params on CPU and loses its scales: its int8 QDoRA
    # fails there (not on a GPU); nothing else may
    assert {(e["impl"], e.get("quant")) for e in doc["errors"]} <= {("upstream", "int8")}
    assert rc == (1 if doc["errors"] else 0)
    files = {name: info["peft_file"] for name, info in doc["impls"].items()}
    assert files["ours"] != files["upstream"] and doc["impls"]["ours"]["ours"] and not doc["impls"]["upstream"]["ours"]
    got = {(r["impl"], r["kind"], r["quant"]) for r in doc["records"]}
    assert {("ours", k, q) for k in ("qdora", "qlora") for q in ("nf4", "int8")} | {("upstream", "qdora", "nf4")} <= got
    for r in doc["records"]:
        assert r["train"]["grad_proof"]["ok"] and r["train"]["grad_proof"]["tensors"] == 14 * (
            3 if r["kind"] == "qdora" else 2
        )
        assert all(math.isfinite(r[m]["median_ms"]) for m in qdora_worker.MEASURES)
        if r["kind"] == "qdora":  # pairs with a QLoRA twin on the same base, which is gone afterwards
            for m in qdora_worker.PAIRED:
                ratios = r[f"{m}_paired"]["pair_ratios"]
                assert len(ratios) == 2 and all(math.isfinite(x) and x > 0 for x in ratios)
            proofs = r["train_paired"]["grad_proof"]
            assert proofs["dora"]["ok"] and proofs["lora"]["ok"]
            assert (proofs["dora"]["tensors"], proofs["lora"]["tensors"]) == (14 * 3, 14 * 2)
    ours_dora = [r for r in doc["records"] if r["impl"] == "ours" and r["kind"] == "qdora"]
    assert all("eager" in r["train"]["tiers"] and "DoRA compositions" in r["dora_summary"] for r in ours_dora)
    step0 = {(r["impl"], r["quant"]): r["step0_loss"] for r in doc["records"] if r["kind"] == "qdora"}
    assert step0[("ours", "nf4")] == pytest.approx(step0[("upstream", "nf4")], abs=1e-2)  # the same seeded model
    (nf4,) = [r for r in doc["summary"] if r["quant"] == "nf4"]
    assert None not in (*nf4["qdora_over_qlora"]["ours"].values(), *nf4["speedup_vs_upstream"].values())
    fid = doc["fidelity"]
    assert all(fid[i][k]["rel"] < 0.05 for i in ("ours", "upstream") for k in fid["ours_err_over_upstream_err"])
    assert all(math.isfinite(v) for v in fid["ours_err_over_upstream_err"].values())
    written = json.loads(headline.read_text())
    assert {"qdora_over_qlora_train", "qdora_int8_over_lora_train", "qdora_err_vs_fp32_ratio_to_upstream"} <= set(
        written
    )
    # a run whose JSON was lost: the same document again from the worker results its workdir kept
    again = tmp_path / "cpu_smoke" / "qdora_assembled.json"
    bench_qdora.main([
        "--device", "cpu", "--tiny", "--quants", "nf4,int8", "--ranks", "4", "--rounds", "1",
        "--from-workdir", str(tmp_path / "work"), "--out", str(again),
    ])  # fmt: skip
    rebuilt = json.loads(again.read_text())
    assert rebuilt["records"] == doc["records"] and rebuilt["summary"] == doc["summary"]
    assert rebuilt["fidelity"] == doc["fidelity"] and rebuilt["runs"][0]["assembled_from_workdir"]
