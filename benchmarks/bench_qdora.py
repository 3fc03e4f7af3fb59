"""QDoRA at QLoRA cost: DoRA on a bitsandbytes-quantized Llama-3.1-8B-shaped model, ours vs upstream PEFT 0.21.2,
each against plain QLoRA (``use_dora=False``).

The driver saves one seeded random bf16 model (``LlamaConfig`` with Llama-3.1-8B's dimensions and RoPE, ``--layers``
decoder layers) and runs ``qdora_worker.py`` once per (round, implementation), each from its own ``pip install
--no-deps --target`` directory first on ``PYTHONPATH``, ours and upstream alternating so that the host's drift hits
both alike. A worker quantizes the model once per ``--quants`` entry and, per rank and adapter kind, wraps, seeds,
measures (training step, inference forward, one-token decode, training peak memory, step-0 loss; every timed step's
gradients proved) and unloads. Fidelity: at one small setting, logits and adapter gradients of each implementation
against upstream DoRA in fp32 on the same dequantized weights. The JSON is rewritten after every subprocess.

    python benchmarks/bench_qdora.py --dry-run              # the plan, the GPU seconds and the split into calls
    python benchmarks/bench_qdora.py --ours-wheel W --upstream-wheel U --quants nf4 --out $OUT/qdora_1.json
    python benchmarks/bench_qdora.py --device cpu --tiny    # every code path on CPU in about a minute
    python benchmarks/bench_qdora.py --merge a.json b.json --out benchmarks/results/qdora.json --plots \\
        --headline benchmarks/results/headline.json
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_model
import torch
from qdora_worker import GRAD_KINDS, MEASURES, PROJECTIONS


HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
WORKER = HERE / "qdora_worker.py"
SCHEMA = "bench_qdora/1"
# Llama-3.1-8B's config.json but for the layer count (rope_scaling as published; LlamaConfig.from_dict converts it)
LLAMA31_8B = {
    "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "tie_word_embeddings": False, "initializer_range": 0.02,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
}  # fmt: skip
TINY = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 176, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16}  # fmt: skip
QUANTS = ("nf4", "fp4", "int8")
HEADLINE_QUANTS = ("nf4", "fp4")  # the qdora_* keys are QLoRA proper; int8 has its own key
MODES = ("autocast", "none")  # bf16 autocast around the forward (adapters fp32), or none
IMPLS = {"ours": True, "upstream": False}  # name: is it our DoRA


# ---------------------------------------------------------------------------------------------------------------
# Configuration, plan and cost estimate.
# ---------------------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--device", default="cuda")
    a("--tiny", action="store_true", help="hidden 64, 2 layers, seq 32, ranks 4,8, 2 repeats (CPU smoke)")
    a("--layers", type=int, help="decoder layers (default 4; tiny 2)")
    a("--quants", default=",".join(QUANTS), help=f"comma list of {', '.join(QUANTS)}")
    a("--ranks", help="comma list (default 16,64,128,384; tiny 4,8)")
    a("--modes", default="autocast", help=f"comma list of {', '.join(MODES)}")
    a("--seq", type=int, help="tokens per sequence (default 4096; tiny 32)")
    a("--batch", type=int, default=1)
    a("--warmup", type=int, help="untimed steps before each measure, at least 1 (default 2; tiny 1)")
    a("--repeats", type=int, help="timed steps per measure (default 5; tiny 2)")
    a("--pairs", type=int, help="QDoRA/QLoRA-twin pairs per config and measure, ABBA (default 4; tiny 2; 0: off)")
    a("--rounds", type=int, default=2, help="ours/upstream subprocess pairs, in alternating order")
    a("--upstream-qlora", action="store_true", help="also time QLoRA in upstream's process (a cross-check)")
    a("--fidelity", action=argparse.BooleanOptionalAction, default=True, help="logits/gradients vs fp32 (round 0)")
    a("--fidelity-quant", default="nf4", choices=QUANTS)
    a("--fidelity-rank", type=int, help="default 16; tiny 4")
    a("--fidelity-seq", type=int, help="default 256; tiny 16")
    a("--seed", type=int, default=0)
    a("--budget-s", type=float, default=540.0, help="wall budget of the whole command (0: none); see run()")
    a("--ours-wheel", help="our wheel or an install directory (default: build one from this checkout)")
    a("--upstream-wheel", help="upstream's wheel or an install directory (default: tools/upstream.py)")
    a("--workdir", default=os.path.join(tempfile.gettempdir(), "peft_qdora"), help="model, installs, specs, .pt")
    a("--out", help="the JSON (default results/qdora.json; off the GPU results/cpu_smoke/qdora.json)")
    a("--plots", action="store_true", help="write the PNG beside the JSON")
    a("--headline", metavar="PATH", help="merge the headline keys into this headline.json")
    a("--merge", nargs="+", metavar="JSON", help="merge result JSONs (later files win per point) into --out")
    a("--headline-of", nargs="+", metavar="JSON", help="write --headline from the worst of these runs' keys")
    a("--from-workdir", metavar="DIR", help="assemble the JSON from the worker results a run left in DIR")
    a("--dry-run", action="store_true", help="print the plan, the GPU-seconds estimate and the call split")
    return p.parse_args(argv)


def _names(s: str, allowed) -> list:
    names = [x.strip() for x in s.split(",") if x.strip()]
    if not names or set(names) - set(allowed):
        raise SystemExit(f"{s!r}: choose from {list(allowed)}")
    return names


def resolve_config(args) -> dict:
    def pick(value, full, tiny):
        return value if value is not None else (tiny if args.tiny else full)

    fidelity = {
        "quant": args.fidelity_quant, "rank": pick(args.fidelity_rank, 16, 4), "seq": pick(args.fidelity_seq, 256, 16),
        "rows": pick(None, 32, 8), "mode": "autocast", "reference": "upstream DoRA, fp32, dequantized weights",
    }  # fmt: skip
    return {
        "device": args.device,
        "tiny": args.tiny,
        "model": dict(LLAMA31_8B, **(TINY if args.tiny else {}), num_hidden_layers=pick(args.layers, 4, 2)),
        "seed": args.seed,
        "quants": _names(args.quants, QUANTS),
        "ranks": [int(r) for r in args.ranks.split(",")] if args.ranks else pick(None, [16, 64, 128, 384], [4, 8]),
        "modes": _names(args.modes, MODES),
        "seq": pick(args.seq, 4096, 32),
        "batch": args.batch,
        "warmup": max(1, pick(args.warmup, 2, 1)),  # >= 1: the static allocation must hold AdamW's state
        "repeats": pick(args.repeats, 5, 2),
        "prompt_tokens": pick(None, 128, 8),
        "decode_warmup": 1,  # untimed decode passes over the timed cache lengths (qdora_worker.time_decode)
        "decode_tokens": pick(None, 32, 3),
        "pairs": max(0, pick(args.pairs, 4, 2)),  # qdora_worker.paired_measures
        "rounds": max(1, args.rounds),
        "lr": 1e-5,
        "kinds": {"ours": ["qdora", "qlora"], "upstream": ["qdora"] + (["qlora"] if args.upstream_qlora else [])},
        "lora": {
            "lora_alpha": "2r",
            "lora_dropout": 0.0,
            "target_modules": list(PROJECTIONS),
            "adapters": "fp32",
            "optimizer": "AdamW lr 1e-5",
            "loss": "every token, labels = input_ids",
            "quantization": "nf4/fp4: double quant, bf16 compute; int8: load_in_8bit",
            "preparation": "prepare_model_for_kbit_training (defaults: gradient checkpointing)",
            "precision": "autocast: torch.autocast(bfloat16) around forward and loss; none: no autocast",
        },  # fmt: skip
        "fidelity": fidelity if args.fidelity else None,
    }


def plan_jobs(cfg: dict) -> list:
    """One subprocess per (round, impl): ours then upstream in even rounds, upstream then ours in odd ones, every
    quantization, rank and kind inside; fidelity in round 0 (the fp32 reference in upstream's process)."""
    return [
        {"impl": impl, "round": k, "kinds": cfg["kinds"][impl], "fidelity": k == 0 and bool(cfg["fidelity"])}
        for k in range(cfg["rounds"])
        for impl in list(IMPLS)[:: 1 if k % 2 == 0 else -1]
    ]


# A rough cost model: it only has to tell whether a plan fits a 10-minute device call. The FLOP rate is
# bench_model's; the other constants are guesses, but for those marked measured. Against the 2026-11-26 run (4x H100,
# one quantization per GPU, pairs of 4): ~80-90 s per job and quantization, estimated 92-96 s.
STARTUP_S = 20.0  # interpreter, imports, CUDA context
BUILD_S = 40.0  # the driver's one-off model build and save (kept in --workdir)
LOAD_S = 15.0  # read the bf16 checkpoint, quantize on the GPU, prepare_model_for_kbit_training
SETUP_S = 3.0  # get_peft_model, seeding (dequantizes every weight), AdamW, unload, release
# measured: the round-0 jobs (ours' kernels compiled, fidelity runs) took 0-9 s more than the round-1 ones
TRITON_COMPILE_S = 5.0  # ours' first process compiles its kernels
FIDELITY_S = 5.0  # one load and one forward/backward per run, at 256 tokens
QUANT_SLOWDOWN = {"nf4": 1.3, "fp4": 1.3, "int8": 2.5}  # vs bf16: 4-bit dequantizes per matmul; int8 splits outliers
DECODE_S_PER_LAYER = 2.5e-3  # host-bound one-token step, seven bnb modules with adapters per layer (~10 ms per token
# at 4 layers, H200 machine, qdora.json of 2026-11-25)


def config_s(cfg: dict, impl: str, kind: str, quant: str, rank: int) -> float:
    """Seconds of one wrapped configuration: setup, training steps (forward, checkpoint recompute, backward: about
    four forwards), inference forwards, prefill and decode tokens, and a QDoRA configuration's pairs."""
    upstream_dora = impl == "upstream" and kind == "qdora"
    flops, dense = bench_model.forward_flops(cfg["model"], cfg["batch"], cfg["seq"], rank, PROJECTIONS, upstream_dora)
    fwd = (flops * QUANT_SLOWDOWN[quant] + dense) / bench_model.EFFECTIVE_FLOPS
    tokens = (cfg["decode_warmup"] + 1) * cfg["decode_tokens"]
    steps, infers = cfg["warmup"] + cfg["repeats"], cfg["warmup"] + cfg["repeats"]
    if kind == "qdora" and cfg.get("pairs"):  # warm-up pairs (3 training, 1 forward), then the pairs, the twin too
        sides = 2 * (cfg["pairs"] + 1)
        tokens, steps, infers = tokens + sides * cfg["decode_tokens"], steps + sides + 4, infers + sides
    decode = tokens * cfg["model"]["num_hidden_layers"] * DECODE_S_PER_LAYER * (1 + upstream_dora)
    return SETUP_S + steps * 4 * fwd + infers * fwd + fwd * cfg["prompt_tokens"] / cfg["seq"] + decode


def estimate_s(cfg: dict, job: dict) -> float:
    """GPU seconds of one job (0 off the GPU)."""
    if not cfg["device"].startswith("cuda"):
        return 0.0
    total = STARTUP_S + TRITON_COMPILE_S * (IMPLS[job["impl"]] and job["round"] == 0)
    for quant in cfg["quants"]:
        configs = [(k, r) for r in cfg["ranks"] for k in job["kinds"]] * len(cfg["modes"])
        total += LOAD_S + sum(config_s(cfg, job["impl"], k, quant, r) for k, r in configs)
    return total + FIDELITY_S * job["fidelity"] * (1 + (job["impl"] == "upstream"))


def plan_calls(cfg: dict, budget_s: float) -> list:
    """Whole quantizations per device call (largest first, each into the call it leaves shortest) so that each call
    fits ``budget_s`` if it can; fidelity goes with the shortest. Each call: quants, fidelity, estimated seconds."""

    def cost(quants, fidelity=False):
        sub = dict(cfg, quants=quants, fidelity=cfg["fidelity"] if fidelity else None)
        return BUILD_S + sum(estimate_s(sub, j) for j in plan_jobs(sub))

    calls: list = []
    for q in sorted(cfg["quants"], key=lambda q: -cost([q])):
        fits = [c for c in calls if cost(c["quants"] + [q]) <= budget_s]
        if fits:
            min(fits, key=lambda c: cost(c["quants"] + [q]))["quants"].append(q)
        else:
            calls.append({"quants": [q], "fidelity": False})
    if cfg["fidelity"]:
        min(calls, key=lambda c: cost(c["quants"]))["fidelity"] = True
    return [dict(c, s=cost(c["quants"], c["fidelity"])) for c in calls]


def call_command(cfg: dict, call: dict, k: int, wheels: str) -> str:
    """The device command of call ``k`` (1-based) of :func:`plan_calls`."""
    flags = f"--quants {','.join(call['quants'])} --ranks {','.join(map(str, cfg['ranks']))} --rounds {cfg['rounds']}"
    flags += f" --modes {','.join(cfg['modes'])} --seq {cfg['seq']} --layers {cfg['model']['num_hidden_layers']}"
    flags += f" --pairs {cfg['pairs']}"
    flags += "" if call["fidelity"] else " --no-fidelity"
    out = f"$OUT/qdora_{k}"
    return f"PYTHONUNBUFFERED=1 python3 benchmarks/bench_qdora.py {flags}{wheels} --out {out}.json 2>&1 | tee {out}.log"


def print_plan(cfg: dict, jobs: list, args) -> None:
    print(f"plan: {len(jobs)} subprocesses on {cfg['device']}; quants {cfg['quants']}, ranks {cfg['ranks']}, "
          f"modes {cfg['modes']}, seq {cfg['seq']}, {cfg['model']['num_hidden_layers']} layers")  # fmt: skip
    for j in jobs:
        extra = (" + fidelity" + " + fp32 reference" * (j["impl"] == "upstream")) if j["fidelity"] else ""
        print(f"  round {j['round']} {j['impl']:9s} {','.join(j['kinds']):12s}{extra:28s} ~{estimate_s(cfg, j):4.0f} s")
    if not cfg["device"].startswith("cuda"):
        return
    total = BUILD_S + sum(estimate_s(cfg, j) for j in jobs)
    print(f"estimated ~{total:.0f} GPU seconds, {total / 60:.1f} min (a rough FLOP/launch model: estimate_s)")
    if args.budget_s and total > args.budget_s - 30:
        wheels = "".join(f" --{w}-wheel {getattr(args, w + '_wheel')}" for w in IMPLS if getattr(args, w + "_wheel"))
        calls = plan_calls(cfg, args.budget_s - 30)
        print(f"over the {args.budget_s:.0f} s budget: {len(calls)} device calls, then --merge their JSONs")
        for k, call in enumerate(calls, 1):
            print(f"  call {k} (~{call['s'] / 60:.1f} min): {call_command(cfg, call, k, wheels)}")


# ---------------------------------------------------------------------------------------------------------------
# Analysis: ratios per point, headline, fidelity metrics, merge.
# ---------------------------------------------------------------------------------------------------------------


def _value(rec: dict, measure: str):
    """A record's median ms of ``measure``; None for a training step that failed its gradient proof."""
    m = rec.get(measure) or {}
    if measure == "train" and not (m.get("grad_proof") or {}).get("ok"):
        return None
    return m.get("median_ms")


def _rounds(doc: dict, impl: str, kind: str, point: tuple) -> dict:
    """{round: record} of (impl, kind) at ``point`` = (quant, mode, rank)."""
    key = (impl, kind, *point)
    return {r["round"]: r for r in doc["records"] if (r["impl"], r["kind"], r["quant"], r["mode"], r["rank"]) == key}


def _pairs(doc: dict, impl: str, measure: str, point: tuple):
    """Every round's ``<measure>_paired`` record of ``impl``'s QDoRA at ``point``; None where a round has none (a run
    before pairs, or ``--pairs 0``)."""
    pairs = [r.get(f"{measure}_paired") for r in _rounds(doc, impl, "qdora", point).values()]
    return None if not pairs or any(p is None or not p.get("pair_ratios") for p in pairs) else pairs


def paired_ratio(pairs: list):
    """QDoRA/QLoRA from pairs with a QLoRA twin (``qdora_worker.paired_measures``): the median over every pair of
    every round; None where a training pair failed its gradient proof."""
    if any(not proof["ok"] for p in pairs for proof in (p.get("grad_proof") or {}).values()):
        return None
    return statistics.median(x for p in pairs for x in p["pair_ratios"])


def ratio(doc: dict, num: tuple, den: tuple, measure: str, point: tuple):
    """Time of ``num`` over ``den`` ((impl, kind) each) at ``point``: the median of per-round ratios over the rounds
    both ran in (a pair measured close together in time), else the ratio of the medians; None where either is
    missing or any of its rounds failed its gradient proof. An impl's QDoRA/QLoRA comes from its own pairs with a
    QLoRA twin where they ran (:func:`paired_ratio`, the twin being that impl's LoRA): separately timed measures are
    a minute apart on a host whose speed drifts by several times, and steps at short sequences and decode are
    host-bound."""
    pairs = _pairs(doc, num[0], measure, point) if (num[1], den[1]) == ("qdora", "qlora") else None
    if pairs is not None:
        return paired_ratio(pairs)
    a = {k: _value(r, measure) for k, r in _rounds(doc, *num, point).items()}
    b = {k: _value(r, measure) for k, r in _rounds(doc, *den, point).items()}
    if not a or not b or None in a.values() or None in b.values():
        return None
    common = sorted(set(a) & set(b))
    if common:
        return statistics.median(a[k] / b[k] for k in common)
    return statistics.median(a.values()) / statistics.median(b.values())


def speedup(doc: dict, measure: str, point: tuple):
    """Upstream's QDoRA time over ours at ``point``: where both implementations ran pairs with their own QLoRA twin
    (the same LoRA code in either build), the ratio of their QDoRA/QLoRA (:func:`paired_ratio`), as the grid's
    speed-up over upstream is taken: each twin stands for its process's host speed, which drifts by several times
    between processes a minute apart and bounds the steps at short sequences and in decode; else the per-round
    ratio of the two QDoRA times (:func:`ratio`); None where either is missing or failed its gradient proof."""
    up, ours = _pairs(doc, "upstream", measure, point), _pairs(doc, "ours", measure, point)
    if up is not None and ours is not None:
        a, b = paired_ratio(up), paired_ratio(ours)
        return None if a is None or b is None else a / b
    return ratio(doc, ("upstream", "qdora"), ("ours", "qdora"), measure, point)


def summarize(doc: dict) -> list:
    """One row per configured (quant, mode, rank): median times, QDoRA/QLoRA per impl (upstream over its own QLoRA
    where it ran one, else over ours', the same code), upstream/ours QDoRA time (the speed-up: :func:`speedup`, and
    the separately timed ratio beside it), the training step's
    largest peak over static per impl and kind, and QDoRA's peak over QLoRA's in %."""
    cfg, rows = doc["config"], []
    for point in [(q, m, r) for q in cfg["quants"] for m in cfg["modes"] for r in cfg["ranks"]]:
        runs = {(i, k): _rounds(doc, i, k, point) for i in IMPLS for k in ("qdora", "qlora")}
        runs = {key: list(recs.values()) for key, recs in runs.items() if recs}
        base = {"ours": ("ours", "qlora"), "upstream": ("upstream", "qlora")}
        base["upstream"] = base["upstream"] if base["upstream"] in runs else base["ours"]
        peak = {key: max(r["train"].get("peak_delta_mb") or 0.0 for r in recs) or None for key, recs in runs.items()}
        over = {i: 100 * (peak[(i, "qdora")] / peak[base[i]] - 1) if peak.get((i, "qdora")) and peak.get(base[i])
                else None for i in IMPLS}  # fmt: skip
        rows.append({
            "quant": point[0], "mode": point[1], "rank": point[2],
            "ms": {"_".join(key): {m: statistics.median(r[m]["median_ms"] for r in recs) for m in MEASURES}
                   for key, recs in runs.items()},
            "qdora_over_qlora": {i: {m: ratio(doc, (i, "qdora"), base[i], m, point) for m in MEASURES} for i in IMPLS},
            "speedup_vs_upstream": {m: speedup(doc, m, point) for m in MEASURES},
            "speedup_vs_upstream_separate": {m: ratio(doc, ("upstream", "qdora"), ("ours", "qdora"), m, point)
                                             for m in MEASURES},
            "peak_mb": {"_".join(key): v for key, v in peak.items()},
            "peak_delta_over_qlora_pct": over,
            "step0_loss": {"_".join(key): recs[0]["step0_loss"] for key, recs in runs.items()},
        })  # fmt: skip
    return rows


def _worst(rows: list, pick, get) -> tuple:
    """(value, where) of the worst row by ``pick`` (max or min); (None, None) if any row lacks a value: a point that
    did not run or failed its proof leaves no worst case."""
    found = [(get(r), f"{r['quant']} r{r['rank']}") for r in rows]
    if not found or any(v is None for v, _ in found):
        return None, None
    value, where = pick(found)
    return round(value, 4), where


def headline_values(doc: dict) -> dict:
    """The flat qdora_* keys from the autocast rows: for ours the worst case over nf4/fp4 and every rank of
    QDoRA/QLoRA time (train, infer, decode) and peak delta over QLoRA, the smallest training speed-up over upstream's
    QDoRA, the worst int8 training QDoRA/QLoRA, and the largest ours/upstream ratio of relative error vs fp32 over
    logits and gradients; ``<key>_at`` says where. Keys the run could not measure (no such rows) are left out."""
    rows = [r for r in summarize(doc) if r["mode"] == "autocast"]
    four, int8 = [r for r in rows if r["quant"] in HEADLINE_QUANTS], [r for r in rows if r["quant"] == "int8"]
    keys = [(f"qdora_over_qlora_{m}", four, max, lambda r, m=m: r["qdora_over_qlora"]["ours"][m]) for m in MEASURES]
    keys += [
        ("qdora_peak_delta_over_qlora_pct", four, max, lambda r: r["peak_delta_over_qlora_pct"]["ours"]),
        ("qdora_train_speedup_vs_upstream", four, min, lambda r: r["speedup_vs_upstream"]["train"]),
        ("qdora_int8_over_lora_train", int8, max, lambda r: r["qdora_over_qlora"]["ours"]["train"]),
    ]
    out = {}
    for key, subset, pick, get in keys:
        if subset:
            out[key], out[key + "_at"] = _worst(subset, pick, get)
    if doc["config"]["fidelity"]:
        ratios = (doc.get("fidelity") or {}).get("ours_err_over_upstream_err")
        out["qdora_err_vs_fp32_ratio_to_upstream"] = round(max(ratios.values()), 4) if ratios else None
    out["qdora_gpu"] = doc["env"].get("gpu")
    return out


def fidelity_metrics(files: dict) -> dict:
    """Max-abs and relative (‖x − ref‖ / ‖ref‖) error of the logits and of each kind of adapter gradient of ours and
    upstream vs the fp32 reference, and ours' relative error over upstream's (< 1: ours is closer to fp32)."""
    if "reference" not in files:
        return {}
    data = {k: torch.load(p) for k, p in files.items()}
    ref = data.pop("reference")

    def err(x, y) -> dict:
        d = x.double() - y.double()
        return {"max_abs": float(d.abs().max()), "rel": float(d.norm() / y.double().norm())}

    out = {"reference_loss": ref["loss"], "loss": {k: v["loss"] for k, v in data.items()}}
    for impl, x in data.items():
        out[impl] = {"logits": err(x["logits"], ref["logits"])}
        out[impl].update({f"grad_{k}": err(x["grads"][k], ref["grads"][k]) for k in GRAD_KINDS})
    if {"ours", "upstream"} <= set(data):
        rel = {k: (out["ours"][k]["rel"], out["upstream"][k]["rel"]) for k in out["ours"]}
        out["ours_err_over_upstream_err"] = {k: o / u if u else math.inf for k, (o, u) in rel.items()}
    return out


def merge_docs(docs: list) -> dict:
    """Later documents replace every record of each (quant, mode, rank) they measured, so one point's rows always
    come from one run; quants, modes and ranks join; the latest fidelity wins."""
    out = json.loads(json.dumps(docs[0]))
    same = ("model", "seq", "batch", "device")
    for d in docs[1:]:
        if d["kind"] != out["kind"] or any(d["config"][k] != out["config"][k] for k in same):
            raise SystemExit(f"cannot merge runs of different kinds or {'/'.join(same)}")
        if d["env"].get("gpu") != out["env"].get("gpu"):
            print(f"warning: merging runs on different GPUs: {out['env'].get('gpu')} / {d['env'].get('gpu')}")
        points = {(r["quant"], r["mode"], r["rank"]) for r in d["records"]}
        out["records"] = [r for r in out["records"] if (r["quant"], r["mode"], r["rank"]) not in points] + d["records"]
        for key in ("quants", "modes", "ranks"):
            out["config"][key] += [x for x in d["config"][key] if x not in out["config"][key]]
        for key in ("env", "impls"):
            out[key].update(d[key])
        for key in ("runs", "errors", "skipped"):
            out[key] += d[key]
        if d["fidelity"]:
            out["fidelity"], out["config"]["fidelity"] = d["fidelity"], d["config"]["fidelity"]
    out["config"]["ranks"].sort()
    return out


def update_headline(doc: dict, path: Path) -> dict:
    """``bench_model.write_headline`` of this run's :func:`headline_values` (the qdora_* keys)."""
    return bench_model.write_headline(doc["kind"], headline_values(doc), path)


_BEST_IS_LOW = ("qdora_train_speedup_vs_upstream",)  # for every other qdora_* key a larger value is worse


def worst_of_runs(named_docs: list) -> dict:
    """The qdora_* keys over several runs (e.g. the 4096-token run and the 1024-token one, which cannot merge into one
    document): each key the worst of the runs' :func:`headline_values`, its ``_at`` naming the run's file; a key that
    any run left unmeasured (None) is None. ``qdora_gpu`` joins the runs' GPUs."""
    heads = [(name, headline_values(doc)) for name, doc in named_docs]
    out: dict = {}
    for key in sorted({k for _, h in heads for k in h if not k.endswith("_at") and k != "qdora_gpu"}):
        found = [(h[key], f"{h.get(key + '_at')} ({name})") for name, h in heads if key in h]
        if any(v is None for v, _ in found):
            out[key] = None
            continue
        value, at = (min if key in _BEST_IS_LOW else max)(found, key=lambda f: f[0])
        out[key] = value
        if any(key + "_at" in h for _, h in heads):
            out[key + "_at"] = at
    out["qdora_gpu"] = " / ".join(sorted({h["qdora_gpu"] for _, h in heads if h.get("qdora_gpu")}))
    return out


# ---------------------------------------------------------------------------------------------------------------
# Report: table, plot.
# ---------------------------------------------------------------------------------------------------------------


def _f(x, spec=".3f") -> str:
    return "-" if x is None else format(x, spec)


def print_summary(doc: dict) -> None:
    print(f"\n== {doc['kind']} on {doc['env'].get('gpu')}: QDoRA/QLoRA time (train infer decode) of ours and "
          "upstream, speed-up (upstream/ours QDoRA), training peak over QLoRA % ==")  # fmt: skip
    for r in summarize(doc):
        cells = [" ".join(_f(r["qdora_over_qlora"][i][m]) for m in MEASURES) for i in IMPLS]
        speed = " ".join(_f(r["speedup_vs_upstream"][m], ".2f") for m in MEASURES)
        peak = " ".join(_f(r["peak_delta_over_qlora_pct"][i], "+.1f") for i in IMPLS)
        print(f"{r['quant']:4s} {r['mode']:8s} r={r['rank']:<4d} ours {cells[0]} | upstream {cells[1]} | x {speed} | "
              f"peak {peak}")  # fmt: skip
    ratios = (doc.get("fidelity") or {}).get("ours_err_over_upstream_err")
    if ratios:
        print(
            "fidelity, ours / upstream relative error vs fp32: "
            + json.dumps({k: round(v, 4) for k, v in ratios.items()})
        )
    for e in doc["errors"]:
        where = " ".join(f"{k} {e[k]}" for k in ("impl", "round", "task", "quant", "rank", "kind") if k in e)
        print(f"ERROR {where}: {e['error'].strip().splitlines()[-1]}")
    for s in doc["skipped"]:
        print(f"SKIPPED {s}")
    print("headline: " + json.dumps(headline_values(doc)))


def plot(doc: dict, path: Path) -> Path:
    """QDoRA/QLoRA time per quant × rank, ours vs upstream, a panel per measure with the 1.10 target dashed; the
    fourth panel the training peak over static, QDoRA over QLoRA in %."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mode = doc["config"]["modes"][0]
    rows = [r for r in summarize(doc) if r["mode"] == mode]
    x, w = range(len(rows)), 0.4
    fig, axes = plt.subplots(2, 2, figsize=(max(10, 1.8 * len(rows)), 8))
    panels = [(m, f"{m}: QDoRA / QLoRA time", lambda r, i, m=m: r["qdora_over_qlora"][i][m]) for m in MEASURES]
    panels.append(
        ("peak", "training peak over static: QDoRA over QLoRA, %", lambda r, i: r["peak_delta_over_qlora_pct"][i])
    )
    for ax, (name, title, get) in zip(axes.flat, panels):
        for j, impl in enumerate(IMPLS):
            vals = [get(r, impl) for r in rows]
            ax.bar([k + (j - 0.5) * w for k in x], [math.nan if v is None else v for v in vals], w, label=impl)
        if name != "peak":
            ax.axhline(1.10, color="red", ls="--", lw=1, label="1.10")
            ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(list(x), [f"{r['quant']}\nr{r['rank']}" for r in rows])
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    smoke = "\nCPU SMOKE RUN: a pipeline check, not a measurement" if doc["kind"] != "gpu" else ""
    fig.suptitle(f"QDoRA vs QLoRA on {doc['env'].get('gpu')}, {mode}, seq {doc['config']['seq']}{smoke}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------------------------
# The driver.
# ---------------------------------------------------------------------------------------------------------------


def spawn(spec: dict, workdir: Path, tag: str, target: Path | None, timeout: float | None):
    """Run the worker on ``spec`` with ``target`` first on PYTHONPATH (no PEFT_DORA_* switch inherited); its exit
    status, or "timeout"."""
    spec_path = workdir / f"spec_{tag}.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PEFT_DORA_")}
    if target is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(target)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env["PYTHONUNBUFFERED"] = "1"
    if spec["device"] == "cpu":  # tiny tensors: one thread (a 32x64 matmul: 21 µs, 3.5 ms on two busy cores)
        env["OMP_NUM_THREADS"] = "1"
    try:
        return subprocess.run(
            [sys.executable, str(WORKER), str(spec_path)], env=env, cwd=HERE, timeout=timeout
        ).returncode
    except subprocess.TimeoutExpired:
        return "timeout"


def prepare_model(cfg: dict, workdir: Path) -> Path:
    """The saved bf16 model, built once per (config, seed, device) and kept in ``workdir`` for later calls."""
    key = json.dumps([cfg["model"], cfg["seed"], cfg["device"]], sort_keys=True)
    model_dir = workdir / f"model_{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if not (model_dir / ".done").exists():
        t0 = time.perf_counter()
        spec = {"task": "build", "model": cfg["model"], "seed": cfg["seed"], "device": cfg["device"]}
        if spawn(dict(spec, dir=str(model_dir)), workdir, "build", None, None) != 0:
            raise SystemExit("building the model failed (see above)")
        (model_dir / ".done").write_text("")
        print(f"built the model in {time.perf_counter() - t0:.0f} s", flush=True)
    return model_dir


def wheel_targets(args, workdir: Path) -> dict:
    """Each implementation's ``pip install --no-deps --target`` directory (``bench_model.install``, keyed by the
    wheel's sha256; a directory holding an install is used as it is)."""
    if args.ours_wheel:
        ours = Path(args.ours_wheel)
    else:
        import compare

        ours = compare.build_ours(workdir / "wheels")  # pip wheel --no-deps --no-build-isolation of this checkout
    if args.upstream_wheel:
        upstream = Path(args.upstream_wheel)
    else:
        sys.path.insert(0, str(HERE.parent))
        from tools import upstream as pinned

        upstream = pinned.wheel()
    return {name: bench_model.install(w, workdir / "targets") for name, w in (("ours", ours), ("upstream", upstream))}


def absorb(doc: dict, result: dict, job: dict, rc) -> None:
    """One worker's result into the document: environment and peft install, records, errors (a failed gradient proof
    is one), skipped configurations."""
    if rc != 0 and not result["errors"]:
        result["errors"].append({"task": "worker", "impl": job["impl"], "round": job["round"], "error": f"exit {rc}"})
    if "info" in result:
        doc["env"].update({k: v for k, v in result["info"].pop("env").items() if v is not None})
        doc["impls"][job["impl"]] = result["info"]
    for rec in result["records"]:
        proof = rec["train"]["grad_proof"]
        if not proof["ok"]:
            where = {k: rec[k] for k in ("impl", "round", "quant", "rank", "kind")}
            doc["errors"].append(dict(where, task="grad_proof", error=f"gradient proof failed: {proof['bad_names']}"))
    for key in ("records", "errors", "skipped"):
        doc[key] += result[key]


def run(args, argv: list) -> int:
    """Every job in order, the JSON rewritten after each. With ``--budget-s`` B, workers start no configuration after
    B - 45 s and are killed at B - 15 s (what they finished is kept), so that the command ends inside B."""
    cfg = resolve_config(args)
    jobs = plan_jobs(cfg)
    print_plan(cfg, jobs, args)
    if args.dry_run:
        return 0
    t_start = time.time()
    end = t_start + args.budget_s if args.budget_s else math.inf
    out, workdir = _out_path(args, cfg), Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    targets = wheel_targets(args, workdir)
    model_dir = prepare_model(cfg, workdir)
    doc = _new_doc(cfg, argv)
    fidelity_files: dict = {}
    for job in jobs:
        tag = f"{job['impl']}_r{job['round']}"
        if time.time() > end - 45:
            doc["skipped"].append({"impl": job["impl"], "round": job["round"], "why": "budget"})
            continue
        result_path = workdir / f"result_{tag}.json"
        result_path.unlink(missing_ok=True)
        impl = {"name": job["impl"], "ours": IMPLS[job["impl"]], "target": str(targets[job["impl"]])}
        spec = {"task": "bench", "impl": impl, "round": job["round"], "kinds": job["kinds"], "cfg": cfg,
                "device": cfg["device"], "model_dir": str(model_dir), "workdir": str(workdir),
                "result": str(result_path), "deadline": end - 45,
                "fidelity": cfg["fidelity"] if job["fidelity"] else None}  # fmt: skip
        t0 = time.perf_counter()
        print(f"--- {tag}: starting", flush=True)
        timeout = None if end == math.inf else max(1.0, end - 15 - time.time())
        rc = spawn(spec, workdir, tag, targets[job["impl"]], timeout)
        print(f"--- {tag}: exit {rc} after {time.perf_counter() - t0:.0f} s", flush=True)
        empty = {"records": [], "errors": [], "skipped": []}
        result = json.loads(result_path.read_text()) if result_path.exists() else empty
        absorb(doc, result, job, rc)
        fidelity_files.update(result.get("fidelity") or {})
        doc["fidelity"] = dict(cfg["fidelity"], **fidelity_metrics(fidelity_files)) if fidelity_files else {}
        write_doc(doc, out)  # after every job: a call cut short keeps what finished
    doc["runs"][-1]["wall_s"] = round(time.time() - t_start, 1)
    return finish(doc, out, args)


def _out_path(args, cfg: dict) -> Path:
    gpu = cfg["device"].startswith("cuda")
    return Path(args.out) if args.out else (RESULTS if gpu else RESULTS / "cpu_smoke") / "qdora.json"


def _new_doc(cfg: dict, argv: list) -> dict:
    gpu = cfg["device"].startswith("cuda")
    env = {"date": datetime.date.today().isoformat(), "python": platform.python_version(), "device": cfg["device"]}
    env["gpu"] = None if gpu else f"none (CPU: {platform.processor() or platform.machine()})"
    return {"schema": SCHEMA, "kind": "gpu" if gpu else "cpu_smoke", "env": env, "impls": {}, "config": cfg,
            "runs": [{"argv": argv}], "records": [], "errors": [], "skipped": [], "fidelity": {}}  # fmt: skip


def assemble(args, argv: list) -> int:
    """``--from-workdir``: the document of a run from the worker results its ``--workdir`` kept (``result_<job>.json``
    and the fidelity ``.pt`` files they name), for a run whose JSON was lost (a device call brings back at most 8
    files, and a killed driver writes nothing after its last job). Run it where the run ran, with the run's own
    arguments; the jobs are :func:`plan_jobs`'s, each absorbed as :func:`run` does, none started."""
    cfg = resolve_config(args)
    workdir, doc, fidelity_files = Path(args.from_workdir), _new_doc(cfg, argv), {}
    doc["runs"][0]["assembled_from_workdir"] = True
    for job in plan_jobs(cfg):
        path = workdir / f"result_{job['impl']}_r{job['round']}.json"
        if not path.exists():
            doc["skipped"].append({"impl": job["impl"], "round": job["round"], "why": "no result in the workdir"})
            continue
        result = json.loads(path.read_text())
        absorb(doc, result, job, 0)
        fidelity_files.update(result.get("fidelity") or {})
    doc["fidelity"] = dict(cfg["fidelity"], **fidelity_metrics(fidelity_files)) if fidelity_files else {}
    return finish(doc, _out_path(args, cfg), args)


def write_doc(doc: dict, path: Path) -> None:
    """The JSON, without machine paths: install targets, the output folder and site-packages become placeholders."""
    import re

    doc["summary"], doc["headline"] = summarize(doc), headline_values(doc)
    repo = Path(__file__).resolve().parent.parent
    text = bench_model.scrub(json.dumps(doc), {"out": path.resolve().parent, "repo": repo})
    text = re.sub(r'"/[^"]*/targets/([^"/]+)/', r'"<target>/\1/', text)
    text = re.sub(r'"/[^"]*/(qdora[^"/]*\.json)"', r'"<out>/\1"', text)  # outputs of earlier (merged) runs
    bench_model.write_doc(json.loads(text), path)


def finish(doc: dict, out: Path, args) -> int:
    write_doc(doc, out)
    print_summary(doc)
    print(f"wrote {out}")
    if args.plots:
        print(f"wrote {plot(doc, out.with_suffix('.png'))}")
    if args.headline:
        update_headline(doc, Path(args.headline))
        print(f"updated {args.headline}")
    return 1 if doc["errors"] else 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.headline_of:
        if not args.headline:
            raise SystemExit("--headline-of needs --headline")
        docs = [json.loads(Path(p).read_text()) for p in args.headline_of]
        kinds = {d["kind"] for d in docs}
        values = worst_of_runs([(Path(p).name, d) for p, d in zip(args.headline_of, docs)])
        print(json.dumps(bench_model.write_headline(kinds.pop() if len(kinds) == 1 else "mixed", values,
                                                    Path(args.headline)), indent=1))  # fmt: skip
        return 0
    if args.from_workdir:
        return assemble(args, argv)
    if args.merge:
        if not args.out:
            raise SystemExit("--merge needs --out")
        return finish(merge_docs([json.loads(Path(p).read_text()) for p in args.merge]), Path(args.out), args)
    return run(args, argv)


if __name__ == "__main__":
    sys.exit(main())
