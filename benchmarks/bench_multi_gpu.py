"""Multi-GPU training benchmark: upstream PEFT 0.21.2 DoRA vs ours vs plain LoRA under one sharding engine (FSDP2,
FSDP1, DeepSpeed ZeRO-2/3).

This launcher owns the plan, the launches and the report. Each implementation runs in its own ``torchrun --standalone
--nproc_per_node N multi_gpu_worker.py`` launch from its own ``pip install --no-deps --target`` directory
(``bench_model.install``), first on ``PYTHONPATH``; ``lora`` is ``use_dora=False`` from our wheel. A launch trains
every rank of ``--ranks`` in turn (one process start and one NCCL setup per launch, not per rank). Launches run in
interleaved rounds (``bench_model._rounds``: all impls, then the same in reverse order, ...), so that the host's drift
hits every implementation alike; ratios are medians of per-round ratios (``bench_model.time_ratio``).

Model: a Llama from ``LlamaConfig`` with seeded random weights (no downloads), ``--shape`` 8b / 70b / tiny with
``--layers`` decoder layers; LoRA/DoRA on all linear projections, ``lora_alpha = 2r``, seeded non-zero A, B and
magnitudes; non-reentrant gradient checkpointing; AdamW; ``--precision bf16`` (every parameter bf16) or ``mp`` (fp32
parameters, FSDP2 ``MixedPrecisionPolicy(bf16, reduce fp32)``). Each process takes its own rows of a seeded global
batch, the same for every implementation, so losses compare. Per step: time (CUDA events, the slowest process),
loss (mean over processes), the gradient proof (every trainable tensor's whole gradient finite and non-zero), our
norm counters; per process the peak memory over static.

Two references of ours follow the timed rounds, each a launch of its own: ``single`` trains in one process
(``--nproc_per_node 1``) with no engine on the whole global batch, the same rows, so the engine's per-step losses
must match its losses (``--no-single`` skips it); ``norm_check`` (FSDP2 only) shards an all-fp32 model as the run
does and compares every DoRA Linear's sharded norm with the whole one (``--no-norm-check`` skips it).

    python benchmarks/bench_multi_gpu.py --plan                       # what would run, estimated seconds
    python benchmarks/bench_multi_gpu.py --engine fsdp2 --nproc 2 --shape 8b --ranks 16,128 --precision bf16
    python benchmarks/bench_multi_gpu.py --device cpu --shape tiny --nproc 2 --ranks 4 --seq 16 --steps 2 \\
        --warmup 1 --rounds 1 --impls ours,lora --use-installed     # the CPU smoke (gloo), in about half a minute
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import bench_model
from multi_gpu_worker import ENGINES


HERE = Path(__file__).resolve().parent
WORKER = HERE / "multi_gpu_worker.py"
SCHEMA = "bench_multi_gpu/1"
IMPLS = {  # name: (wheel, is our DoRA's package, use_dora)
    "upstream": {"wheel": "upstream", "ours": False, "dora": True},
    "ours": {"wheel": "ours", "ours": True, "dora": True},
    "lora": {"wheel": "ours", "ours": True, "dora": False},
    # ours with every FSDP2 rank computing the whole norm (no norm all-gather): against the sharded norm in one run
    "ours_whole_norm": {"wheel": "ours", "ours": True, "dora": True, "env": {"PEFT_DORA_SHARDED_NORM": "0"}},
    # ours with the one-pass norm kernel at every rank it runs (PEFT_DORA_NORM_KERNEL=1): one launch per norm where
    # the auto rule takes the split path's seven above dora_norm._KERNEL_MAX_RANK_EAGER
    "ours_norm_kernel": {"wheel": "ours", "ours": True, "dora": True, "env": {"PEFT_DORA_NORM_KERNEL": "1"}},
    # ours with the FSDP2 sharded norms computed in the optimizer-step hook (PEFT_DORA_STEP_NORMS=1, experimental)
    "ours_step_norms": {"wheel": "ours", "ours": True, "dora": True, "env": {"PEFT_DORA_STEP_NORMS": "1"}},
    # ours without CUDA graphs for the norms (PEFT_DORA_NORM_GRAPH=0): under FSDP2 each layer launches its own rows
    # of the sharded norm, where by default one graph per unit computes them all (DoraLinearLayer._unit_rows_graphed)
    "ours_norm_graph_off": {"wheel": "ours", "ours": True, "dora": True, "env": {"PEFT_DORA_NORM_GRAPH": "0"}},
    # ours and LoRA with each process pinned to its own share of the host's cores (multi_gpu_worker.pin_cores): whether
    # the host-bound steps' spread between launches is the processes' placement
    "ours_pinned": {"wheel": "ours", "ours": True, "dora": True, "env": {"BENCH_PIN_CORES": "1"}},
    "lora_pinned": {"wheel": "ours", "ours": True, "dora": False, "env": {"BENCH_PIN_CORES": "1"}},
}
DORA = ("ours", "upstream")  # the DoRA impls every summary row names (others: where the run has them)
REFERENCES = ("single", "norm_check")  # launches of ours that check the run, not timed (job_spec)
LLAMA = {"max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
         "initializer_range": 0.02}  # fmt: skip
SHAPES = {
    "8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
           "vocab_size": 128256},
    "70b": {"hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64, "num_key_value_heads": 8,
            "vocab_size": 128256},
    "tiny": {"hidden_size": 64, "intermediate_size": 99, "num_attention_heads": 4, "num_key_value_heads": 2,
             "vocab_size": 128, "max_position_embeddings": 4096},
}  # fmt: skip
PRECISIONS = ("bf16", "mp")
GPU_KEYS = ("multi_gpu_gpu", "eight_gpu_gpu")  # headline keys naming the GPUs: the 8B-class runs', the 70B-class runs'


# ---------------------------------------------------------------------------------------------------------------
# Configuration, plan and cost estimate.
# ---------------------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--engine", default="fsdp2", choices=list(ENGINES), help="fsdp2 (fully_shard), fsdp1, zero2, zero3 (DeepSpeed)")
    a("--nproc", type=int, default=2, help="processes (GPUs) per launch")
    a("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: gloo, a smoke run")
    a("--shape", default="8b", choices=list(SHAPES))
    a("--layers", type=int, help="decoder layers (default 4; tiny 2)")
    a("--ranks", default="16,128", help="comma list; every rank in each launch")
    a("--impls", default="upstream,ours,lora", help=f"comma list of {', '.join(IMPLS)}")
    a("--seq", type=int, default=4096)
    a("--batch", type=int, default=1, help="rows per process and step")
    a("--precision", default="bf16", choices=PRECISIONS, help="bf16: all parameters bf16; mp: fp32 + bf16 compute")
    a("--reshard", type=int, default=1, choices=(0, 1), help="FSDP2 reshard_after_forward")
    a("--quant", choices=("nf4",), help="QDoRA vs QLoRA: every decoder projection bitsandbytes NF4 (double "
      "quantization) in bf16 storage, bitsandbytes' FSDP recipe; FSDP2 and --precision bf16 only")  # fmt: skip
    a("--warmup", type=int, default=3, help="untimed steps, at least 1 (the static memory must hold AdamW's state)")
    a("--steps", type=int, default=8, help="timed steps")
    a("--rounds", type=int, default=2, help="interleaved rounds of every implementation")
    a(
        "--pairs",
        type=int,
        default=8,
        help="ABBA pairs of training steps, in every DoRA launch, of its DoRA against "
        "a plain-LoRA twin model built and sharded alongside (0: none): the DoRA/LoRA ratio and the speed-up over "
        "upstream from steps back to back in one process, which the host's drift between launches does not move",
    )
    a("--lr", type=float, default=1e-5)
    a("--seed", type=int, default=0)
    a("--ours-wheel", help="our wheel or an install directory (default: .carry-bench/, else built from this checkout)")
    a("--upstream-wheel", help="upstream's wheel or an install directory (default: PEFT_UPSTREAM_WHEEL, .carry-bench/,"
      " tools/upstream.py)")  # fmt: skip
    a("--use-installed", action="store_true", help="ours and lora from this environment's peft (no wheel installs)")
    a("--workdir", default=os.path.join(tempfile.gettempdir(), "peft_multi_gpu"), help="installs, specs, results")
    a("--out", help="the JSON (default results/multi_gpu.json; off the GPU results/cpu_smoke/multi_gpu.json)")
    a("--headline", nargs="?", const=str(bench_model.RESULTS / "headline.json"), metavar="PATH",
      help="merge the headline keys into PATH (default results/headline.json); GPU runs only")  # fmt: skip
    a("--headline-from", nargs="+", metavar="JSON",
      help="only write the headline keys of these committed run JSONs (in order) into --headline's PATH")  # fmt: skip
    a("--pool", nargs="+", metavar="JSON",
      help="pool the timed rounds of these runs of one configuration (engine, model, precision, ranks, impls, seq, "
      "batch, steps) into --out: the ratios become medians over all their rounds (runs of this host-bound step move "
      "by more between rounds than a change of the code does; every run's own argv stays in runs)")  # fmt: skip
    a("--timeout-s", type=float, default=600.0, help="per launch; the launch's process group is killed after it")
    a("--deadline-min", type=float, help="start no launch after this many minutes (skipped launches are listed)")
    a("--no-single", action="store_true", help="skip the single-process reference (ours, no engine, global batch)")
    a("--meta-init", action="store_true", help="no process holds the model whole in its parameter dtype, for models "
      "one GPU cannot hold (70B, 80 layers): FSDP2 builds the decoder layers on the meta device and makes only each "
      "process's shards real (seeded per name and process); ZeRO-3 builds under deepspeed.zero.Init; --quant builds "
      "and quantizes a decoder layer at a time; no single-process reference")  # fmt: skip
    a("--no-norm-check", action="store_true", help="skip FSDP2's sharded-norm check (ours, all fp32, first rank)")
    a("--plan", action="store_true", help="print what would run and the estimated seconds, then stop")
    return p.parse_args(argv)


def resolve_config(args) -> dict:
    impls = bench_model._names(args.impls, IMPLS)
    layers = args.layers if args.layers is not None else (2 if args.shape == "tiny" else 4)
    kwargs = dict(LLAMA, **SHAPES[args.shape], num_hidden_layers=layers)
    gpu = args.device.startswith("cuda")
    if args.meta_init and args.engine not in ("fsdp2", "zero3"):
        raise SystemExit("--meta-init: FSDP2 or ZeRO-3 only (FSDP1 and ZeRO-2 hold whole parameters before they shard)")
    if args.meta_init and args.engine == "zero3" and not gpu:
        raise SystemExit("--meta-init with ZeRO-3 builds under deepspeed.zero.Init, which needs GPUs (not gloo on CPU)")
    if args.quant and (args.engine != "fsdp2" or args.precision != "bf16"):
        # FSDP2's mixed precision would cast the packed 4-bit storage; FSDP1 and ZeRO have not been wired here
        raise SystemExit("--quant: FSDP2 with --precision bf16 only (the packed weights must not be cast)")
    # the norm check compares with the dense norm of the gathered weight, which a quantized base does not have
    wanted = {"single": not args.no_single and not args.meta_init,  # the whole model on one GPU: what it avoids
              "norm_check": not args.no_norm_check and args.engine == "fsdp2" and not args.quant}  # fmt: skip
    return {
        "engine": args.engine,
        "nproc": args.nproc,
        "device": args.device,
        "backend": "nccl" if gpu else "gloo",
        "shape": args.shape,
        "model": {
            "config_class": "LlamaConfig",
            "model_class": "LlamaForCausalLM",
            "config_kwargs": kwargs,
            "seed": args.seed,
        },  # fmt: skip
        "ranks": bench_model._ints(args.ranks),
        "impls": impls,
        "rounds": max(1, args.rounds),
        "seq": args.seq,
        "batch": args.batch,
        "global_batch": args.batch * args.nproc,
        "precision": args.precision,
        "quant": args.quant,
        "reshard": args.reshard,
        "meta_init": args.meta_init,
        "warmup": max(1, args.warmup),
        "pairs": max(0, args.pairs),
        "steps": max(1, args.steps),
        "lr": args.lr,
        "lora": {
            "lora_alpha": "2r",
            "target_modules": "all-linear",
            "lora_dropout": 0.0,
            "adapters": "A, B, magnitudes seeded per module name (model_worker.seed_adapters; B != 0)",
            "gradient_checkpointing": "non-reentrant",
            "optimizer": "AdamW",
            "loss": "every token, labels = input_ids",
        },  # fmt: skip
        "references": [r for r in REFERENCES if wanted[r] and "ours" in impls],
        "launch": "one torchrun launch per (impl, round), every rank inside it; then one per reference",
    }


def plan_jobs(cfg: dict) -> list:
    """One launch per (round, impl), in ``bench_model._rounds``' interleaved order; then one per reference, last, so
    that a deadline cuts the checks before the timings."""
    order = bench_model._rounds({"impls": cfg["impls"], "rounds": cfg["rounds"]})
    return [{"impl": impl, "round": k} for k, impl in order] + [{"impl": r, "round": 0} for r in cfg["references"]]


def job_spec(cfg: dict, job: dict) -> dict:
    """What a launch's worker runs (:func:`launch` adds the install and the result file). A reference runs ours:
    ``single`` in one process on the global batch (``batches`` with one process yields all its rows), ``norm_check``
    on the first rank with every tensor fp32, so that no rounding hides a wrong row."""
    name = job["impl"]
    impl = dict(IMPLS.get(name, IMPLS["ours"]), name=name)
    spec = dict(cfg, task=name if name in REFERENCES else "train", impl=impl, round=job["round"])
    if name == "single":
        spec.update(nproc=1, batch=cfg["global_batch"])
    elif name == "norm_check":
        spec.update(precision="fp32", ranks=cfg["ranks"][:1])
    return spec


# A rough cost model: it only has to tell whether a plan fits a 10-minute device call. FLOPs per process at
# bench_model's effective rate; a training step with checkpointing is about four forwards. Communication is assumed
# hidden behind compute (FSDP2 prefetches the next layer's all-gather).
LAUNCH_S = 35.0  # torchrun, imports, CUDA contexts, NCCL rendezvous
BUILD_S_PER_GB = 0.5  # random init on the GPU, the wrap and fully_shard, per GB of model in the parameter dtype
CPU_LAUNCH_S = 10.0  # the tiny CPU smoke: process starts and imports dominate
FP32_SLOWDOWN = 8.0  # the norm check's fp32 matmuls (no TF32): H100's fp32 rate is ~1/15 of bf16's peak


def estimate_s(cfg: dict, job: dict) -> float:
    spec = job_spec(cfg, job)
    if cfg["device"] == "cpu":
        return CPU_LAUNCH_S + len(spec["ranks"]) * 2.0
    ck = cfg["model"]["config_kwargs"]
    gb = bench_model.weights(ck) * (2 if spec["precision"] == "bf16" else 4) / 1e9
    norm_check = spec["task"] == "norm_check"
    steps = 1 if norm_check else spec["warmup"] + spec["steps"]
    total = LAUNCH_S
    paired = spec["task"] == "train" and spec["impl"]["dora"] and cfg.get("pairs")
    for rank in spec["ranks"]:
        upstream = job["impl"] == "upstream"
        flops, dense = bench_model.forward_flops(ck, spec["batch"], cfg["seq"], rank, upstream=upstream)
        step_s = 4 * (flops + dense) / bench_model.EFFECTIVE_FLOPS * (FP32_SLOWDOWN if norm_check else 1)
        total += BUILD_S_PER_GB * gb + steps * step_s
        if paired:  # the DoRA model again and its LoRA twin, two warm-up steps each, then the pairs
            total += 2 * BUILD_S_PER_GB * gb + (4 + 2 * cfg["pairs"]) * step_s
    return total


def print_plan(cfg: dict, jobs: list) -> float:
    ck = cfg["model"]["config_kwargs"]
    print(
        f"plan: {len(jobs)} launches (xN: N processes; {cfg['engine']}, {cfg['backend']}) on "
        f"{cfg['device']}: shape {cfg['shape']} (hidden {ck['hidden_size']}, {ck['num_hidden_layers']} layers), "
        f"ranks {cfg['ranks']}, seq {cfg['seq']} x batch {cfg['batch']} per process, {cfg['precision']}, "
        f"reshard {cfg['reshard']}, {cfg['warmup']}+{cfg['steps']} steps"
    )
    total = 0.0
    for j in jobs:
        s, spec = estimate_s(cfg, j), job_spec(cfg, j)
        total += s
        print(f"  round {j['round']} {j['impl']:10s} x{spec['nproc']} ranks {','.join(map(str, spec['ranks']))} "
              f"batch {spec['batch']} {spec['precision']}  ~{s:4.0f} s")  # fmt: skip
    print(f"estimated ~{total:.0f} s ({total / 60:.1f} min; a rough FLOP/launch model: estimate_s)")
    return total


# ---------------------------------------------------------------------------------------------------------------
# Launches.
# ---------------------------------------------------------------------------------------------------------------


def _installed_peft() -> Path:
    """The folder holding this environment's ``peft`` package (found, not imported: the launcher stays clean)."""
    spec = importlib.util.find_spec("peft")
    if spec is None or spec.origin is None:
        raise SystemExit("--use-installed: no peft in this environment")
    return Path(spec.origin).resolve().parent.parent


def _upstream_wheel(explicit) -> Path:
    if explicit or os.environ.get("PEFT_UPSTREAM_WHEEL"):
        return Path(explicit or os.environ["PEFT_UPSTREAM_WHEEL"])
    try:
        return bench_model.find_wheel(None, "upstream")
    except SystemExit:
        sys.path.insert(0, str(bench_model.REPO))
        from tools import upstream as pinned

        return pinned.wheel()


def _ours_wheel(explicit, workdir: Path) -> Path:
    try:
        return bench_model.find_wheel(explicit, "ours")
    except SystemExit:
        import compare

        return compare.build_ours(workdir / "wheels")  # pip wheel --no-deps --no-build-isolation of this checkout


def wheel_targets(cfg: dict, args, workdir: Path) -> dict:
    """The install directory of each wheel the plan needs: ours (``--use-installed``: this environment's), upstream."""
    wheels = {IMPLS[i]["wheel"] for i in cfg["impls"]}
    targets = {}
    if "ours" in wheels:
        ours = _installed_peft() if args.use_installed else _ours_wheel(args.ours_wheel, workdir)
        targets["ours"] = ours if args.use_installed else bench_model.install(ours, workdir / "targets")
    if "upstream" in wheels:
        targets["upstream"] = bench_model.install(_upstream_wheel(args.upstream_wheel), workdir / "targets")
    return targets


def worker_env(target: Path, device: str, impl_env: Optional[dict] = None) -> dict:
    """The workers' environment: no ``PEFT_DORA_*`` of the caller's, only the impl's own (``IMPLS[...]["env"]``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PEFT_DORA_")}
    env.update(impl_env or {})
    env["PYTHONPATH"] = os.pathsep.join([str(target)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env.update(PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0")  # NVLink multicast stays off on the lent machines
    if device == "cpu":
        env["OMP_NUM_THREADS"] = "1"  # tiny tensors, one core per process
        env["DS_ACCELERATOR"] = "cpu"  # DeepSpeed's CPU accelerator for the ZeRO engines (gloo)
    return env


def launch(cfg: dict, job: dict, target: Path, workdir: Path, timeout: float) -> dict:
    """One torchrun launch; what rank 0 wrote (records, peft info) plus every process's error, or the exit status."""
    tag = f"{job['impl']}_r{job['round']}"
    result = workdir / f"result_{tag}.json"
    for old in [result, *workdir.glob(f"result_{tag}.rank*.err")]:
        old.unlink(missing_ok=True)
    spec = job_spec(cfg, job)
    spec["impl"]["target"], spec["result"] = str(target), str(result)
    spec_path = workdir / f"spec_{tag}.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={spec['nproc']}",
           str(WORKER), str(spec_path)]  # fmt: skip
    print(f"--- {tag}: starting", flush=True)
    t0 = time.perf_counter()
    # a session of its own, so that a timeout ends torchrun and every worker it started
    env = worker_env(target, cfg["device"], spec["impl"].get("env"))
    proc = subprocess.Popen(cmd, env=env, cwd=HERE, start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rc = "timeout"
    wall = time.perf_counter() - t0
    print(f"--- {tag}: exit {rc} after {wall:.0f} s", flush=True)
    out = json.loads(result.read_text()) if result.exists() else {"records": [], "errors": []}
    out["wall_s"] = round(wall, 1)
    for err in sorted(workdir.glob(f"result_{tag}.rank*.err")):
        out["errors"].append({"impl": job["impl"], "round": job["round"], "process": err.suffixes[-2][5:],
                              "error": err.read_text()})  # fmt: skip
    if rc != 0 and not out["errors"]:
        out["errors"].append({"impl": job["impl"], "round": job["round"], "error": f"torchrun exit {rc}"})
    return out


# ---------------------------------------------------------------------------------------------------------------
# Analysis: ratios, memory, losses, headline.
# ---------------------------------------------------------------------------------------------------------------


def speed_view(doc: dict) -> dict:
    """The records as ``bench_model``'s speed records, rounds collapsed, for its ratio functions."""
    return {"speed": bench_model.collapse_rounds([dict(r) for r in doc["records"]])}


def _train_records(doc: dict, impl: str, rank: int) -> list:
    """The separately timed training records of (impl, rank), one per round (not the paired ones)."""
    return [r for r in doc["records"] if (r["impl"], r["rank"]) == (impl, rank) and r.get("measure") == "train"]


def _peak(doc: dict, impl: str, rank: int):
    peaks = [r["peak_delta_mb"] for r in _train_records(doc, impl, rank)]
    return None if not peaks or None in peaks else max(peaks)


def _loss_diff(doc: dict, impl: str, rank: int, ref: str = "upstream"):
    """Largest |loss − ``ref``'s loss| over steps, each round against ``ref``'s round 0."""
    refs, recs = _train_records(doc, ref, rank), _train_records(doc, impl, rank)
    if not refs or not recs:
        return None
    base = min(refs, key=lambda r: r["round"])["losses"]
    return max(abs(a - b) for r in recs for a, b in zip(r["losses"], base))


def _host_issue(doc: dict, impl: str, rank: int) -> Optional[float]:
    """The slowest process's median host issue time of a step (ms; ``model_worker.measure``), the median over the
    impl's rounds; None for records made before it was kept. Near or above ``step_ms``: the step waits on the host."""
    per_round = [
        max(r["host_issue_ms_per_rank"])
        for r in _train_records(doc, impl, rank)
        if None not in (r.get("host_issue_ms_per_rank") or [None])
    ]
    return round(statistics.median(per_round), 3) if per_round else None


def summarize(doc: dict) -> list:
    """One row per rank: median step ms per impl, the host's issue time of a step per impl, DoRA/LoRA per DoRA impl
    and upstream/ours (medians of per-round ratios; None where a record is missing or failed its gradient proof),
    peak over static and its delta over LoRA in % (largest process, largest round), step-0 loss and the largest
    |loss diff| vs upstream, and ours' vs the single-process reference (None where it did not run)."""
    view, cfg, rows = speed_view(doc), doc["config"], []
    mode = cfg["precision"]
    dora = DORA + tuple(i for i in cfg["impls"] if i not in DORA and IMPLS.get(i, {}).get("dora"))
    for rank in cfg["ranks"]:
        ms = {i: bench_model.speed_value(view, i, mode, "train", rank) for i in cfg["impls"]}
        peak = {i: _peak(doc, i, rank) for i in cfg["impls"]}
        over = {i: 100 * (peak[i] / peak["lora"] - 1) if peak.get(i) and peak.get("lora") else None for i in dora}
        step0 = {r["impl"]: r["step0_loss"] for r in sorted(doc["records"], key=lambda r: -r["round"])
                 if r["rank"] == rank and r.get("measure") == "train"}  # fmt: skip
        paired = {i: bench_model.paired_ratio(view, mode, "train_step_paired", rank, impl=i) for i in dora}
        up, ours = paired.get("upstream"), paired.get("ours")
        rows.append({
            "rank": rank, "step_ms": ms, "host_issue_ms": {i: _host_issue(doc, i, rank) for i in cfg["impls"]},
            "dora_over_lora": {i: bench_model.time_ratio(view, i, "lora", mode, "train", rank) for i in dora},
            "speedup_vs_upstream": bench_model.time_ratio(view, "upstream", "ours", mode, "train", rank),
            # DoRA against its LoRA twin model in the same launch (--pairs), and upstream's such ratio over ours'
            "dora_over_lora_paired": paired,
            "speedup_vs_upstream_paired": round(up / ours, 4) if up and ours else None,
            "peak_delta_mb": peak, "peak_delta_over_lora_pct": over, "step0_loss": step0,
            "loss_max_abs_diff_vs_upstream": {i: _loss_diff(doc, i, rank) for i in cfg["impls"] if i != "upstream"},
            "loss_max_abs_diff_vs_single_gpu": _loss_diff(doc, "ours", rank, "single"),
            "proof_ok": {i: all(bench_model.proof_ok(r) for r in view["speed"] if (r["impl"], r["rank"]) == (i, rank))
                         for i in cfg["impls"]},
        })  # fmt: skip
    return rows


def _worst(values: list, pick, spec=".4f"):
    return None if not values or None in values else float(format(pick(values), spec))


def headline_values(doc: dict) -> dict:
    """The worst case over ranks: ours' DoRA/LoRA step time (largest), ours' speed-up over upstream (smallest),
    ours' peak over LoRA's in % (largest); None where a rank lacks the value, and no key where the run left out an
    impl it compares. ``multi_gpu_gpu`` names the GPUs. Where the references ran: ours'
    largest |loss − single-process loss| and the sharded norm's largest relative error (FSDP2). A ``--quant`` run
    (QDoRA against QLoRA) has keys of its own, ``qdora_<engine>_*``."""
    rows, engine, impls = summarize(doc), doc["config"]["engine"], set(doc["config"]["impls"])
    big = doc["config"]["shape"] == "70b"  # the 70B-class run (issue 23's keys, eight_gpu_*: on 8 or fewer GPUs)
    prefix = "multi_gpu_" + ("" if engine == "fsdp2" else f"{engine}_")
    names = {
        "ratio": f"{engine}_dora_over_lora_train",
        "speed": f"{engine}_train_speedup_vs_upstream",
        "peak": prefix + "peak_delta_over_lora_pct",
        "single": prefix + "loss_max_abs_diff_vs_single_gpu",
        "gpu": "multi_gpu_gpu",
    }
    if big:
        e = f"eight_gpu_{engine}"
        names = {"ratio": f"{e}_dora_over_lora_train", "speed": f"{e}_speedup_vs_upstream",
                 "peak": f"{e}_peak_delta_over_lora_pct", "single": f"{e}_loss_max_abs_diff_vs_single_gpu",
                 "gpu": "eight_gpu_gpu"}  # fmt: skip
    if doc["config"].get("quant"):  # QDoRA against QLoRA: keys of their own
        first = "eight_gpu_qdora" if big else "qdora"
        names = {"ratio": f"{first}_{engine}_over_qlora_train", "speed": f"{first}_{engine}_train_speedup_vs_upstream",
                 "peak": f"{first}_{engine}_peak_delta_over_qlora_pct",
                 "single": f"{first}_{engine}_loss_max_abs_diff_vs_single_gpu", "gpu": names["gpu"]}  # fmt: skip
    out = {}  # a key only where the run had the impls it compares (a run of the references alone sets no ratio)
    # where the DoRA launches paired their steps with a LoRA twin (--pairs), the ratio and the speed-up are the pairs'
    # (the separately timed launches' in ``<key>_separate``), as the grid's and the compiled runs' are
    paired = any(r.get("measure") == "train_step_paired" for r in doc["records"])
    if {"ours", "lora"} <= impls or (paired and "ours" in impls):
        ratios = [r["dora_over_lora_paired"]["ours"] if paired else r["dora_over_lora"]["ours"] for r in rows]
        out[names["ratio"]] = _worst(ratios, max)
    if paired and {"ours", "lora"} <= impls:
        out[names["ratio"] + "_separate"] = _worst([r["dora_over_lora"]["ours"] for r in rows], max)
    if {"ours", "lora"} <= impls:
        out[names["peak"]] = _worst([r["peak_delta_over_lora_pct"]["ours"] for r in rows], max)
    if {"ours", "upstream"} <= impls:
        speeds = [r["speedup_vs_upstream_paired"] if paired else r["speedup_vs_upstream"] for r in rows]
        out[names["speed"]] = _worst(speeds, min)
        if paired:
            out[names["speed"] + "_separate"] = _worst([r["speedup_vs_upstream"] for r in rows], min)
    if out and doc["kind"] == "gpu":
        out[names["gpu"]] = f"{doc['config']['nproc']}x {doc.get('env', {}).get('gpu')}"
    if any(r["impl"] == "single" for r in doc["records"]):
        diffs = [r["loss_max_abs_diff_vs_single_gpu"] for r in rows]
        out[names["single"]] = _worst(diffs, max, ".3g")
    if doc.get("norm_check"):
        out["sharded_norm_rel_err_vs_unsharded"] = float(format(doc["norm_check"]["max_rel_err"], ".3g"))
    return out


# ---------------------------------------------------------------------------------------------------------------
# Report: JSON, table, plot.
# ---------------------------------------------------------------------------------------------------------------


def write_doc(doc: dict, path: Path, places: dict) -> None:
    """The JSON with summary and headline values, machine paths (checkout, work dir, output folder, install targets,
    site-packages) replaced by placeholders, longest first so that a work dir inside the output folder stays whole."""
    doc["summary"], doc["headline"] = summarize(doc), headline_values(doc)
    ordered = dict(sorted(places.items(), key=lambda kv: -len(str(kv[1]))))
    bench_model.write_doc(json.loads(bench_model.scrub(json.dumps(doc), ordered)), path)


def _f(x, spec=".3f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(doc: dict) -> None:
    impls = doc["config"]["impls"]
    print(f"\n== {doc['kind']} {doc['config']['engine']} x{doc['config']['nproc']} on {doc['env'].get('gpu')}: step ms "
          "per impl, DoRA/LoRA (ours, upstream), speed-up upstream/ours, peak over LoRA % (ours, upstream), "
          "max |loss - upstream|, max |ours - single| ==")  # fmt: skip
    for r in summarize(doc):
        ms = " ".join(f"{i} {_f(r['step_ms'][i], '.1f')}" for i in impls)
        ratio = " ".join(_f(r["dora_over_lora"][i]) for i in DORA)
        peak = " ".join(_f(r["peak_delta_over_lora_pct"][i], "+.1f") for i in DORA)
        diff = " ".join(f"{i} {_f(v, '.2e')}" for i, v in r["loss_max_abs_diff_vs_upstream"].items())
        proof = "" if all(r["proof_ok"].values()) else f"  PROOF FAILED {r['proof_ok']}"
        single = _f(r["loss_max_abs_diff_vs_single_gpu"], ".2e")
        print(f"r={r['rank']:<4d} {ms} | {ratio} | x {_f(r['speedup_vs_upstream'], '.2f')} | peak {peak} | "
              f"{diff} | single {single}{proof}")  # fmt: skip
        if any(v is not None for v in r["dora_over_lora_paired"].values()):
            pairs = " ".join(f"{i} {_f(v)}" for i, v in r["dora_over_lora_paired"].items())
            print(f"       paired with a LoRA twin in each launch: DoRA/LoRA {pairs} | "
                  f"x {_f(r['speedup_vs_upstream_paired'], '.2f')}")  # fmt: skip
    if doc.get("norm_check"):
        n = doc["norm_check"]
        print(
            f"norm check (fsdp2, {n['precision']}, r={n['rank']}): sharded vs whole norm, max rel err "
            f"{n['max_rel_err']:.2e} over {n['modules']} DoRA Linears per process, {n['row_sharded']} row-sharded"
        )
    for e in doc["errors"]:
        print(f"ERROR {e['impl']} round {e['round']}: {e['error'].strip().splitlines()[-1]}")
    for s in doc["skipped"]:
        print(f"SKIPPED {s}")
    print("headline values: " + json.dumps(headline_values(doc)))


def plot(doc: dict, path: Path):
    """Bars of the median step ms per implementation per rank (None: matplotlib is not installed)."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, impls = summarize(doc), doc["config"]["impls"]
    w = 0.8 / len(impls)
    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(rows)), 4.5))
    for j, impl in enumerate(impls):
        vals = [r["step_ms"][impl] for r in rows]
        ax.bar([k + (j - (len(impls) - 1) / 2) * w for k in range(len(rows))],
               [math.nan if v is None else v for v in vals], w, label=impl)  # fmt: skip
    ax.set_xticks(range(len(rows)), [f"r{r['rank']}" for r in rows])
    ax.set_ylabel("training step, ms (median)")
    ax.legend()
    cfg = doc["config"]
    smoke = "\nCPU SMOKE RUN: a pipeline check, not a measurement" if doc["kind"] != "gpu" else ""
    layers = cfg["model"]["config_kwargs"]["num_hidden_layers"]
    ax.set_title(f"{cfg['engine']} x{cfg['nproc']}, {cfg['shape']} ({layers} layers), seq {cfg['seq']}, "
                 f"{cfg['precision']} on {doc['env'].get('gpu')}{smoke}", fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------------------------
# The driver.
# ---------------------------------------------------------------------------------------------------------------


def run(args, argv: list) -> int:
    cfg = resolve_config(args)
    jobs = plan_jobs(cfg)
    print_plan(cfg, jobs)
    if args.plan:
        return 0
    gpu = cfg["device"].startswith("cuda")
    if args.headline and not gpu:
        raise SystemExit("--headline: only a GPU run writes headline values (this is a CPU run)")
    out = Path(args.out or (bench_model.RESULTS / ("" if gpu else "cpu_smoke") / "multi_gpu.json"))
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    targets = wheel_targets(cfg, args, workdir)
    places = {"repo": bench_model.REPO, "workdir": workdir.resolve(), "out": out.resolve().parent}
    places.update({f"target_{k}": v for k, v in targets.items()})
    doc = {"schema": SCHEMA, "kind": "gpu" if gpu else "cpu_smoke", "env": bench_model.environment(cfg["device"], {}),
           "impls": {}, "config": cfg, "runs": [{"argv": argv}], "records": [], "launches": [], "errors": [],
           "skipped": []}  # fmt: skip
    for job in jobs:
        if args.deadline_min is not None and time.time() - t_start > 60 * args.deadline_min:
            doc["skipped"].append(dict(job, why="deadline"))
            continue
        result = launch(cfg, job, targets[job_spec(cfg, job)["impl"]["wheel"]], workdir, args.timeout_s)
        if "norm_check" in result:
            doc["norm_check"] = result["norm_check"]
        if "info" in result:
            doc["env"].update({k: v for k, v in result["info"].pop("env").items() if v is not None})
            doc["impls"][job["impl"]] = result["info"]
        doc["records"] += result["records"]
        doc["errors"] += result["errors"]
        doc["launches"].append(dict(job, wall_s=result["wall_s"], world=result.get("world"),
                                    backend=result.get("backend"),
                                    pinned_cores=result.get("pinned_cores")))  # fmt: skip
        for r in result["records"]:
            if not r["grad_proof"]["ok"]:
                failed = f"rank {r['rank']}: gradient proof failed {r['grad_proof']['bad_names']}"
                doc["errors"].append({"impl": r["impl"], "round": r["round"], "error": failed})
        write_doc(doc, out, places)  # after every launch: a run cut off keeps what finished
    doc["runs"][-1]["wall_s"] = round(time.time() - t_start, 1)
    write_doc(doc, out, places)
    report(doc, out)
    if args.headline:
        written = bench_model.write_headline(doc["kind"], headline_values(doc), Path(args.headline))
        print(f"updated {args.headline}: {json.dumps(written)}")
    return 1 if doc["errors"] else 0


def report(doc: dict, out: Path) -> None:
    """The table on stdout and the plot beside the JSON ``out`` just written."""
    print_table(doc)
    print(f"wrote {out}")
    png = plot(doc, out.with_suffix(".png"))
    print(f"wrote {png}" if png else "no plot: matplotlib is not installed")


POOLED_CONFIG = ("engine", "nproc", "device", "shape", "model", "ranks", "impls", "seq", "batch", "precision", "quant",
                 "reshard", "meta_init", "warmup", "steps", "lr", "lora")  # fmt: skip


def pool_runs(paths: list) -> dict:
    """One document with the timed rounds of every run in ``paths`` (the same configuration, :data:`POOLED_CONFIG`),
    renumbered in order, so that ``summarize``'s medians of per-round ratios run over all of them. The references
    (single process, norm check) and errors of each run come along; ``config["pooled_from"]`` names the files."""
    docs = [json.loads(Path(path).read_text()) for path in paths]
    out = json.loads(json.dumps(docs[0]))
    out["config"]["pooled_from"] = [Path(path).name for path in paths]
    offset = 1 + max((r["round"] for r in out["records"]), default=-1)
    for path, doc in zip(paths[1:], docs[1:]):
        differ = [k for k in POOLED_CONFIG if doc["config"].get(k) != out["config"].get(k)]
        if doc["kind"] != out["kind"] or differ:
            raise SystemExit(f"--pool: {path} is another configuration ({', '.join(differ) or doc['kind']})")
        if doc["env"].get("gpu") != out["env"].get("gpu"):
            raise SystemExit(f"--pool: {path} ran on {doc['env'].get('gpu')}, not {out['env'].get('gpu')}")
        rounds = 1 + max((r["round"] for r in doc["records"]), default=-1)
        for key in ("records", "launches", "errors"):
            out[key] += [dict(r, round=r["round"] + offset) if "round" in r else r for r in doc[key]]
        for key in ("runs", "skipped"):
            out[key] += doc[key]
        out["env"]["date"] = doc["env"].get("date", out["env"].get("date"))
        offset += rounds
    out["config"]["rounds"] = offset
    return out


def headline_from(paths: list, headline: Path) -> int:
    """The headline keys of committed runs, recomputed from their JSON (``summarize`` over the records as they ran).
    A key that several runs set (the same engine in both precisions) takes the worst of them: the smallest speed-up,
    the largest of the rest; ``multi_gpu_gpu`` (``eight_gpu_gpu`` for the 70B runs) names each run's GPUs with the
    engines run on them where they differ."""
    merged, gpus, kinds = {}, {key: {} for key in GPU_KEYS}, set()
    for path in paths:
        doc = json.loads(Path(path).read_text())
        values = headline_values(doc)
        kinds.add(doc["kind"])
        print(f"{path}: {json.dumps(values)}")
        for key in GPU_KEYS:
            gpu = values.pop(key, None)
            if gpu is not None:
                gpus[key].setdefault(gpu, []).append(doc["config"]["engine"])
        for key, value in values.items():
            if key in merged:  # unknown (None) in either: unknown
                pick = min if "speedup_vs_upstream" in key else max
                value = None if None in (value, merged[key]) else pick(value, merged[key])
            merged[key] = value
    for key, runs in gpus.items():
        if runs:
            merged[key] = (
                next(iter(runs))
                if len(runs) == 1
                else "; ".join(f"{gpu} ({', '.join(dict.fromkeys(engines))})" for gpu, engines in runs.items())
            )
    written = bench_model.write_headline("gpu" if kinds == {"gpu"} else "cpu", merged, headline)
    print(f"updated {headline}: {json.dumps(written)}")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.headline_from:
        return headline_from(args.headline_from, Path(args.headline or bench_model.RESULTS / "headline.json"))
    if args.pool:
        if not args.out:
            raise SystemExit("--pool needs --out")
        doc, out = pool_runs(args.pool), Path(args.out)
        write_doc(doc, out, {})
        report(doc, out)
        return 0
    return run(args, argv)


if __name__ == "__main__":
    sys.exit(main())
