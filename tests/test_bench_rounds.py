"""The model benchmark's rounds: interleaved job order, one record per measure with every round kept, and ratios
taken per round (a pair measured together) rather than across rounds."""

from __future__ import annotations

import sys

import pytest
from dora_testing import REPO_ROOT


sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import bench_model  # noqa: E402


def _rec(impl, median, rnd, peak=100.0, measure="train"):
    return {
        "impl": impl,
        "mode": "bf16",
        "rank": 8,
        "measure": measure,
        "median_ms": median,
        "min_ms": median - 1,
        "max_ms": median + 1,
        "samples_ms": [median],
        "peak_delta_mb": peak,
        "round": rnd,
    }


def _doc(records):
    return {"config": {"headline_rank": 8}, "env": {}, "speed": bench_model.collapse_rounds(records)}


def test_plan_interleaves_rounds_and_repeats_only_the_round_impls():
    args = bench_model.parse_args(
        ["--tiny", "--tasks", "speed", "--modes", "bf16", "--impls", "upstream,ours_fused,lora", "--rounds", "3"]
        + ["--round-impls", "ours_fused,lora"]
    )
    jobs = bench_model.plan_jobs(bench_model.resolve_config(args))
    order = [(j["round"], j["impl"]) for j in jobs]
    assert order == [
        (0, "upstream"), (0, "ours_fused"), (0, "lora"),
        (1, "lora"), (1, "ours_fused"),
        (2, "ours_fused"), (2, "lora"),
    ]  # fmt: skip


def test_one_round_keeps_the_record_as_it_is():
    recs = [_rec("lora", 10.0, 0), _rec("ours_fused", 11.0, 0)]
    doc = _doc(recs)
    assert all("rounds" not in r for r in doc["speed"])
    assert bench_model.time_ratio(doc, "ours_fused", "lora", "bf16", "train", 8) == 1.1


def test_rounds_collapse_to_the_median_and_keep_each_round():
    recs = [_rec("lora", m, k, peak=p) for k, (m, p) in enumerate([(10.0, 90.0), (30.0, 100.0), (12.0, 95.0)])]
    (r,) = bench_model.collapse_rounds(recs)
    assert r["median_ms"] == 12.0
    assert (r["min_ms"], r["max_ms"]) == (9.0, 31.0)
    assert r["peak_delta_mb"] == 100.0  # the largest peak of any round
    assert [x["median_ms"] for x in r["rounds"]] == [10.0, 30.0, 12.0]
    assert "round" not in r and "samples_ms" not in r


def test_ratio_is_the_median_of_paired_ratios():
    # a slow phase in round 1 slows both; the paired ratios (1.1, 1.2, 1.05) have median 1.1, while the ratio of the
    # medians (22 / 12 = 1.83) would pair round 1's DoRA with another round's LoRA
    lora = [_rec("lora", m, k) for k, m in enumerate([10.0, 20.0, 12.0])]
    ours = [_rec("ours_fused", m, k) for k, m in enumerate([11.0, 24.0, 12.6])]
    doc = _doc(lora + ours)
    assert bench_model.time_ratio(doc, "ours_fused", "lora", "bf16", "train", 8) == pytest.approx(1.1)
    head = bench_model.headline_values(doc)
    assert head["dora_over_lora_train_bf16"] == pytest.approx(1.1)


def test_ratio_falls_back_to_medians_when_rounds_do_not_pair():
    ups = [_rec("upstream", 30.0, 0)]
    ours = [_rec("ours_fused", m, k) for k, m in enumerate([10.0, 14.0, 12.0])]
    doc = _doc(ups + ours)
    assert bench_model.time_ratio(doc, "upstream", "ours_fused", "bf16", "train", 8) == 2.5
    assert bench_model.time_ratio(doc, "upstream", "lora", "bf16", "train", 8) is None


def _run_doc(records):
    """A whole run document, as ``--merge`` reads it."""
    return {
        "kind": "gpu", "env": {"gpu": "G"}, "runs": [], "impls": {}, "speed": records, "fidelity": {},
        "convergence": {"losses": {}}, "profile": {}, "errors": [], "skipped": [],
        "config": {"ranks": [8], "impls": [], "modes": ["bf16"], "measures": ["train"], "tasks": ["speed"]},
    }  # fmt: skip


def test_merge_replaces_a_mode_and_rank_as_a_whole():
    old = _run_doc([_rec("lora", 10.0, 0), _rec("ours_fused_reuse", 9.0, 0), dict(_rec("lora", 5.0, 0), rank=64)])
    new = _run_doc([_rec("lora", 12.0, 0), _rec("ours_fused", 13.0, 0)])
    merged = bench_model.merge_docs([old, new])
    rows = {(r["impl"], r["rank"]): r["median_ms"] for r in merged["speed"]}
    # the older run's reuse row at (bf16, 8) goes: the newer run measured that mode and rank without it
    assert rows == {("lora", 8): 12.0, ("ours_fused", 8): 13.0, ("lora", 64): 5.0}


def test_headline_drops_keys_the_run_did_not_measure(tmp_path):
    path = tmp_path / "headline.json"
    path.write_text('{"dora_over_lora_decode_norm_cache": 0.9, "by_hand": 3.4}')
    doc = dict(_doc([_rec("lora", 10.0, 0), _rec("ours_fused", 11.0, 0)]), kind="gpu")
    bench_model.update_headline(doc, path)
    head = __import__("json").loads(path.read_text())
    assert head["dora_over_lora_train_bf16"] == 1.1 and head["by_hand"] == 3.4
    assert "dora_over_lora_decode_norm_cache" not in head  # this run had no NORM_CACHE row: no stale value stays


def _paired(median, lora, ratios, rnd, mode="bf16"):
    rec = _rec("ours_fused", median, rnd, measure="decode_per_token_paired")
    rec.update(mode=mode, lora_median_ms=lora, lora_samples_ms=[lora], pair_ratios=ratios)
    rec["ratio_median"] = sorted(ratios)[len(ratios) // 2]
    return rec


def test_paired_decode_pools_every_pair_of_every_round():
    # round 0 ran in a slow host phase (both models slow): its pairs still count as ratios, not as absolute times
    recs = [_paired(20.0, 19.0, [1.05, 1.1, 0.95], 0), _paired(10.0, 10.0, [1.0, 0.9, 1.02], 1)]
    (r,) = bench_model.collapse_rounds(recs)
    assert r["pair_ratios"] == [1.05, 1.1, 0.95, 1.0, 0.9, 1.02]
    assert r["ratio_median"] == pytest.approx(1.01)  # median of the six pairs
    assert [x["ratio_median"] for x in r["rounds"]] == [1.05, 1.0]
    assert r["lora_median_ms"] == pytest.approx(14.5) and "lora_samples_ms" not in r
    head = bench_model.headline_values(_doc(recs))
    assert head["dora_over_lora_decode_paired_bf16"] == pytest.approx(1.01)
    assert head["dora_over_lora_decode_paired"] is None  # no autocast row


def test_paired_decode_plans_its_cost_only_for_the_paired_impls():
    args = ["--tasks", "speed", "--modes", "bf16", "--impls", "ours_fused,ours_eager", "--ranks", "384"]
    plain = bench_model.resolve_config(bench_model.parse_args(args + ["--measures", "decode"]))
    paired = bench_model.resolve_config(bench_model.parse_args(args + ["--measures", "decode,decode_paired"]))
    assert paired["decode_paired"] == {"pairs": 8, "impls": ["ours_fused"]}
    cost = {
        (impl, which): bench_model.estimate_s(cfg, {"impl": impl, "tasks": ["speed"]})
        for impl in ("ours_fused", "ours_eager")
        for which, cfg in (("plain", plain), ("paired", paired))
    }
    assert cost["ours_fused", "paired"] > cost["ours_fused", "plain"]
    assert cost["ours_eager", "paired"] == cost["ours_eager", "plain"]
    with pytest.raises(SystemExit, match="lora"):  # plain LoRA has no DoRA to pair
        bench_model.resolve_config(bench_model.parse_args(args + ["--paired-impls", "lora"]))


def test_merge_keeps_a_paired_decode_run_beside_the_main_run():
    main = _run_doc([_rec("lora", 10.0, 0), _rec("ours_fused", 11.0, 0)])
    paired = _run_doc([_paired(12.0, 12.0, [1.0, 1.02], 0)])
    newer_paired = _run_doc([_paired(12.0, 12.0, [0.99, 0.97], 0)])
    for docs in ([main, paired], [paired, main]):  # either order: the paired row lives beside the main rows
        merged = bench_model.merge_docs(docs)
        assert len(merged["speed"]) == 3
    merged = bench_model.merge_docs([main, paired, newer_paired])  # a newer paired run replaces the older one only
    assert [r["pair_ratios"] for r in merged["speed"] if "pair_ratios" in r] == [[0.99, 0.97]]
    assert len(merged["speed"]) == 3


def test_compare_report_names_the_tier_that_ran():
    """benchmarks/compare.py: times and ratios per mode and measure, and a label that says when only the eager tier
    ran (a CPU run is not reported as fused)."""
    import compare

    def rec(impl, measure, ms, tiers=None):
        return {"impl": impl, "mode": "autocast", "rank": 16, "measure": measure, "median_ms": ms, "tiers": tiers or {}}

    cfg = {"model": {"config_kwargs": {"hidden_size": 2048, "num_hidden_layers": 4}, "seq": 1024, "batch": 1},
           "ranks": [16], "modes": ["autocast"], "measures": ["train", "infer"]}  # fmt: skip
    speed = [
        rec("upstream", "train", 30.0), rec("ours_fused", "train", 12.0, {"eager": 56}), rec("lora", "train", 10.0)
    ]  # fmt: skip
    doc = {"config": cfg, "env": {"gpu": "NVIDIA H200"}, "speed": speed, "errors": []}
    text = compare.report(doc)
    assert "autocast train" in text and "1.200" in text and "2.50" in text and "infer" not in text.split("\n", 3)[3]
    assert "eager tier only" in text
    speed[1]["tiers"] = {"fused_backward": 56, "norm_computed": 56}
    assert "ours (tiers: fused_backward)" in compare.report(doc)


def _compiled_doc(records, ranks=(8,)):
    cfg = {"headline_rank": 8, "compile": "default", "modes": ["bf16"], "ranks": list(ranks)}
    return {"config": cfg, "env": {"gpu": "G"}, "speed": bench_model.collapse_rounds(records)}


def _pair(measure, ratios, rnd, ok=True, graphs=0, rank=8):
    rec = dict(_rec("ours_fused", 10.0, rnd, measure=measure), rank=rank, pair_ratios=ratios, lora_median_ms=9.0,
               ratio_median=sorted(ratios)[len(ratios) // 2], tiers={"compiled_graphs": graphs})  # fmt: skip
    if measure == "train_step_paired":
        rec["grad_proof"] = {"ok": ok}
    return rec


def test_compiled_keys_come_from_the_pairs_with_a_compiled_lora_twin():
    """A --compile run's compiled_dora_over_lora_* keys: the worst over its points of the pairs' median (every pair of
    every round), the separately timed processes' ratio in ``_separate``; a failed proof or a missing point leaves
    the key None; graphs compiled while pairs were timed count as recompiles."""
    separate = [_rec(impl, ms, k, measure=m) for k in (0, 1) for impl, ms in (("ours_fused", 11.0), ("lora", 10.0))
                for m in ("train", "infer")]  # fmt: skip
    pairs = [_pair("train_step_paired", [1.02, 1.06], 0), _pair("train_step_paired", [1.04, 1.2], 1),
             _pair("infer_step_paired", [0.99, 1.01], 0), _pair("infer_step_paired", [1.0, 1.03], 1)]  # fmt: skip
    head = bench_model.headline_values(_compiled_doc(separate + pairs))
    assert head["compiled_dora_over_lora_train"] == pytest.approx(1.05)  # median of 1.02, 1.06, 1.04, 1.2
    assert head["compiled_dora_over_lora_infer"] == pytest.approx(1.005)
    assert head["compiled_dora_over_lora_train_separate"] == pytest.approx(1.1)
    assert head["compiled_recompiles_after_warmup"] == 0
    pairs[1] = _pair("train_step_paired", [1.04, 1.2], 1, ok=False)
    pairs[3] = _pair("infer_step_paired", [1.0, 1.03], 1, graphs=2)
    head = bench_model.headline_values(_compiled_doc(separate + pairs))
    assert head["compiled_dora_over_lora_train"] is None and head["compiled_recompiles_after_warmup"] == 2
    # a run before the pairs: the separately timed ratios; a point without pairs in a run that has them: no worst case
    assert bench_model.headline_values(_compiled_doc(separate))["compiled_dora_over_lora_infer"] == pytest.approx(1.1)
    more = separate + [dict(r, rank=64) for r in separate] + [_pair("infer_step_paired", [1.0], 0)]
    assert bench_model.headline_values(_compiled_doc(more, ranks=(8, 64)))["compiled_dora_over_lora_infer"] is None


def test_compiled_headline_over_runs_is_the_worst_case_and_names_its_file():
    """Several --compile runs (e.g. long sequences on one GPU, short on another) give each compiled key's worst case
    over them, with the file it came from; a run that lacks a key leaves that key without a worst case."""
    separate = [_rec(impl, ms, 0, measure=m) for impl, ms in (("ours_fused", 11.0), ("lora", 10.0), ("upstream", 30.0))
                for m in ("train", "infer")]  # fmt: skip
    long_run = _compiled_doc(separate + [_pair("train_step_paired", [1.1], 0), _pair("infer_step_paired", [1.02], 0)])
    slow = [dict(r, median_ms=r["median_ms"] * (1.5 if r["impl"] == "ours_fused" else 1.0)) for r in separate]
    short_run = _compiled_doc(slow + [_pair("train_step_paired", [1.6], 0), _pair("infer_step_paired", [1.4], 0)])
    short_run["env"]["gpu"] = "H"
    head = bench_model.compiled_headline_over_runs([("long.json", long_run), ("short.json", short_run)])
    assert head["compiled_dora_over_lora_train"] == pytest.approx(1.6)
    assert head["compiled_dora_over_lora_train_at"] == "short.json"
    assert head["compiled_dora_over_lora_infer_separate"] == pytest.approx(1.65)
    assert head["compiled_train_speedup_vs_upstream"] == pytest.approx(30 / 16.5, abs=1e-4)  # rounded to 4 places
    assert head["compiled_train_speedup_vs_upstream_at"] == "short.json"
    assert head["compiled_points"] == 2 and head["compiled_recompiles_after_warmup"] == 0
    assert head["compiled_gpu"] == "G (long.json); H (short.json)"
    no_pairs = _compiled_doc([dict(r, rank=8) for r in separate] + [_pair("train_step_paired", [1.1], 0, ok=False)])
    head = bench_model.compiled_headline_over_runs([("long.json", long_run), ("bad.json", no_pairs)])
    assert head["compiled_dora_over_lora_train"] is None and head["compiled_dora_over_lora_train_at"] is None


def test_compile_runs_the_speed_task_of_upstream_ours_fused_and_lora_by_default():
    """``--compile`` alone is a valid run: the speed task only (the others refuse compile) and no ``ours_eager``
    (under torch.compile both of ours trace the same PyTorch output), unless asked for."""
    cfg = bench_model.resolve_config(bench_model.parse_args(["--compile", "default", "--ranks", "8"]))
    assert cfg["tasks"] == ["speed"] and cfg["impls"] == ["upstream", "ours_fused", "lora"]
    asked = bench_model.parse_args(["--compile", "default", "--impls", "ours_eager,lora", "--tasks", "speed"])
    assert bench_model.resolve_config(asked)["impls"] == ["ours_eager", "lora"]
