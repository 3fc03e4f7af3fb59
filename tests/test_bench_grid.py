"""The model benchmark's grid (``bench_model.py --grid``): its design, its split into device calls, the worst-case
headline, and the gradient proof that every timed training step must pass."""

from __future__ import annotations

import json
import statistics
import sys

import pytest
import torch
from dora_testing import REPO_ROOT


sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import bench_model  # noqa: E402
import model_worker  # noqa: E402


def _cfg(*extra):
    return bench_model.resolve_config(bench_model.parse_args(["--grid", "default", *extra]))


def test_default_grid_has_40_points_and_every_axis_extreme():
    points = _cfg()["grid"]["points"]
    assert len(points) >= 40
    assert len({p["label"] for p in points}) == len(points)
    axes = {key: {p[key] for p in points} for key in ("shape", "mode", "rank", "seq", "batch", "targets", "dropout")}
    assert axes["shape"] == {"llama1b", "llama3b", "llama8b", "qwen1.5b"}
    assert axes["mode"] == {"autocast", "bf16"}
    assert (min(axes["rank"]), max(axes["rank"])) == (8, 768)
    assert (min(axes["seq"]), max(axes["seq"])) == (512, 4096)
    assert (min(axes["batch"]), max(axes["batch"])) == (1, 8)
    assert axes["targets"] == {"qv", "all"} and axes["dropout"] == {0.0, 0.05}
    assert any(p["accum4"] for p in points) and all(p["batch"] * p["seq"] <= 8192 for p in points)
    # what people run is over-represented: small ranks, short sequences, dropout 0.05, autocast
    for common in (lambda p: p["rank"] <= 64, lambda p: p["seq"] <= 2048, lambda p: p["dropout"] == 0.05,
                   lambda p: p["mode"] == "autocast"):  # fmt: skip
        assert sum(map(common, points)) > len(points) / 2
    assert {tuple(p["modules"]) for p in points} == {("q_proj", "v_proj"), bench_model.PROJECTIONS}


def test_grid_runs_in_interleaved_rounds_within_four_device_calls():
    cfg = _cfg()
    order = [(j["round"], j["impl"]) for j in bench_model.plan_jobs(cfg)]
    assert order == [(0, "upstream"), (0, "ours_fused"), (0, "lora"), (1, "lora"), (1, "ours_fused")]
    calls = bench_model.plan_calls(cfg)
    assert 1 <= len(calls) <= 4 and all(c["s"] <= bench_model.CALL_BUDGET_S for c in calls)  # one per shape
    assert sorted(s for c in calls for s in c["shapes"]) == sorted(bench_model.GRID_SHAPES)
    command = bench_model.call_command("default", calls[0], 1)
    assert f"--grid-shapes {','.join(calls[0]['shapes'])}" in command and len(command) < 2000
    one = _cfg("--grid-shapes", "llama8b", "--modes", "bf16")["grid"]["points"]
    assert {(p["shape"], p["mode"]) for p in one} == {("llama8b", "bf16")}
    assert bench_model.grid_measures(cfg, "upstream") == ["train_step_paired"]
    assert set(bench_model.PAIRED) <= set(bench_model.grid_measures(cfg, "ours_fused"))
    assert cfg["grid"]["train_pairs"] == bench_model.GRID_TRAIN_PAIRS
    with pytest.raises(SystemExit, match="--grid"):
        _cfg("--ranks", "8")


def _point(shape, mode, rank, accum4=False):
    where = dict(shape=shape, mode=mode, rank=rank, seq=512, batch=1, targets="all", dropout=0.05)
    return dict(where, label=bench_model.point_label(**where), modules=list(bench_model.PROJECTIONS), accum4=accum4)


def _rec(impl, point, measure, ms, rnd=0, ok=True, **extra):
    rec = {"impl": impl, "point": point["label"], "mode": point["mode"], "rank": point["rank"], "measure": measure,
           "median_ms": ms, "min_ms": ms, "max_ms": ms, "samples_ms": [ms], "round": rnd, **extra}  # fmt: skip
    if measure in bench_model.TRAIN_MEASURES:
        rec["grad_proof"] = {"ok": ok, "bad_names": [] if ok else ["lora_B.default.weight"]}
    return rec


def _grid_doc(points, records):
    cfg = {"grid": {"name": "default", "points": points, "models": {}}, "modes": ["autocast", "bf16"]}
    return {"kind": "gpu", "env": {"gpu": "G"}, "config": cfg, "speed": bench_model.collapse_rounds(records)}


def _point_records(point, ours, lora, upstream, decode, rounds=(0, 1)):
    """ours/lora: per-round train times (infer = train / 4, accum = 4 x train); decode: the pair ratios."""
    recs = [_rec("upstream", point, "train", upstream)]
    for k in rounds:
        for impl, ms in (("ours_fused", ours[k]), ("lora", lora[k])):
            recs += [_rec(impl, point, "train", ms, k), _rec(impl, point, "infer", ms / 4, k)]
            if point["accum4"]:
                recs.append(_rec(impl, point, "train_accum4", 4 * ms, k))
        recs.append(_rec("ours_fused", point, "decode_step_paired", 10.0, k, pair_ratios=decode, ratio_median=decode[0],
                         lora_median_ms=10.0))  # fmt: skip
    return recs


def test_headline_is_the_worst_point_per_measure_and_mode():
    a = _point("llama1b", "autocast", 8, accum4=True)
    b = _point("llama8b", "autocast", 64)
    c = _point("llama8b", "bf16", 768)
    records = (
        _point_records(a, ours=[12.0, 11.0], lora=[10.0, 10.0], upstream=30.0, decode=[1.02])  # 1.2, 1.1: 1.15
        + _point_records(b, ours=[10.5, 30.0], lora=[10.0, 25.0], upstream=21.0, decode=[1.08])  # 1.05, 1.2: 1.125
        + _point_records(c, ours=[13.0, 13.0], lora=[10.0, 10.0], upstream=52.0, decode=[0.97])  # 1.3
    )
    head = bench_model.headline_values(_grid_doc([a, b, c], records))
    assert head["grid_points"] == 3
    assert head["grid_worst_dora_over_lora_train"] == pytest.approx(1.15)
    assert head["grid_worst_dora_over_lora_train_at"].startswith(a["label"])  # its step and accum4 step tie
    assert head["grid_worst_dora_over_lora_train_bf16"] == pytest.approx(1.3)
    assert head["grid_worst_dora_over_lora_infer"] == pytest.approx(1.15)
    assert head["grid_worst_dora_over_lora_infer_bf16_at"] == c["label"]
    assert head["grid_worst_dora_over_lora_decode"] == pytest.approx(1.08)  # over both modes
    assert head["grid_worst_dora_over_lora_decode_at"] == b["label"]
    assert head["grid_median_dora_over_lora_train"] == pytest.approx(1.15)  # of 1.15, 1.15 (accum4), 1.125, 1.3
    # upstream ran once: its time over the median of ours' rounds; smallest at b (21 / 20.25)
    assert head["grid_worst_speedup_vs_upstream_train"] == pytest.approx(21 / 20.25, abs=1e-4)
    assert head["grid_worst_speedup_vs_upstream_train_at"] == b["label"]


def test_mixed_grid_reaches_its_axes_and_writes_only_its_own_headline_keys():
    """``--grid mixed`` (fp32 adapters beside the bf16 base without autocast): its own points, every axis' extremes,
    and a headline of ``grid_mixed_*`` / ``*_mixed`` keys only, so that its run leaves the default grid's keys alone
    (and a default grid's headline has none of its keys)."""
    cfg = bench_model.resolve_config(bench_model.parse_args(["--grid", "mixed"]))
    points = cfg["grid"]["points"]
    assert cfg["modes"] == ["mixed"] and {p["mode"] for p in points} == {"mixed"}
    axes = {key: {p[key] for p in points} for key in ("shape", "rank", "seq", "targets", "dropout")}
    assert axes["shape"] == set(bench_model.GRID_SHAPES) and (min(axes["rank"]), max(axes["rank"])) == (8, 768)
    assert (min(axes["seq"]), max(axes["seq"])) == (512, 4096) and axes["targets"] == {"qv", "all"}
    assert axes["dropout"] == {0.0, 0.05} and all(p["batch"] * p["seq"] <= 8192 for p in points)
    assert all(c["s"] <= bench_model.CALL_BUDGET_S for c in bench_model.plan_calls(cfg))
    a, b = _point("llama1b", "mixed", 8), _point("llama8b", "mixed", 64)
    records = _point_records(a, ours=[12.0, 12.0], lora=[10.0, 10.0], upstream=30.0, decode=[1.02])
    records += _point_records(b, ours=[11.0, 11.0], lora=[10.0, 10.0], upstream=30.0, decode=[1.07])
    doc = _grid_doc([a, b], records)
    doc["config"]["grid"]["name"], doc["config"]["modes"] = "mixed", ["mixed"]
    head = bench_model.headline_values(doc)
    assert head["grid_mixed_points"] == 2 and head["grid_mixed_gpu"] == "G"
    assert head["grid_worst_dora_over_lora_train_mixed"] == pytest.approx(1.2)
    assert head["grid_worst_dora_over_lora_train_mixed_at"] == a["label"]
    assert head["grid_worst_dora_over_lora_infer_mixed"] == pytest.approx(1.2)
    assert head["grid_worst_dora_over_lora_decode_mixed"] == pytest.approx(1.07)
    assert head["grid_mixed_worst_speedup_vs_upstream_train_at"] == a["label"]
    assert all(k.startswith("grid_mixed_") or "_mixed" in k for k in head)
    default = bench_model.headline_values(_grid_doc([a, b], records))
    assert not any("mixed" in k for k in default) and default["grid_worst_dora_over_lora_train"] is None


def test_a_record_that_failed_its_gradient_proof_leaves_the_headline(tmp_path, capsys):
    a = _point("llama1b", "autocast", 8)
    b = _point("llama3b", "autocast", 16)
    records = _point_records(a, ours=[20.0, 20.0], lora=[10.0, 10.0], upstream=40.0, decode=[1.0])
    records += _point_records(b, ours=[11.0, 11.0], lora=[10.0, 10.0], upstream=40.0, decode=[1.0])
    records[1]["grad_proof"] = {"ok": False, "bad_names": ["lora_A.default.weight"]}  # a's round-0 DoRA step
    assert records[1]["impl"] == "ours_fused" and records[1]["measure"] == "train"
    doc = _grid_doc([a, b], records)
    head = bench_model.headline_values(doc)
    assert head["grid_worst_dora_over_lora_train"] == pytest.approx(1.1)  # a's 2.0 is not a measurement
    assert head["grid_worst_dora_over_lora_train_at"] == b["label"] and head["grid_points"] == 1
    assert len(bench_model.proof_failures(doc)) == 1
    path = tmp_path / "headline.json"
    path.write_text('{"by_hand": 1}')
    bench_model.update_headline(doc, path)
    assert "gradient proof failed" in capsys.readouterr().err
    written = json.loads(path.read_text())
    assert written["by_hand"] == 1 and written["grid_worst_dora_over_lora_train"] == pytest.approx(1.1)
    # a grid training record without any proof fails too
    del records[1]["grad_proof"]
    assert not bench_model.proof_ok(bench_model.collapse_rounds(records[1:2])[0])


def test_headline_refuses_cpu_grid_numbers(tmp_path):
    a = _point("llama1b", "autocast", 8)
    doc = dict(_grid_doc([a], _point_records(a, [11.0, 11.0], [10.0, 10.0], 30.0, [1.0])), kind="cpu_smoke")
    with pytest.raises(SystemExit, match="cpu_smoke"):
        bench_model.update_headline(doc, tmp_path / "headline.json")


def test_merge_joins_the_grids_of_several_calls():
    a, b = _point("llama8b", "autocast", 8), _point("llama1b", "bf16", 64)
    docs = []
    for p in (a, b):
        doc = _grid_doc([p], _point_records(p, [11.0, 11.0], [10.0, 10.0], 30.0, [1.0]))
        doc.update(runs=[], impls={}, fidelity={}, convergence={"losses": {}}, profile={}, errors=[], skipped=[])
        doc["config"].update(ranks=[p["rank"]], impls=[], measures=[], tasks=["speed"])
        doc["config"]["grid"]["models"] = {p["shape"]: {}}
        docs.append(doc)
    merged = bench_model.merge_docs(docs)
    assert [p["label"] for p in merged["config"]["grid"]["points"]] == [a["label"], b["label"]]
    assert set(merged["config"]["grid"]["models"]) == {"llama8b", "llama1b"}
    assert bench_model.headline_values(merged)["grid_points"] == 2


def _adapter_params():
    """Named parameters as a LoRA/DoRA model has them, each with a gradient."""
    names = ("lora_A.default.weight", "lora_B.default.weight", "lora_magnitude_vector.default.weight")
    params = [(f"q_proj.{n}", torch.nn.Parameter(torch.ones(4, 3))) for n in names]
    for _, p in params:
        p.grad = torch.full_like(p, 0.5)
    return params


def test_gradient_proof_passes_real_gradients_and_keeps_their_norms():
    proof = model_worker.GradProof(torch.nn.Module())
    proof.params = _adapter_params()
    proof()
    proof()
    result = proof.result()
    assert result["ok"] and result["steps"] == 2 and result["tensors"] == 3 and result["bad_tensors"] == 0
    assert result["grad_norm_by_kind"] == pytest.approx({"lora_A": 3**0.5, "lora_B": 3**0.5, "magnitude": 3**0.5})
    assert result["grad_norm"] == pytest.approx(3.0)  # twelve elements of 0.5 per tensor, three tensors


@pytest.mark.parametrize("broken", ["zero", "nan", "inf", "missing"])
def test_gradient_proof_fails_a_step_that_did_not_train(broken):
    proof = model_worker.GradProof(torch.nn.Module())
    proof.params = _adapter_params()
    proof()  # a good step first: one bad step fails the record
    grad = proof.params[1][1]
    if broken == "missing":
        grad.grad = None
    else:
        grad.grad.fill_({"zero": 0.0, "nan": float("nan"), "inf": float("inf")}[broken])
    proof()
    result = proof.result()
    assert not result["ok"] and result["bad_tensors"] == 1
    assert result["bad_names"] == ["q_proj.lora_B.default.weight"]
    assert model_worker.GradProof(torch.nn.Module()).result()["ok"] is False  # no step, no trainable tensor: no proof


def test_gradient_proof_checks_every_timed_step_of_a_real_model():
    """``speed_rank`` proves each training step of a small wrapped model; with B = 0 (PEFT's init, A's gradient is
    then zero) the proof fails."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    model.lora_A = torch.nn.Linear(8, 2, bias=False)
    model.lora_B = torch.nn.Linear(2, 8, bias=False)
    for p in model[0].parameters():
        p.requires_grad_(False)
    x = torch.randn(4, 8)

    def step():
        (model[0](x) + model.lora_B(model.lora_A(x))).square().sum().backward()

    zero = lambda: model.zero_grad(set_to_none=True)  # noqa: E731
    proof = model_worker.GradProof(model)
    model_worker.measure(step, torch.device("cpu"), 1, 2, before=zero, after=proof)
    assert proof.result() | {"grad_norm": None, "grad_norm_by_kind": None} == {
        "ok": True, "steps": 3, "tensors": 2, "bad_tensors": 0, "bad_names": [], "grad_norm": None,
        "grad_norm_by_kind": None,
    }  # fmt: skip
    torch.nn.init.zeros_(model.lora_B.weight)
    model_worker.measure(step, torch.device("cpu"), 1, 2, before=zero, after=proof)
    assert proof.result()["bad_names"] == ["lora_A.weight"]


def test_paired_training_steps_give_their_own_worst_case_and_need_their_proof():
    """``train_step_paired`` (DoRA and a LoRA twin stepped back to back in one process): the worst per-point median
    of the pair ratios per mode, beside the subprocess ``train`` keys; a record whose proof failed gives no ratio."""
    a = _point("llama1b", "autocast", 8)
    b = _point("llama3b", "autocast", 16)
    c = _point("llama8b", "bf16", 64)
    records = []
    for point, ratios in ((a, [1.3, 1.1, 1.2]), (b, [1.05, 1.4, 1.1]), (c, [1.02, 1.04, 1.06])):
        records += _point_records(point, ours=[11.0, 11.0], lora=[10.0, 10.0], upstream=30.0, decode=[1.0])
        records.append(_rec("ours_fused", point, "train_step_paired", 10.0, 0, pair_ratios=ratios,
                            ratio_median=sorted(ratios)[1], lora_median_ms=9.0,
                            grad_proof={"ok": True}, lora_grad_proof={"ok": True}))  # fmt: skip
    head = bench_model.headline_values(_grid_doc([a, b, c], records))
    assert head["grid_worst_dora_over_lora_train_paired"] == pytest.approx(1.2)  # a's 1.2 over b's 1.1
    assert head["grid_worst_dora_over_lora_train_paired_at"] == a["label"]
    assert head["grid_worst_dora_over_lora_train_paired_bf16"] == pytest.approx(1.04)
    assert head["grid_worst_dora_over_lora_train"] == pytest.approx(1.1) and head["grid_points"] == 3
    assert head["grid_median_dora_over_lora_train_paired"] == pytest.approx(1.1)  # of 1.2, 1.1 and 1.04
    records[-1]["grad_proof"] = {"ok": False, "bad_names": ["lora_magnitude_vector.default.weight"]}
    head = bench_model.headline_values(_grid_doc([a, b, c], records))
    assert head["grid_worst_dora_over_lora_train_paired_bf16"] is None and head["grid_points"] == 2


def test_speedup_over_upstream_is_the_ratio_of_the_two_processes_paired_ratios():
    """Where upstream's training step was paired with its own LoRA twin in its process, the speed-up is upstream's
    DoRA/LoRA over ours' (each from steps back to back, so a host's drift between the two processes cancels), not
    the separately timed steps' ratio; a failed proof on either side leaves the point out."""
    a = _point("llama1b", "autocast", 16)
    b = _point("llama8b", "bf16", 64)
    records = []
    for point, ours, up in ((a, 1.1, 1.65), (b, 1.2, 1.5)):
        # the separate steps say otherwise (a slow phase of the host under ours): they must not be read
        records += _point_records(point, ours=[30.0, 30.0], lora=[10.0, 10.0], upstream=15.0, decode=[1.0])
        records = [r for r in records if not (r["impl"] == "upstream" and r["measure"] == "train")]
        for impl, ratio in (("ours_fused", ours), ("upstream", up)):
            records.append(_rec(impl, point, "train_step_paired", 10.0 * ratio, 0, pair_ratios=[ratio],
                                ratio_median=ratio, lora_median_ms=10.0,
                                grad_proof={"ok": True}, lora_grad_proof={"ok": True}))  # fmt: skip
    head = bench_model.headline_values(_grid_doc([a, b], records))
    assert head["grid_worst_speedup_vs_upstream_train"] == pytest.approx(1.25)  # b: 1.5 / 1.2, a: 1.65 / 1.1
    assert head["grid_worst_speedup_vs_upstream_train_at"] == b["label"]
    records[-1]["grad_proof"] = {"ok": False, "bad_names": ["lora_B.default.weight"]}  # b's upstream side
    head = bench_model.headline_values(_grid_doc([a, b], records))
    assert head["grid_worst_speedup_vs_upstream_train"] == pytest.approx(1.5)
    assert head["grid_worst_speedup_vs_upstream_train_at"] == a["label"]


def test_inference_keys_come_from_the_paired_forward_where_the_run_has_it():
    """``infer_step_paired`` (the DoRA and the LoRA-twin forward back to back in one process) replaces the separately
    timed ``infer`` in the inference keys; a run without it keeps the separately timed one."""
    a = _point("qwen1.5b", "autocast", 8)
    b = _point("llama1b", "bf16", 768)
    records = []
    for point, ratios in ((a, [1.3, 1.1, 1.2]), (b, [0.98, 1.02, 1.0])):
        records += _point_records(point, ours=[20.0, 20.0], lora=[10.0, 10.0], upstream=30.0, decode=[1.0])  # infer 2.0
        records.append(_rec("ours_fused", point, "infer_step_paired", 5.0, 0, pair_ratios=ratios,
                            ratio_median=sorted(ratios)[1], lora_median_ms=4.0))  # fmt: skip
    head = bench_model.headline_values(_grid_doc([a, b], records))
    assert head["grid_worst_dora_over_lora_infer"] == pytest.approx(1.2) and head["grid_points"] == 2
    assert head["grid_worst_dora_over_lora_infer_at"] == a["label"]
    assert head["grid_worst_dora_over_lora_infer_bf16"] == pytest.approx(1.0)
    before = [r for r in records if r["measure"] != "infer_step_paired"]
    assert bench_model.headline_values(_grid_doc([a, b], before))["grid_worst_dora_over_lora_infer"] == 2.0


def test_paired_record_keeps_the_collector_s_pauses_per_sample():
    """``alternate`` records, per timed call, the garbage collector's pause time and full collections in it: a full
    collection forced into every LoRA call shows on LoRA's side only."""
    import gc

    def lora():
        gc.collect()
        return 2.0

    out = model_worker.alternate("probe", {"dora": lambda: 1.0, "lora": lora}, pairs=4, warmup=1)
    assert out["pair_ratios"] == [0.5] * 4
    assert out["gc_full"] == {"dora": [0, 0, 0, 0], "lora": [1, 1, 1, 1]}
    assert all(ms > 0 for ms in out["gc_ms"]["lora"]) and len(out["gc_ms"]["dora"]) == 4
    assert model_worker.GcWatch not in map(type, gc.callbacks)  # removed again


def test_a_third_side_runs_in_every_round_and_gives_its_own_ratios():
    """``alternate`` with a ``cached`` side (DoRA under DoraCaching): it runs in every round, the order reversed every
    other round, and the record keeps its ratios to LoRA and to DoRA of the same round, which the grid headline's
    ``grid_worst_cached_over_uncached_*`` keys take the worst of; the DoRA/LoRA fields stay those of two sides."""
    order = []

    def side(name, ms):
        return lambda: order.append(name) or ms

    out = model_worker.alternate(
        "probe", {"dora": side("d", 3.0), "lora": side("l", 2.0), "cached": side("c", 1.5)}, pairs=2, warmup=0
    )
    assert "".join(order) == "dlccld"
    assert out["pair_ratios"] == [1.5, 1.5] and out["cached_samples_ms"] == [1.5, 1.5]
    assert out["cached_ratios"] == [0.75, 0.75] and out["cached_ratio_median"] == 0.75
    assert out["cached_over_dora_ratios"] == [0.5, 0.5] and out["cached_over_dora_ratio_median"] == 0.5
    assert set(out["gc_ms"]) == {"dora", "lora", "cached"}

    a = _point("llama1b", "autocast", 8)
    b = _point("llama8b", "bf16", 64)
    records = []
    for point, cached in ((a, [[0.9, 0.8], [0.95]]), (b, [[1.0, 1.04], [1.06]])):
        records += _point_records(point, ours=[11.0, 11.0], lora=[10.0, 10.0], upstream=20.0, decode=[1.0])
        for rec, ratios in zip([r for r in records if r["measure"] == "decode_step_paired"][-2:], cached):
            samples = [10.0 * q for q in ratios]  # DoRA and LoRA took 10 ms in these records
            rec.update(cached_samples_ms=samples, cached_median_ms=statistics.median(samples), cached_ratios=ratios,
                       cached_ratio_median=statistics.median(ratios), cached_over_dora_ratios=ratios,
                       cached_over_dora_ratio_median=statistics.median(ratios))  # fmt: skip
    doc = _grid_doc([a, b], records)
    merged = next(r for r in doc["speed"] if r["measure"] == "decode_step_paired" and r["point"] == b["label"])
    assert merged["cached_over_dora_ratios"] == [1.0, 1.04, 1.06] and "cached_samples_ms" not in merged
    assert merged["cached_median_ms"] == pytest.approx(10.4)  # of the rounds' medians 10.2 and 10.6, as LoRA's
    head = bench_model.headline_values(doc)  # the rounds' ratios merged: b's median 1.04
    assert head["grid_worst_cached_over_uncached_decode"] == 1.04
    assert head["grid_worst_cached_over_uncached_decode_at"] == b["label"]
    assert "grid_worst_cached_over_uncached_infer" not in head  # no paired forward with a cached side here


def test_compiled_pairs_time_a_twin_model_that_trains_from_the_same_weights():
    """``--compile``'s pairs run the DoRA model against a plain-LoRA twin *model* (its own base, the same seeded base
    weights, A and B; gradient checkpointing as the DoRA model has it), not a twin adapter of the same model whose
    graphs every compiled call would check too: both sides train (gradient proofs) and infer in ABBA pairs."""
    spec = bench_model.resolve_config(bench_model.parse_args(["--tiny", "--device", "cpu"]))
    cfg, device = spec["model"], torch.device("cpu")
    base = model_worker.build_base(cfg, device, torch.bfloat16)
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = model_worker.wrap(base, cfg, 4, {"dora": True}, "bf16")
    model_worker.seed_adapters(model, cfg["seed"], cfg["config_kwargs"]["initializer_range"])
    twin = model_worker.lora_twin_model(model, cfg, 4, "bf16", device)
    assert twin.get_base_model() is not model.get_base_model() and twin.get_base_model().is_gradient_checkpointing
    assert not any("magnitude" in n for n, _ in twin.named_parameters())
    ours = dict(model.named_parameters())
    for name, p in twin.named_parameters():  # base weights, A and B: the same values, in other tensors
        assert torch.equal(p, ours[name]) and p.data_ptr() != ours[name].data_ptr(), name
    models = {"dora": model, "lora": twin}
    train = model_worker.twin_pairs("train_step_paired", models, models, cfg, "bf16", device, pairs=2)
    assert train["grad_proof"]["ok"] and train["lora_grad_proof"]["ok"] and len(train["pair_ratios"]) == 2
    infer = model_worker.twin_pairs("infer_step_paired", models, models, cfg, "bf16", device, pairs=2)
    assert len(infer["pair_ratios"]) == 2 and "grad_proof" not in infer


def test_mixed_mode_pairs_train_and_infer_with_fp32_adapters_beside_the_bf16_base():
    """The grid's ``mixed`` mode: the DoRA adapter and its LoRA twin in fp32 beside the bf16 base, no autocast; the
    paired training step proves both sides' gradients, the paired forward and decode steps run."""
    spec = bench_model.resolve_config(bench_model.parse_args(["--tiny", "--device", "cpu"]))
    cfg, device = spec["model"], torch.device("cpu")
    base = model_worker.build_base(cfg, device, torch.bfloat16)
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    where = dict(shape="tiny", mode="mixed", rank=4, seq=16, batch=1, targets="qv", dropout=0.05)
    point = dict(where, label=bench_model.point_label(**where), modules=["q_proj", "v_proj"], accum4=False)
    model = model_worker.wrap(base, cfg, 4, {"dora": True}, "mixed", point["modules"], point["dropout"])
    model_worker.seed_adapters(model, cfg["seed"], cfg["config_kwargs"]["initializer_range"])
    train = model_worker.train_step_paired(model, cfg, point, device, pairs=1)
    assert train["grad_proof"]["ok"] and train["lora_grad_proof"]["ok"]
    dtypes = {n.split(".")[-2]: p.dtype for n, p in model.named_parameters() if "lora_" in n}
    assert set(dtypes) == {"default", model_worker.TWIN} and set(dtypes.values()) == {torch.float32}
    assert {p.dtype for n, p in model.named_parameters() if "lora_" not in n} == {torch.bfloat16}
    assert len(model_worker.infer_step_paired(model, cfg, point, device, pairs=1)["pair_ratios"]) == 1
    assert model_worker.decode_step_paired(model, cfg, point, device, pairs=1, steps=2)["pair_ratios"]


def test_committed_results_and_written_json_name_no_machine_folders(tmp_path):
    """A run's command line keeps its arguments but no absolute folder (``--workdir /tmp/...`` was once committed),
    and no committed result names a machine's folders."""
    doc = {"runs": [{"argv": ["--workdir", "/tmp/qw", "--out", "<out>/x.json", "--ranks", "16"]}]}
    out = tmp_path / "x.json"
    bench_model.write_doc(doc, out)
    assert json.loads(out.read_text())["runs"][0]["argv"] == ["--workdir", "<abs>/qw", "--out", "<out>/x.json",
                                                              "--ranks", "16"]  # fmt: skip
    results = REPO_ROOT / "benchmarks" / "results"
    named = [p.name for p in results.rglob("*.json") if any(
        f'"{root}' in p.read_text(encoding="utf-8") for root in ("/tmp/", "/work/", "/home/", "/root/"))]  # fmt: skip
    assert named == []
