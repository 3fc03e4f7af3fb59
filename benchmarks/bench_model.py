"""Model benchmark: upstream PEFT 0.21.2 DoRA vs ours (eager, fused) vs plain LoRA on a real-size decoder.

A Llama-architecture model (or ``--preset qwen`` / ``gemma``) is built from a config with seeded random weights in
bf16, with gradient checkpointing, and wrapped with ``LoraConfig(r, lora_alpha=r/2, use_rslora=True,
use_dora=True)`` on all seven projections. Every implementation runs in its own subprocess (fresh CUDA context,
clean import) from its own ``pip install --target`` directory, and each (implementation, precision mode) pair gets
a fresh process. Measures: training step, the same with 4-step gradient accumulation, inference forward, prefill
and KV-cached generation (decode latency per token), each with peak memory over the static allocation; plus
logits/gradient fidelity against an fp32 run, a 500-step convergence comparison on a small model, and an optional
profile. The parent writes one JSON (and plots) and can merge partial JSONs and update ``results/headline.json``.

``--grid default`` runs a designed grid instead (model shapes of the 1B-8B class x rank, sequence, batch, targets,
dropout and precision mode; train, x4 accumulation, inference and paired 1-token decode), one subprocess per
(implementation, round) that builds each shape's base model once and loops over its points; its headline is the
worst point.

    # the whole benchmark on a GPU (see benchmarks/README.md for the split into device calls)
    python benchmarks/bench_model.py --ours-wheel W1 --upstream-wheel W2 --out-dir OUT --profile
    python benchmarks/bench_model.py --tiny --device cpu          # every code path on CPU in a few minutes
    python benchmarks/bench_model.py --grid default --dry-run     # the grid, its cost and its split into calls
    python benchmarks/bench_model.py --grid tiny --device cpu     # every grid code path on CPU in a few minutes
    python benchmarks/bench_model.py --merge a.json b.json -o model.json
    python benchmarks/bench_model.py --headline model.json        # update results/headline.json from a JSON
"""

from __future__ import annotations

import argparse
import datetime
import glob
import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
WORKER = HERE / "model_worker.py"
SCHEMA = "bench_model/1"

IMPLS = {
    # name: which wheel, is it our DoRA, use_dora, PEFT_DORA_* variables set in the subprocess (others unset)
    "upstream": {"wheel": "upstream", "ours": False, "dora": True, "env": {}},
    "ours_eager": {"wheel": "ours", "ours": True, "dora": True, "env": {"PEFT_DORA_FUSED": "0"}},
    "ours_fused": {"wheel": "ours", "ours": True, "dora": True, "env": {}},
    "lora": {"wheel": "upstream", "ours": False, "dora": False, "env": {}},
    # opt-in (not in the default --impls): the fused tier with norm reuse across forwards; and the fused tier forced
    # on every composition, so that a small model (below the crossover, where "ours_fused" runs eager) tests the
    # kernels in training (convergence eager vs fused)
    "ours_fused_reuse": {"wheel": "ours", "ours": True, "dora": True, "env": {"PEFT_DORA_NORM_CACHE": "1"}},
    "ours_fused_forced": {"wheel": "ours", "ours": True, "dora": True, "env": {"PEFT_DORA_FUSED_BACKWARD": "1"}},
    # the convergence noise floor: upstream itself with every initial magnitude moved by one ulp, about the size of
    # the rounding difference between two correct norms; how far two such runs drift apart is the task's own chaos
    "upstream_ulp": {"wheel": "upstream", "ours": False, "dora": True, "env": {}, "perturb_ulp": True},
}
DEFAULT_IMPLS = ("upstream", "ours_eager", "ours_fused", "lora")
DORA_IMPLS = ("upstream", "ours_eager", "ours_fused")
CONVERGENCE_IMPLS = DORA_IMPLS + ("ours_fused_forced", "upstream_ulp")
MODES = ("autocast", "bf16")
# the grid's modes also take "mixed": PEFT's default fp32 adapters beside the bf16 base without autocast (a training
# loop of one's own; PeftModel.from_pretrained onto a bf16 model), model_worker.FP32_ADAPTER_MODES
GRID_MODES = MODES + ("mixed",)
MEASURES = ("train", "train_accum4", "step_accum4", "infer", "decode")
# opt-in: decode under peft.helpers.DoraCaching; decode of a DoRA impl paired with a LoRA twin in its own process
EXTRA_MEASURES = ("decode_cached", "decode_paired")
TASKS = ("speed", "fidelity", "convergence", "profile")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")
COMPILED_MEASURES = ("train", "infer")
# with --compile, ours (the --paired-impls) also times its compiled training step and inference forward against a
# compiled plain-LoRA twin model (own base, same seeded weights), back to back (the compiled_* DoRA/LoRA keys come
# from these)
COMPILED_PAIRED = ("train_step_paired", "infer_step_paired")

PRESETS = {
    "llama": {
        "config_class": "LlamaConfig",
        "model_class": "LlamaForCausalLM",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    },
    "qwen": {
        "config_class": "Qwen2Config",
        "model_class": "Qwen2ForCausalLM",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
    },
    # Gemma (7B-like dims): embeddings scaled by sqrt(hidden), head_dim 256, tied embeddings.
    "gemma": {
        "config_class": "GemmaConfig",
        "model_class": "GemmaForCausalLM",
        "hidden_size": 3072,
        "intermediate_size": 24576,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "head_dim": 256,
    },
}
TINY = {"hidden_size": 64, "intermediate_size": 176, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


# ---------------------------------------------------------------------------------------------------------------
# The grid (--grid): model shapes x designed points; its headline is the worst point.
# ---------------------------------------------------------------------------------------------------------------

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GRID_TARGETS = {"qv": ("q_proj", "v_proj"), "all": PROJECTIONS}


def _shape(preset: str, layers: int, **dims) -> dict:
    return dict(PRESETS[preset], **dims, num_hidden_layers=layers)


# Real models' dimensions (their published configs), vocabulary 32000, and as many decoder layers as make the LM
# head no larger a share of the weights than in the real model (Llama-3.2-1B 27 %, Llama-3.2-3B 14 %,
# Llama-3.1-8B 7.5 %, Qwen2.5-1.5B 18 %; here 27, 12, 7.5 and 17.5 %). Every decoder layer costs the same, so
# such a stack has the full model's DoRA/LoRA ratio, and fewer layers than that would let the head dilute it.
GRID_SHAPES = {
    "llama1b": _shape("llama", 4, hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=64),
    "llama3b": _shape("llama", 8, hidden_size=3072, intermediate_size=8192, num_attention_heads=24,
                      num_key_value_heads=8, head_dim=128),
    "llama8b": _shape("llama", 8, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128),
    "qwen1.5b": _shape("qwen", 6, hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                       num_key_value_heads=2, head_dim=128),  # q, k, v with bias, as in Qwen2
}  # fmt: skip
# The designed points, the same for every shape so that shapes compare cell by cell: what people run most (r 8-64,
# seq 512-2048, q,v and all-linear, dropout 0.05, autocast) most often, each axis' extremes at least once (r 8 and
# 768, seq 512 and 4096, batch 1 and 8, both targets, dropout 0 and 0.05, both precision modes), at most 8192
# tokens a step. accum4: the point also times a step of 4-micro-step gradient accumulation.
GRID_ROWS = (
    # mode      rank  seq  batch targets dropout accum4
    ("autocast",   8,  512, 1, "all", 0.05, True),
    ("autocast",  16, 1024, 4, "all", 0.05, False),
    ("autocast",  32, 2048, 1, "qv",  0.05, False),
    ("autocast",  64,  512, 8, "all", 0.0,  False),
    ("autocast",  16, 4096, 1, "qv",  0.0,  False),
    ("autocast", 128, 1024, 2, "all", 0.05, False),
    ("autocast", 768, 2048, 2, "all", 0.0,  True),
    ("autocast", 256, 4096, 2, "qv",  0.05, False),
    ("bf16",       8, 2048, 2, "all", 0.05, False),
    ("bf16",      16,  512, 1, "all", 0.05, False),
    ("bf16",      64, 1024, 1, "qv",  0.05, True),
    ("bf16",     768,  512, 4, "qv",  0.0,  False),
    ("bf16",      32, 4096, 1, "all", 0.0,  False),
)  # fmt: skip
TINY_GRID_SHAPES = {"tiny_llama": _shape("llama", 2, **TINY), "tiny_qwen": _shape("qwen", 2, **TINY)}
TINY_GRID_ROWS = (  # every code path: both modes, both targets, dropout 0 and 0.05, accumulation
    ("autocast", 4, 32, 1, "all", 0.05, False),
    ("bf16", 8, 64, 2, "qv", 0.0, True),
)
# fp32 adapters beside the bf16 base without autocast (--grid mixed, its own run and headline keys): the default
# grid's axes at fewer points, each extreme once
MIXED_GRID_ROWS = (
    # mode    rank  seq  batch targets dropout accum4
    ("mixed",   8,  512, 1, "all", 0.05, False),
    ("mixed",  16, 1024, 4, "all", 0.0,  True),
    ("mixed",  64, 2048, 1, "qv",  0.05, False),
    ("mixed", 768,  512, 4, "qv",  0.0,  False),
    ("mixed",  32, 4096, 2, "all", 0.0,  False),
)  # fmt: skip
GRIDS = {
    "default": (GRID_SHAPES, GRID_ROWS),
    "tiny": (TINY_GRID_SHAPES, TINY_GRID_ROWS),
    "mixed": (GRID_SHAPES, MIXED_GRID_ROWS),
}
GRID_IMPLS = ("upstream", "ours_fused", "lora")
GRID_ROUND_IMPLS = ["ours_fused", "lora"]  # upstream runs once: only its training speed-up is a headline key
# upstream's training step paired with a LoRA twin in its own process, as ours is in ours: the speed-up is the ratio of
# the two processes' DoRA/LoRA ratios, each of two steps back to back, which a host's drift between the processes
# leaves alone (separately timed steps of ours swung by 20 % between rounds a minute apart, 4x H200 grid)
GRID_UPSTREAM_MEASURES = ["train_step_paired"]
GRID_DECODE = {"pairs": 4, "steps": 6}  # ABBA pairs of DoRA/LoRA adapters; 1-token forwards timed per side and pair
GRID_TRAIN_PAIRS = 4  # ABBA pairs of DoRA/LoRA training steps in one process (model_worker.train_step_paired)
TRAIN_MEASURES = ("train", "train_accum4")
PAIRED = ("train_step_paired", "infer_step_paired", "decode_step_paired")  # DoRA/LoRA twin, back to back
GRID_RATIOS = TRAIN_MEASURES + ("infer",) + PAIRED  # ours fused / LoRA per point


def point_label(shape: str, mode: str, rank: int, seq: int, batch: int, targets: str, dropout: float) -> str:
    return f"{shape} {mode} r{rank} seq{seq} b{batch} {targets} drop{dropout:g}"


def grid_points(name: str) -> list:
    """The named grid's points, shape by shape, each a dict the worker reads (``modules``: the target modules)."""
    shapes, rows = GRIDS[name]
    points = []
    for shape in shapes:
        for mode, rank, seq, batch, targets, dropout, accum4 in rows:
            where = dict(shape=shape, mode=mode, rank=rank, seq=seq, batch=batch, targets=targets, dropout=dropout)
            points.append(dict(where, label=point_label(**where), modules=list(GRID_TARGETS[targets]), accum4=accum4))
    return points


def grid_measures(cfg: dict, impl: str) -> list:
    """What ``impl`` measures at a grid point: upstream the training step paired with its LoRA twin (its speed-up is
    the only upstream key, and its decode costs 3-4x ours), every other impl train, x4 accumulation (at the points
    that ask) and inference, and the DoRA impls of ``--paired-impls`` the training step, the inference forward and
    the 1-token decode paired with a LoRA twin."""
    if impl == "upstream":
        return list(GRID_UPSTREAM_MEASURES)
    paired = list(PAIRED) if impl in cfg["decode_paired"]["impls"] else []
    return ["train", "train_accum4", "infer"] + paired


# ---------------------------------------------------------------------------------------------------------------
# Configuration.
# ---------------------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--preset", choices=sorted(PRESETS), default="llama")
    a("--tiny", action="store_true", help="tiny dims, ranks 4,8, 2 repeats, 20 convergence steps (CPU smoke)")
    a("--device", default="cuda")
    a("--layers", type=int, help="decoder layers (default 8; tiny 2)")
    a("--vocab", type=int, help="vocabulary (default 32000; tiny 512)")
    a("--hidden", type=int, help="override the preset's hidden size")
    a("--intermediate", type=int, help="override the preset's intermediate size")
    a("--heads", type=int, help="override the preset's attention heads (head_dim = hidden / heads)")
    a("--kv-heads", type=int, help="override the preset's KV heads")
    a("--seq", type=int, help="sequence length (default 4096; tiny 64)")
    a("--loss-tokens", type=int, help="loss on the last N tokens (default 1024; tiny 16)")
    a("--batch", type=int, default=1)
    a("--ranks", help="comma list (default 64,384,768; tiny 4,8)")
    a(
        "--impls",
        help=f"comma list of {', '.join(IMPLS)} (default {','.join(DEFAULT_IMPLS)}; grid and --compile "
        f"{','.join(GRID_IMPLS)})",
    )
    a("--modes", help="comma list of autocast, bf16 (default: both; a grid: its rows' modes, which may be mixed)")
    a(
        "--measures",
        help=f"comma list of {', '.join(MEASURES + EXTRA_MEASURES)} (default: all but the opt-in "
        f"{', '.join(EXTRA_MEASURES)}; with --compile {', '.join(COMPILED_MEASURES)})",
    )
    a("--tasks", help=f"comma list of {', '.join(TASKS)} (default speed,fidelity,convergence; grid: speed only)")
    a("--profile", action="store_true", help="add the profile task (ours fused vs plain LoRA, one training step)")
    a("--profile-impls", default="ours_fused,lora")
    a("--repeats", type=int, help="timed repeats per measure (default 5; tiny 2)")
    a(
        "--rounds",
        type=int,
        help="speed subprocesses per (impl, mode), interleaved in time; records keep every round, ratios between "
        "implementations are medians of per-round ratios (the host's speed drifts over minutes on shared machines); "
        "default 1, grid 2",
    )
    a(
        "--round-impls",
        help="impls repeated in every round (default: all; grid: ours_fused,lora); the others run in the first round "
        "only",
    )
    a("--grid", choices=sorted(GRIDS), help="run the designed grid (see GRID_ROWS): speed only, worst-case headline")
    a("--grid-shapes", help="comma list of the grid's shapes to run (default: all); split a grid into device calls")
    a("--warmup", type=int, help="untimed calls before each measure (default 2; tiny 1)")
    a(
        "--compile",
        choices=COMPILE_MODES,
        help="time every impl through torch.compile(model, mode=...): train and infer only; the run's JSON then "
        "holds compiled records only and feeds the compiled_* headline keys",
    )
    a(
        "--decode-pairs",
        type=int,
        help=f"DoRA/LoRA pairs per paired decode measure (ABBA order; default 8, grid {GRID_DECODE['pairs']}, tiny 2)",
    )
    a("--paired-impls", default="ours_fused", help="DoRA impls that run decode_paired (with its measure)")
    a("--prompt-tokens", type=int, help="generation prompt (default 128; tiny 16)")
    a("--new-tokens", type=int, help="generated tokens (default 128; tiny 8)")
    a("--headline-rank", type=int, help="rank for the headline ratios (default 384; tiny 8)")
    a("--fidelity-rank", type=int, help="rank for the fidelity runs (default: the headline rank)")
    a(
        "--grad-sample",
        type=int,
        default=65536,
        help="evenly spaced elements kept per lora_A/lora_B gradient for the cosines; 0 keeps all (exact, ~1 GB/run)",
    )
    a("--conv-steps", type=int, help="convergence steps (default 500; tiny 20)")
    a("--conv-seeds", default="0,1")
    a("--conv-lr", type=float, default=1e-3, help="AdamW learning rate of the convergence runs")
    a("--conv-mode", choices=("autocast", "bf16", "fp32"), help="precision of the convergence runs (GPU: autocast)")
    a("--conv-rank", type=int, help="convergence rank (default 64; tiny 8)")
    a("--seed", type=int, default=0)
    a("--ours-wheel", help="our built wheel, or a directory holding an install of it (default: .carry-bench/)")
    a("--upstream-wheel", help="the pinned upstream wheel or an install directory (default: .carry-bench/)")
    tmp = tempfile.gettempdir()
    a("--target-root", default=os.path.join(tmp, "peft_bench_targets"), help="where each wheel is pip-installed")
    a("--workdir", default=os.path.join(tmp, "peft_bench_work"), help="subprocess specs, logits and gradients (.pt)")
    a("--out-dir", help="JSON and PNGs (default benchmarks/results, or results/cpu_smoke off the GPU)")
    a("--out", help="JSON file name (default model_<preset>.json)")
    a("--deadline-min", type=float, default=0.0, help="skip jobs that would start after this many minutes")
    a("--no-plots", action="store_true")
    a("--dry-run", action="store_true", help="print the plan and the runtime estimate, run nothing")
    a("--merge", nargs="+", metavar="JSON", help="merge partial JSONs (later files win) into -o")
    a("-o", "--output", help="output of --merge")
    a(
        "--headline",
        metavar="JSON",
        nargs="+",
        help="update headline.json (beside the first JSON unless --headline-path) and stop; several --compile runs "
        "give the compiled keys' worst case over them",
    )
    a("--headline-path", help="headline.json to read-modify-write")
    return p.parse_args(argv)


def _ints(s: str) -> list:
    return [int(x) for x in s.split(",") if x.strip()]


def _names(s: str, allowed) -> list:
    names = [x.strip() for x in s.split(",") if x.strip()]
    bad = [n for n in names if n not in allowed]
    if bad:
        raise SystemExit(f"unknown {bad}; choose from {list(allowed)}")
    return names


def _grid_modes(name: str) -> list:
    """The precision modes of the named grid's rows, in order."""
    return list(dict.fromkeys(row[0] for row in GRIDS[name][1]))


def resolve_config(args) -> dict:
    """Everything a worker needs to build the model and run the tasks, with the tiny/full defaults filled in."""
    tiny = args.tiny or args.grid == "tiny"
    grid = args.grid is not None

    def pick(value, full, small):
        return value if value is not None else (small if tiny else full)

    preset = dict(PRESETS[args.preset])
    config_class, model_class = preset.pop("config_class"), preset.pop("model_class")
    dims = dict(preset, **TINY) if tiny else preset
    overrides = {
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
    }
    dims.update({k: v for k, v in overrides.items() if v is not None})
    if args.hidden or args.heads:
        dims["head_dim"] = dims["hidden_size"] // dims["num_attention_heads"]
    seq = pick(args.seq, 4096, 64)
    config_kwargs = dict(
        dims,
        vocab_size=pick(args.vocab, 32000, 512),
        num_hidden_layers=pick(args.layers, 8, 2),
        max_position_embeddings=max(seq, 8192 if not tiny else 128),
        initializer_range=0.02,
    )
    ranks = _ints(args.ranks) if args.ranks else ([4, 8] if tiny else [64, 384, 768])
    headline_rank = pick(args.headline_rank, 384, 8)
    tasks = _names(args.tasks or ("speed" if grid or args.compile else "speed,fidelity,convergence"), TASKS)
    tasks += ["profile"] if args.profile and "profile" not in tasks else []
    if grid and (tasks != ["speed"] or args.measures or args.ranks or args.compile):
        raise SystemExit("--grid runs the speed task on its own points and measures: leave --tasks, --profile, "
                         "--measures, --ranks and --compile unset")  # fmt: skip
    compiled = COMPILED_MEASURES + COMPILED_PAIRED
    measures = _names(args.measures or ",".join(compiled if args.compile else MEASURES),
                      MEASURES + EXTRA_MEASURES + COMPILED_PAIRED)  # fmt: skip
    if args.compile and (set(tasks) != {"speed"} or set(measures) - set(compiled)):
        raise SystemExit(
            f"--compile times {', '.join(compiled)} in the speed task only (got tasks {tasks}, measures "
            f"{measures}): pass --tasks speed and leave --measures unset or pick from those"
        )
    if not args.compile and set(measures) & set(COMPILED_PAIRED):
        raise SystemExit(f"{', '.join(COMPILED_PAIRED)} are --compile measures (the grid takes its own)")
    conv_dims = (
        dict(preset, **TINY)
        if tiny
        else dict(
            preset, hidden_size=512, intermediate_size=1408, num_attention_heads=8, num_key_value_heads=4, head_dim=64
        )
    )
    cfg = {
        "preset": args.preset,
        "tiny": tiny,
        "device": args.device,
        "model": {
            "config_class": config_class,
            "model_class": model_class,
            "config_kwargs": config_kwargs,
            "seq": seq,
            "loss_tokens": pick(args.loss_tokens, 1024, 16),
            "batch": args.batch,
            "prompt_tokens": pick(args.prompt_tokens, 128, 16),
            "new_tokens": pick(args.new_tokens, 128, 8),
            "seed": args.seed,
        },
        "lora": {"lora_alpha": "r/2", "use_rslora": True, "targets": "q,k,v,o,gate,up,down"},
        "ranks": ranks,
        # under --compile both of ours trace the same PyTorch output (the fused tiers are off): ours_fused only
        "impls": _names(args.impls or ",".join(GRID_IMPLS if grid or args.compile else DEFAULT_IMPLS), IMPLS),
        "modes": _names(
            args.modes or ",".join(_grid_modes(args.grid) if grid else MODES), GRID_MODES if grid else MODES
        ),
        "measures": measures,
        "tasks": tasks,
        "repeats": pick(args.repeats, 5, 2),
        "rounds": max(1, args.rounds or (2 if grid else 1)),
        "round_impls": _names(args.round_impls, IMPLS) if args.round_impls else GRID_ROUND_IMPLS if grid else None,
        "warmup": pick(args.warmup, 2, 1),
        "compile": args.compile,
        "decode_paired": {
            "pairs": max(1, pick(args.decode_pairs, GRID_DECODE["pairs"] if grid else 8, 2)),
            "impls": _names(args.paired_impls, [n for n in IMPLS if IMPLS[n]["dora"]]),
        },
        "headline_rank": headline_rank,
        "fidelity": {
            "rank": args.fidelity_rank or headline_rank,
            "rows": 64 if not tiny else 8,  # logits rows kept, evenly spaced over the loss window
            "grad_sample": args.grad_sample,  # per lora_A/lora_B gradient; 0 = all
            "modes": ["autocast", "bf16", "fp32"],
        },
        "convergence": {
            "config_kwargs": dict(
                conv_dims,
                vocab_size=256,
                num_hidden_layers=2 if tiny else 4,
                max_position_embeddings=64,
                initializer_range=0.02,
            ),
            "rank": pick(args.conv_rank, 64, 8),
            "steps": pick(args.conv_steps, 500, 20),
            "seeds": _ints(args.conv_seeds),
            "batch": 8,
            "seq": 64,
            "lr": args.conv_lr,
            "mode": args.conv_mode or ("autocast" if args.device.startswith("cuda") else "fp32"),
        },
        "profile": {"mode": "autocast", "rank": headline_rank, "top": 25, "impls": _names(args.profile_impls, IMPLS)},
    }
    if grid:
        cfg.update(grid_config(args, cfg))
    return cfg


def grid_config(args, cfg: dict) -> dict:
    """The grid's part of the configuration: its shapes' model configs and the points to run (``--grid-shapes``,
    ``--modes``), and the ranks and measures they use."""
    shapes, _ = GRIDS[args.grid]
    chosen = _names(args.grid_shapes, shapes) if args.grid_shapes else list(shapes)
    points = [p for p in grid_points(args.grid) if p["shape"] in chosen and p["mode"] in cfg["modes"]]
    models = {}
    for name in chosen:
        dims = dict(shapes[name])
        config_class, model_class = dims.pop("config_class"), dims.pop("model_class")
        layers = dims.pop("num_hidden_layers")
        config_kwargs = dict(
            dims,
            vocab_size=cfg["model"]["config_kwargs"]["vocab_size"],
            num_hidden_layers=args.layers or layers,
            max_position_embeddings=cfg["model"]["config_kwargs"]["max_position_embeddings"],
            initializer_range=0.02,
        )
        models[name] = dict(cfg["model"], config_class=config_class, model_class=model_class,
                            config_kwargs=config_kwargs)  # fmt: skip
    return {
        "lora": dict(cfg["lora"], targets="per point: q,v or all seven", dropout="per point"),
        "grid": {
            "name": args.grid,
            "models": models,
            "points": points,
            "decode": {"pairs": cfg["decode_paired"]["pairs"], "steps": GRID_DECODE["steps"]},
            "train_pairs": GRID_TRAIN_PAIRS,
            "cached": True,  # the paired inference and decode also time DoRA under DoraCaching (issue 20, item 5)
        },
        "ranks": sorted({p["rank"] for p in points}),
        "measures": sorted({m for i in cfg["impls"] for m in grid_measures(cfg, i)}, key=GRID_RATIOS.index),
    }


# ---------------------------------------------------------------------------------------------------------------
# Installs and jobs.
# ---------------------------------------------------------------------------------------------------------------


WHEEL_PATTERNS = {
    "ours": ("peft-*+dora*.whl", "ours*.whl"),
    "upstream": ("peft-0.21.2-py3-none-any.whl", "upstream*.whl"),
}


def find_wheel(explicit, which: str) -> Path:
    if explicit:
        return Path(explicit)
    for pattern in WHEEL_PATTERNS[which]:
        hits = sorted(glob.glob(str(REPO / ".carry-bench" / pattern)))
        if hits:
            return Path(hits[-1])
    raise SystemExit(f"no {which} wheel: pass --{which}-wheel or put {WHEEL_PATTERNS[which][0]} into .carry-bench/")


def _wheel_filename(wheel: Path) -> str:
    """The wheel's canonical file name from its own metadata, so a renamed copy (e.g. ``ours.whl``) installs."""
    import zipfile

    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        fields = dict(line.split(": ", 1) for line in zf.read(meta).decode().splitlines() if ": " in line)
    return f"{fields['Name']}-{fields['Version']}-py3-none-any.whl"


def install(wheel: Path, target_root: Path) -> Path:
    """``pip install --no-deps --target`` the wheel once (keyed by its sha256); a directory is used as it is."""
    if wheel.is_dir():
        if not (wheel / "peft" / "__init__.py").exists():
            raise SystemExit(f"{wheel} holds no peft package")
        return wheel.resolve()
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()[:12]
    target = target_root / f"{wheel.stem}-{digest}"
    if (target / ".installed").exists():
        return target
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    named = target_root / "wheels" / _wheel_filename(wheel)
    named.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(wheel, named)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-deps",
        "--no-index",
        "--no-compile",
        "--target",
        str(tmp),
        str(named),
    ]
    subprocess.run(cmd, check=True)
    (tmp / ".installed").write_text(wheel.name)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def _rounds(cfg: dict):
    """(round, impl) in run order: round k runs every repeated impl once (all impls in round 0), odd rounds in
    reverse order, so that a pair of implementations is measured close together, in alternating order."""
    repeated = cfg.get("round_impls") or cfg["impls"]
    for k in range(cfg.get("rounds", 1)):
        order = [i for i in cfg["impls"] if k == 0 or i in repeated]
        for impl in order[::-1] if k % 2 else order:
            yield k, impl


def plan_jobs(cfg: dict) -> list:
    """One job per (impl, mode) and round for speed (a grid: per (impl, round), every shape and mode in one process,
    which builds each shape's bf16 base once: a process start costs more than most points); one per impl for the
    other tasks. Most important first."""
    jobs = []
    if "grid" in cfg:
        modes = [m for m in cfg["modes"] if any(p["mode"] == m for p in cfg["grid"]["points"])]
        return [{"impl": impl, "tasks": ["speed"], "modes": modes, "round": k} for k, impl in _rounds(cfg)]
    if "speed" in cfg["tasks"]:
        for mode in cfg["modes"]:
            for k, impl in _rounds(cfg):
                jobs.append({"impl": impl, "tasks": ["speed"], "modes": [mode], "round": k})
    for impl in cfg["impls"]:
        tasks = []
        if "fidelity" in cfg["tasks"] and impl in DORA_IMPLS:
            tasks.append("fidelity")
        if "convergence" in cfg["tasks"] and impl in CONVERGENCE_IMPLS:
            tasks.append("convergence")
        if "profile" in cfg["tasks"] and impl in cfg["profile"]["impls"]:
            tasks.append("profile")
        if tasks:
            jobs.append({"impl": impl, "tasks": tasks, "modes": cfg["modes"]})
    return jobs


# Rough cost model for the estimate, from the FLOP count at an effective H200 rate and per-token launch costs.
# It only has to say whether a plan fits a 10-minute call; replace the constants with measured ones when known.
EFFECTIVE_FLOPS = 400e12
STARTUP_S = 20.0  # interpreter, imports, CUDA context, model build
DECODE_S_PER_TOKEN_PER_LAYER = 2.5e-3  # launch-bound HF decode step with a PEFT model, per decoder layer


def _projections(ck: dict) -> dict:
    """(d_out, d_in) of each projection of one decoder layer."""
    h, f = ck["hidden_size"], ck["intermediate_size"]
    kv = ck["num_key_value_heads"] * ck.get("head_dim", h // ck["num_attention_heads"])
    return dict(zip(PROJECTIONS, [(h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f)]))


def weights(ck: dict) -> int:
    """Parameters of the decoder layers and the LM head."""
    layers = sum(o * i for o, i in _projections(ck).values()) * ck["num_hidden_layers"]
    return layers + ck["vocab_size"] * ck["hidden_size"]


def forward_flops(ck: dict, batch: int, seq: int, rank: int, modules=PROJECTIONS, upstream=False) -> tuple:
    """FLOPs of one forward: weights, causal attention and the LoRA matmuls of the adapted ``modules``; and apart,
    upstream's dense norm (``eye(d_in)`` through A, then B, per adapted module and forward)."""
    proj, layers, tokens = _projections(ck), ck["num_hidden_layers"], batch * seq
    adapted = [proj[m] for m in modules]
    lora = 2 * rank * sum(o + i for o, i in adapted) * layers * tokens
    attention = 2 * batch * seq * seq * ck["hidden_size"] * layers
    dense = sum(2 * rank * i * (i + o) for o, i in adapted) * layers if upstream else 0.0
    return 2 * weights(ck) * tokens + attention + lora, dense


def estimate_s(cfg: dict, job: dict) -> float:
    if cfg["device"] == "cpu":
        return 0.0
    if "grid" in cfg:
        impl = IMPLS[job["impl"]]
        compiles = impl["ours"] and impl["env"].get("PEFT_DORA_FUSED") != "0" and job["round"] == 0
        points = sum(point_cost_s(cfg, p, job["impl"]) for p in job_points(cfg, job))
        return STARTUP_S + TRITON_COMPILE_S * compiles + points
    m, ck = cfg["model"], cfg["model"]["config_kwargs"]
    layers = ck["num_hidden_layers"]
    total, reps = STARTUP_S, cfg["repeats"] + cfg["warmup"]
    for rank in cfg["ranks"]:
        base, dense_norm = forward_flops(ck, m["batch"], m["seq"], rank, upstream=job["impl"] == "upstream")
        fwd = (base + dense_norm) / EFFECTIVE_FLOPS
        if "speed" in job["tasks"]:
            meas = cfg["measures"]
            total += reps * 3 * fwd * ("train" in meas) + reps * 12 * fwd * ("train_accum4" in meas)
            total += reps * 12 * fwd * ("step_accum4" in meas)
            total += reps * fwd * ("infer" in meas)
            per_tok = DECODE_S_PER_TOKEN_PER_LAYER * layers + dense_norm / EFFECTIVE_FLOPS
            total += ("decode" in meas) * (cfg["repeats"] + 1) * m["new_tokens"] * per_tok
            total += ("decode_cached" in meas) * (cfg["repeats"] + 1) * m["new_tokens"] * per_tok / 2
            if job["impl"] in cfg["decode_paired"]["impls"]:  # compiled pairs: two warm-up pairs, the twin compiles
                pairs = 2 * (GRID_TRAIN_PAIRS + 2)
                total += ("train_step_paired" in meas) * (pairs * 3 * fwd + STARTUP_S)
                total += ("infer_step_paired" in meas) * (pairs * fwd + STARTUP_S / 2)
            if "decode_paired" in meas and job["impl"] in cfg["decode_paired"]["impls"]:  # the LoRA twin: ~1/3
                pairs = cfg["decode_paired"]["pairs"] + 1
                total += STARTUP_S / 2 + pairs * m["new_tokens"] * per_tok * (1 + 1 / 3)
    if "fidelity" in job["tasks"]:
        total += 3 * (STARTUP_S / 2)
    if "convergence" in job["tasks"]:
        total += len(cfg["convergence"]["seeds"]) * cfg["convergence"]["steps"] * 0.03
    if "profile" in job["tasks"]:
        total += 30
    return total


# A grid point's steps are short, and at small batch x seq launch-bound: a step takes the longer of its GPU time
# (FLOPs at EFFECTIVE_FLOPS; a decode step reads every weight) and its host time, per decoder layer a fixed part
# plus one per adapted module (H200: the 8-layer Llama-8B training step issues in ~100 ms with LoRA, ~110 ms with
# our DoRA; an inference forward ~2.9 ms per layer; KV-cached decode ~1.7 ms per layer and token).
HOST_S = {  # measure: (per layer, per adapted module by kind of implementation)
    "train": (3.0e-3, {"lora": 1.2e-3, "ours": 1.5e-3, "upstream": 2.5e-3}),
    "infer": (0.8e-3, {"lora": 0.3e-3, "ours": 0.35e-3, "upstream": 0.8e-3}),
    "decode": (0.6e-3, {"lora": 0.15e-3, "ours": 0.2e-3, "upstream": 0.7e-3}),
}
HBM_BYTES_PER_S = 3e12
POINT_SETUP_S = 1.5  # wrap, seed, unload and release the adapters; gradient proofs
TRITON_COMPILE_S = 25.0  # our first grid process of a shape compiles the fused kernels (H200: 117 s vs 89 s later)


def job_points(cfg: dict, job: dict) -> list:
    return [p for p in cfg["grid"]["points"] if p["mode"] in job["modes"]]


def point_cost_s(cfg: dict, point: dict, impl: str) -> float:
    """Seconds ``impl`` spends on one grid point: warm-ups and repeats of each of its measures, and the setup."""
    ck = cfg["grid"]["models"][point["shape"]]["config_kwargs"]
    kind = "upstream" if impl == "upstream" else "ours" if IMPLS[impl]["dora"] else "lora"
    flops, dense = forward_flops(ck, point["batch"], point["seq"], point["rank"], point["modules"], kind == "upstream")

    def step(measure: str, gpu_s: float) -> float:
        per_layer, per_module = HOST_S[measure]
        return max(gpu_s, ck["num_hidden_layers"] * (per_layer + len(point["modules"]) * per_module[kind]))

    train = step("train", (4 * flops + 2 * dense) / EFFECTIVE_FLOPS)  # forward, checkpoint recompute, backward
    infer = step("infer", (flops + dense) / EFFECTIVE_FLOPS)
    decode = step("decode", 2 * weights(ck) / HBM_BYTES_PER_S)
    measures, reps = grid_measures(cfg, impl), cfg["warmup"] + cfg["repeats"]
    total = POINT_SETUP_S + reps * train * ("train" in measures)
    if "train_accum4" in measures and point["accum4"]:
        total += (max(1, cfg["warmup"] - 1) + cfg["repeats"]) * 4 * train
    if "infer" in measures:
        total += reps * infer
    if "train_step_paired" in measures:  # two warm-up pairs, then the pairs
        total += (cfg["grid"]["train_pairs"] + 2) * 2 * train
    sides = 3 if cfg["grid"].get("cached") else 2  # DoRA, LoRA (and DoRA under DoraCaching)
    if "infer_step_paired" in measures:  # two warm-up rounds, then the pairs
        total += (cfg["grid"]["train_pairs"] + 2) * sides * infer
    if "decode_step_paired" in measures:  # a warm-up round, then the pairs: each side prefills, then steps
        decode_cfg = cfg["grid"]["decode"]
        total += (decode_cfg["pairs"] + 1) * sides * (infer + decode_cfg["steps"] * decode)
    return total


CALL_BUDGET_S = 8 * 60  # the work one device call plans for (with --deadline-min 8.5 it starts no job after that)


def grid_cost_s(cfg: dict, shapes: list, modes: list) -> float:
    """Estimated seconds of the grid run restricted to ``shapes`` and ``modes``: every job's start and its points."""
    points = [p for p in cfg["grid"]["points"] if p["shape"] in shapes and p["mode"] in modes]
    sub = dict(cfg, grid=dict(cfg["grid"], points=points))
    return sum(estimate_s(sub, j) for j in plan_jobs(sub))


def plan_calls(cfg: dict, budget_s: float = CALL_BUDGET_S) -> list:
    """The grid split into device calls of at most ``budget_s`` each: whole shapes (a shape over the budget alone:
    one call per precision mode), largest first, each into the call it leaves shortest, or a new one. Each call:
    shapes, modes (None: all) and estimated seconds."""
    modes = cfg["modes"]
    items = []
    for shape in cfg["grid"]["models"]:
        whole = grid_cost_s(cfg, [shape], modes) <= budget_s or len(modes) == 1
        items += [([shape], None)] if whole else [([shape], [m]) for m in modes]
    calls: list = []
    for shapes, only in sorted(items, key=lambda it: -grid_cost_s(cfg, it[0], it[1] or modes)):
        joined = [(grid_cost_s(cfg, c["shapes"] + shapes, only or modes), c) for c in calls if c["modes"] == only]
        fits = [(cost, c) for cost, c in joined if cost <= budget_s]
        if fits:
            cost, call = min(fits, key=lambda f: f[0])
            call.update(shapes=call["shapes"] + shapes, s=cost)
        else:
            calls.append({"shapes": list(shapes), "modes": only, "s": grid_cost_s(cfg, shapes, only or modes)})
    return calls


def call_command(grid: str, call: dict, k: int) -> str:
    """The device command of call ``k`` (1-based) of :func:`plan_calls`."""
    modes = f" --modes {','.join(call['modes'])}" if call["modes"] else ""
    return (
        f"PYTHONUNBUFFERED=1 python3 benchmarks/bench_model.py --grid {grid} --grid-shapes {','.join(call['shapes'])}"
        f"{modes} --out-dir $OUT --out model_grid_{k}.json --deadline-min 8.5 2>&1 | tee $OUT/log_grid_{k}.txt"
    )


def run_job(job: dict, cfg: dict, targets: dict, workdir: Path, timeout: float | None) -> dict:
    """Run one worker subprocess and return what it wrote (or the failure)."""
    name = job["impl"]
    impl = dict(IMPLS[name], name=name, target=str(targets[IMPLS[name]["wheel"]]))
    tag = f"{name}_{'grid' if 'grid' in cfg else '-'.join(job['tasks'])}_{'-'.join(job['modes'])}" + (
        f"_r{job['round']}" if job.get("round") else ""
    )
    spec = {
        "impl": impl,
        "model": cfg["model"],
        "device": cfg["device"],
        "tasks": job["tasks"],
        "modes": job["modes"],
        "ranks": cfg["ranks"],
        "measures": cfg["measures"],
        "repeats": cfg["repeats"],
        "warmup": cfg["warmup"],
        "compile": cfg.get("compile"),
        "decode_paired": cfg["decode_paired"],
        "fidelity": cfg["fidelity"],
        "convergence": cfg["convergence"],
        "profile": cfg["profile"],
        "workdir": str(workdir),
        "result": str(workdir / f"result_{tag}.json"),
    }
    if "grid" in cfg:
        grid = cfg["grid"]
        spec["measures"] = grid_measures(cfg, name)
        points = job_points(cfg, job)
        models = {s: m for s, m in grid["models"].items() if any(p["shape"] == s for p in points)}
        spec["grid"] = dict(models=models, points=points, decode=grid["decode"], train_pairs=grid["train_pairs"],
                            cached=grid.get("cached", False))  # fmt: skip
    spec_path = workdir / f"spec_{tag}.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    Path(spec["result"]).unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PEFT_DORA_")}
    env["PYTHONPATH"] = os.pathsep.join([impl["target"]] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env["PYTHONUNBUFFERED"] = "1"
    env.update(impl["env"])
    t0 = time.perf_counter()
    print(f"--- {tag}: starting", flush=True)
    try:
        proc = subprocess.run([sys.executable, str(WORKER), str(spec_path)], env=env, timeout=timeout, cwd=HERE)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    result_path = Path(spec["result"])
    result = json.loads(result_path.read_text()) if result_path.exists() else {"impl": name, "errors": []}
    if rc != 0 and not result["errors"]:
        result["errors"].append({"task": ",".join(job["tasks"]), "error": f"worker exit status {rc}"})
    for e in result["errors"]:
        e.update(impl=name, modes=job["modes"])
    print(f"--- {tag}: done in {time.perf_counter() - t0:.0f} s (exit {rc})", flush=True)
    return result


# ---------------------------------------------------------------------------------------------------------------
# Analysis: fidelity and convergence metrics, headline.
# ---------------------------------------------------------------------------------------------------------------


def _cos(a, b) -> float:
    import torch

    a, b = a.double().reshape(-1), b.double().reshape(-1)
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def _maxabs(a, b) -> float:
    return float((a.double() - b.double()).abs().max())


def fidelity_metrics(files: dict) -> dict:
    """Compare the saved logits/gradients: each DoRA implementation vs fp32 (ours eager) and vs upstream."""
    import torch

    data = {key: torch.load(path) for key, path in files.items()}
    ref_key = ("ours_eager", "fp32")
    out = {"reference": "ours_eager fp32 (same weights)", "modes": {}}
    if ref_key not in data:
        return out
    ref = data[ref_key]

    def compare(x, y) -> dict:
        res = {
            "logits_cos": _cos(x["logits"], y["logits"]),
            "logits_maxabs": _maxabs(x["logits"], y["logits"]),
            "loss_absdiff": abs(x["loss"] - y["loss"]),
        }
        for kind in ("lora_A", "lora_B", "magnitude"):
            if x["grads"][kind].numel() and x["grads"][kind].shape == y["grads"][kind].shape:
                res[f"grad_cos_{kind}"] = _cos(x["grads"][kind], y["grads"][kind])
        return res

    if ("upstream", "fp32") in data:
        out["upstream_fp32_vs_reference"] = compare(data[("upstream", "fp32")], ref)
    for mode in MODES:
        per = {}
        for impl in DORA_IMPLS:
            if (impl, mode) not in data:
                continue
            entry = {"vs_fp32": compare(data[(impl, mode)], ref), "loss": data[(impl, mode)]["loss"]}
            if ("upstream", mode) in data and impl != "upstream":
                entry["vs_upstream"] = compare(data[(impl, mode)], data[("upstream", mode)])
            per[impl] = entry
        if "upstream" in per and "ours_fused" in per:
            per["logits_cos_gap_vs_upstream"] = (
                per["upstream"]["vs_fp32"]["logits_cos"] - per["ours_fused"]["vs_fp32"]["logits_cos"]
            )
        if per:
            out["modes"][mode] = per
    return out


def convergence_metrics(losses: dict) -> dict:
    """Per seed: mean and max |Δloss| per step of ours (eager, fused) vs upstream and of eager vs fused."""
    pairs = [("ours_fused", "upstream"), ("ours_eager", "upstream"), ("ours_eager", "ours_fused"),
             ("ours_fused_forced", "upstream"), ("ours_eager", "ours_fused_forced"),
             ("upstream_ulp", "upstream")]  # fmt: skip
    out = {}
    for a, b in pairs:
        if a not in losses or b not in losses:
            continue
        per_seed = {}
        for seed in losses[a]:
            if seed in losses[b]:
                d = [abs(x - y) for x, y in zip(losses[a][seed], losses[b][seed])]
                per_seed[seed] = {"mean_abs_dloss": sum(d) / len(d), "max_abs_dloss": max(d)}
        if per_seed:
            out[f"{a}_vs_{b}"] = {
                "per_seed": per_seed,
                "mean_abs_dloss": sum(v["mean_abs_dloss"] for v in per_seed.values()) / len(per_seed),
                "max_abs_dloss": max(v["max_abs_dloss"] for v in per_seed.values()),
            }
    for impl, runs in losses.items():
        out.setdefault("final_loss", {})[impl] = {s: v[-1] for s, v in runs.items()}
    return out


ROUND_KEYS = ("median_ms", "min_ms", "max_ms", "peak_delta_mb", "tiers", "grad_proof")


def collapse_rounds(records: list) -> list:
    """One record per (impl, mode, rank, measure, grid point): a measure taken in several rounds keeps each round's
    figures under ``rounds`` and reports the median of the round medians, the extremes of all samples and the
    largest peak."""
    groups: dict = {}
    for r in records:
        groups.setdefault((r["impl"], r["mode"], r["rank"], r["measure"], r.get("point")), []).append(r)
    out = []
    for recs in groups.values():
        if len(recs) == 1:
            out.append(recs[0])
            continue
        recs = sorted(recs, key=lambda r: r.get("round", 0))
        merged = {k: v for k, v in recs[0].items() if k not in ("round", "samples_ms")}
        merged["rounds"] = [{"round": r.get("round", 0), **{k: r.get(k) for k in ROUND_KEYS}} for r in recs]
        merged["median_ms"] = statistics.median(r["median_ms"] for r in recs)
        merged["min_ms"] = min(r["min_ms"] for r in recs)
        merged["max_ms"] = max(r["max_ms"] for r in recs)
        peaks = [r["peak_delta_mb"] for r in recs if r.get("peak_delta_mb") is not None]
        merged["peak_delta_mb"] = max(peaks) if peaks else None
        if all("pair_ratios" in r for r in recs):  # decode_paired: every pair of every round counts once
            for x, r in zip(merged["rounds"], recs):
                x.update(lora_median_ms=r["lora_median_ms"], ratio_median=r["ratio_median"])
            merged["pair_ratios"] = [q for r in recs for q in r["pair_ratios"]]
            merged["ratio_median"] = statistics.median(merged["pair_ratios"])
            merged["lora_median_ms"] = statistics.median(r["lora_median_ms"] for r in recs)
            merged.pop("lora_samples_ms", None)
            for side in [k[: -len("_samples_ms")] for k in merged if k.endswith("_samples_ms")]:  # a third side
                merged.pop(f"{side}_samples_ms")  # as LoRA's: the median of the rounds' medians, every pair's ratio
                merged[f"{side}_median_ms"] = statistics.median(r[f"{side}_median_ms"] for r in recs)
                for key in (f"{side}_ratios", f"{side}_over_dora_ratios"):
                    merged[key] = [q for r in recs for q in r[key]]
                    merged[key[:-1] + "_median"] = statistics.median(merged[key])
        out.append(merged)
    return out


def _record(doc: dict, impl: str, mode: str, measure: str, rank: int, point: str | None = None):
    """The speed record of (impl, mode, measure, rank) and, in a grid, of the point with that label."""
    for r in doc.get("speed", []):
        if (r["impl"], r["mode"], r["measure"], r["rank"], r.get("point")) == (impl, mode, measure, rank, point):
            return r
    return None


def speed_value(doc: dict, impl: str, mode: str, measure: str, rank: int, key: str = "median_ms", point=None):
    r = _record(doc, impl, mode, measure, rank, point)
    return None if r is None else r.get(key)


def paired_ratio(doc: dict, mode: str, measure: str, rank: int, point: str | None = None, impl: str = "ours_fused"):
    """``impl`` (ours fused) / its LoRA twin from a paired record (the median of every pair's ratio); None where the
    record is missing or failed its gradient proof."""
    record = _record(doc, impl, mode, measure, rank, point)
    return None if record is None or not proof_ok(record) else record.get("ratio_median")


def proof_ok(record: dict) -> bool:
    """Whether a training record proved that every round trained (:class:`model_worker.GradProof`). A grid record
    must carry the proof; a record of an older run without one passes."""
    if record["measure"] not in TRAIN_MEASURES + ("train_step_paired",):
        return True
    proofs = [x.get("grad_proof") for x in record.get("rounds") or [record]]
    return all((p or {}).get("ok", "point" not in record) for p in proofs)


def proof_failures(doc: dict) -> list:
    """One line per training record that failed its gradient proof (or, in a grid, lacks it)."""
    out = []
    for r in doc.get("speed", []):
        if not proof_ok(r):
            bad = [x.get("grad_proof") or {} for x in r.get("rounds") or [r]]
            names = sorted({n for p in bad for n in p.get("bad_names", [])})
            where = r.get("point") or f"{r['mode']} r={r['rank']}"
            failed = f"gradient proof failed (bad tensors: {names or 'no proof'})"
            out.append(f"{r['impl']} {where} {r['measure']}: {failed}")
    return out


def round_ratios(doc: dict, num: str, den: str, mode: str, measure: str, rank: int, point=None) -> list:
    """``num``'s time over ``den``'s in each round both ran in (each pair measured close together in time), or []
    where they share fewer than two rounds."""
    a, b = _record(doc, num, mode, measure, rank, point), _record(doc, den, mode, measure, rank, point)
    if a is None or b is None:
        return []
    ra = {x["round"]: x["median_ms"] for x in a.get("rounds", [])}
    rb = {x["round"]: x["median_ms"] for x in b.get("rounds", [])}
    common = sorted(set(ra) & set(rb))
    return [ra[k] / rb[k] for k in common] if len(common) > 1 else []


def time_ratio(doc: dict, num: str, den: str, mode: str, measure: str, rank: int, point=None):
    """``num``'s time over ``den``'s: the median of the per-round ratios (:func:`round_ratios`) where both ran in the
    same rounds, else the ratio of the medians; None where a record is missing or failed its gradient proof."""
    a, b = _record(doc, num, mode, measure, rank, point), _record(doc, den, mode, measure, rank, point)
    if a is None or b is None or not a.get("median_ms") or not b.get("median_ms"):
        return None
    if not (proof_ok(a) and proof_ok(b)):
        return None
    ratios = round_ratios(doc, num, den, mode, measure, rank, point)
    if ratios:
        return round(statistics.median(ratios), 4)
    return round(a["median_ms"] / b["median_ms"], 4)


def compiled_headline_values(doc: dict) -> dict:
    """The compiled_* headline keys of a ``--compile`` run, worst cases over its modes and ranks (ours = fused):
    DoRA/LoRA train and infer (largest; from the pairs with a compiled LoRA twin where the run took them, the
    separately timed processes' ratios in ``_separate``), train speed-up over upstream (smallest), and the graphs
    compiled while ours was timed, after warm-up and in the timed pairs, summed over every record and round (must
    be 0)."""
    cfg = doc["config"]
    points = [(mode, rank) for mode in cfg["modes"] for rank in cfg["ranks"]]

    def worst(pick, num, den, measure):
        values = [time_ratio(doc, num, den, mode, measure, rank) for mode, rank in points]
        values = [x for x in values if x is not None]
        return pick(values) if len(values) == len(points) else None  # a point that did not run: no worst case

    def worst_paired(measure):  # DoRA/LoRA from the pairs with a compiled LoRA twin; None if a point lacks them
        values = [paired_ratio(doc, mode, measure, rank) for mode, rank in points]
        return round(max(values), 4) if values and None not in values else None

    recompiles = None
    ours = [r for r in doc.get("speed", []) if r["impl"] == "ours_fused"]
    if ours:
        recompiles = sum((x.get("tiers") or {}).get("compiled_graphs", 0) for r in ours for x in r.get("rounds") or [r])
    taken = {r["measure"] for r in ours}
    train, infer = (
        (worst_paired(m) if m in taken else worst(max, "ours_fused", "lora", plain))
        for m, plain in (("train_step_paired", "train"), ("infer_step_paired", "infer"))
    )
    return {
        "compiled_dora_over_lora_train": train,
        "compiled_dora_over_lora_infer": infer,
        "compiled_dora_over_lora_train_separate": worst(max, "ours_fused", "lora", "train"),
        "compiled_dora_over_lora_infer_separate": worst(max, "ours_fused", "lora", "infer"),
        "compiled_train_speedup_vs_upstream": worst(min, "upstream", "ours_fused", "train"),
        "compiled_infer_speedup_vs_upstream": worst(min, "upstream", "ours_fused", "infer"),
        "compiled_recompiles_after_warmup": recompiles,
        "compiled_mode": cfg["compile"],
        "compiled_points": len(points),
        "compiled_gpu": (doc.get("env") or {}).get("gpu"),
    }


def compiled_headline_over_runs(named_docs: list) -> dict:
    """The compiled_* headline keys as the worst case over several ``--compile`` runs (``(file name, doc)`` pairs,
    e.g. long sequences on one GPU and short ones on another): each ratio key the largest over the runs (speed-ups
    the smallest), with ``<key>_at`` naming the file it came from; recompiles and points summed; a key any run could
    not give is None (no worst case). The GPUs are named per file."""
    values = [(name, compiled_headline_values(doc)) for name, doc in named_docs]
    out: dict = {}
    for key, pick in (
        ("compiled_dora_over_lora_train", max),
        ("compiled_dora_over_lora_infer", max),
        ("compiled_dora_over_lora_train_separate", max),
        ("compiled_dora_over_lora_infer_separate", max),
        ("compiled_train_speedup_vs_upstream", min),
        ("compiled_infer_speedup_vs_upstream", min),
    ):
        got = [(v[key], name) for name, v in values]
        if any(x is None for x, _ in got):
            out[key] = out[f"{key}_at"] = None
            continue
        out[key], out[f"{key}_at"] = pick(got)
    recompiles = [v["compiled_recompiles_after_warmup"] for _, v in values]
    out["compiled_recompiles_after_warmup"] = None if None in recompiles else sum(recompiles)
    out["compiled_mode"] = ", ".join(sorted({v["compiled_mode"] for _, v in values}))
    out["compiled_points"] = sum(v["compiled_points"] for _, v in values)
    out["compiled_gpu"] = "; ".join(f"{v['compiled_gpu']} ({name})" for name, v in values)
    return out


def grid_ratios(doc: dict) -> list:
    """Per point of the run's grid: ours fused / LoRA for each measure the point has (the paired training step and
    decode: the median of every pair's ratio), and upstream / ours fused for the training step (:func:`speedup`);
    None where a record is missing or failed its gradient proof."""
    rows = []
    taken = {r["measure"] for r in doc.get("speed", [])}  # a run before train_step_paired existed has none
    for p in doc["config"]["grid"]["points"]:
        at = dict(mode=p["mode"], rank=p["rank"], point=p["label"])
        ratios = {}
        for measure in GRID_RATIOS:
            if measure not in taken or (measure == "train_accum4" and not p["accum4"]):
                continue
            if measure in PAIRED:
                paired = paired_ratio(doc, at["mode"], measure, at["rank"], at["point"])
                ratios[measure] = None if paired is None else round(paired, 4)
            else:
                ratios[measure] = time_ratio(doc, "ours_fused", "lora", measure=measure, **at)
        rows.append({"point": p, "dora_over_lora": ratios, "speedup_vs_upstream_train": speedup(doc, at)})
    return rows


def speedup(doc: dict, at: dict):
    """Upstream's training step over ours at a grid point: where both timed it paired with a LoRA twin in their own
    process, the ratio of those DoRA/LoRA ratios (upstream's over ours); in a run before upstream's paired step, the
    separately timed steps' ratio."""
    up = paired_ratio(doc, measure="train_step_paired", impl="upstream", **at)
    if up is not None or _record(doc, "upstream", measure="train_step_paired", **at) is not None:
        ours = paired_ratio(doc, measure="train_step_paired", **at)
        return None if up is None or not ours else round(up / ours, 4)
    return time_ratio(doc, "upstream", "ours_fused", measure="train", **at)


GRID_WORST = (  # headline key, modes, measures: the largest ours fused / LoRA over those points
    ("grid_worst_dora_over_lora_train", ("autocast",), TRAIN_MEASURES),
    ("grid_worst_dora_over_lora_train_bf16", ("bf16",), TRAIN_MEASURES),
    ("grid_worst_dora_over_lora_infer", ("autocast",), ("infer_step_paired",)),
    ("grid_worst_dora_over_lora_infer_bf16", ("bf16",), ("infer_step_paired",)),
    ("grid_worst_dora_over_lora_decode", MODES, ("decode_step_paired",)),
    ("grid_worst_dora_over_lora_train_paired", ("autocast",), ("train_step_paired",)),
    ("grid_worst_dora_over_lora_train_paired_bf16", ("bf16",), ("train_step_paired",)),
    ("grid_worst_dora_over_lora_train_mixed", ("mixed",), TRAIN_MEASURES),
    ("grid_worst_dora_over_lora_infer_mixed", ("mixed",), ("infer_step_paired",)),
    ("grid_worst_dora_over_lora_decode_mixed", ("mixed",), ("decode_step_paired",)),
    ("grid_worst_dora_over_lora_train_paired_mixed", ("mixed",), ("train_step_paired",)),
)
# what a --grid mixed run writes to the headline: its own keys only, so that it leaves the default grid's alone
MIXED_GRID_KEYS = {
    "grid_points": "grid_mixed_points",
    "grid_median_dora_over_lora_train_paired": "grid_mixed_median_dora_over_lora_train_paired",
    "grid_worst_speedup_vs_upstream_train": "grid_mixed_worst_speedup_vs_upstream_train",
    "grid_worst_speedup_vs_upstream_train_at": "grid_mixed_worst_speedup_vs_upstream_train_at",
    "grid_gpu": "grid_mixed_gpu",
}


def grid_headline_values(doc: dict) -> dict:
    """The grid's headline: the worst point per measure and mode (its label in ``<key>_at``; inference from the
    forward paired with a LoRA twin, or the separately timed one in a run without it), the median training ratio over
    every point and mode, the smallest training speed-up over upstream, and ``grid_points``: the points
    whose every ratio was measured and proved (any other point is missing from all of them)."""
    rows = grid_ratios(doc)

    def where(row, measure):
        return row["point"]["label"] + (" accum4" if measure == "train_accum4" else "")

    out = {"grid_points": sum(all(v is not None for v in r["dora_over_lora"].values()) for r in rows)}
    taken = {m for r in rows for m in r["dora_over_lora"]}
    for key, modes, measures in GRID_WORST:
        if measures == ("infer_step_paired",) and "infer_step_paired" not in taken:
            measures = ("infer",)  # a run before the paired forward: the separately timed one
        found = [
            (r["dora_over_lora"][m], where(r, m))
            for r in rows
            if r["point"]["mode"] in modes
            for m in measures
            if r["dora_over_lora"].get(m) is not None
        ]
        out[key], out[key + "_at"] = max(found) if found else (None, None)
    train = [r["dora_over_lora"][m] for r in rows for m in TRAIN_MEASURES if r["dora_over_lora"].get(m) is not None]
    out["grid_median_dora_over_lora_train"] = round(statistics.median(train), 4) if train else None
    paired = [r["dora_over_lora"]["train_step_paired"] for r in rows if r["dora_over_lora"].get("train_step_paired")]
    if "train_step_paired" in taken:  # a run before the paired step has no such key
        out["grid_median_dora_over_lora_train_paired"] = round(statistics.median(paired), 4) if paired else None
    speedups = [(r["speedup_vs_upstream_train"], where(r, "train")) for r in rows if r["speedup_vs_upstream_train"]]
    key = "grid_worst_speedup_vs_upstream_train"
    out[key], out[key + "_at"] = min(speedups) if speedups else (None, None)
    for measure, name in (("infer_step_paired", "infer"), ("decode_step_paired", "decode")):
        # DoraCaching on over off, same adapter and round (issue 20, item 5: never above 1 beyond noise)
        cached = [
            (round(r["cached_over_dora_ratio_median"], 4), r["point"])
            for r in doc.get("speed", [])
            if r["impl"] == "ours_fused" and r["measure"] == measure and "cached_over_dora_ratio_median" in r
        ]
        if cached:
            key = f"grid_worst_cached_over_uncached_{name}"
            out[key], out[key + "_at"] = max(cached)
    out["grid_gpu"] = (doc.get("env") or {}).get("gpu")
    if doc["config"]["grid"].get("name") == "mixed":
        return {MIXED_GRID_KEYS.get(k, k): v for k, v in out.items() if k in MIXED_GRID_KEYS or "_mixed" in k}
    return {k: v for k, v in out.items() if "_mixed" not in k}


def headline_values(doc: dict) -> dict:
    """The flat headline keys, computed from the JSON at its headline rank (ours = fused); for a ``--compile`` run
    only the compiled_* keys (:func:`compiled_headline_values`), for a grid only the grid_* keys
    (:func:`grid_headline_values`), so no kind of run drops another's keys."""
    if doc["config"].get("grid"):
        return grid_headline_values(doc)
    if doc["config"].get("compile"):
        return compiled_headline_values(doc)
    rank = doc["config"]["headline_rank"]
    v = lambda impl, mode, measure, key="median_ms": speed_value(doc, impl, mode, measure, rank, key)  # noqa: E731
    ratio = lambda num, den, mode, measure: time_ratio(doc, num, den, mode, measure, rank)  # noqa: E731

    out = {}
    for mode in MODES:
        for measure in ("train", "infer"):
            out[f"{measure}_speedup_vs_upstream_{mode}"] = ratio("upstream", "ours_fused", mode, measure)
            out[f"dora_over_lora_{measure}_{mode}"] = ratio("ours_fused", "lora", mode, measure)
    out["decode_speedup_vs_upstream"] = ratio("upstream", "ours_fused", "autocast", "decode_per_token")
    out["decode_speedup_vs_upstream_bf16"] = ratio("upstream", "ours_fused", "bf16", "decode_per_token")
    for key, impl in (("ours", "ours_fused"), ("upstream", "upstream"), ("lora", "lora")):
        peak = v(impl, "autocast", "train", "peak_delta_mb")
        out[f"peak_delta_mb_{key}_autocast"] = None if peak is None else round(peak, 1)
    for impl, suffix in (("ours_fused", ""), ("ours_fused_reuse", "_norm_cache")):
        calls = v(impl, "autocast", "step_accum4", "norm_calls_per_optimizer_step")
        out["norm_calls_per_optimizer_step" + suffix] = calls
        out["dora_over_lora_decode" + suffix] = ratio(impl, "lora", "autocast", "decode_per_token")
    out["dora_over_lora_decode_bf16"] = ratio("ours_fused", "lora", "bf16", "decode_per_token")
    for mode, suffix in (("autocast", ""), ("bf16", "_bf16")):  # DoRA and its LoRA twin in one process, ABBA
        paired = v("ours_fused", mode, "decode_per_token_paired", "ratio_median")
        out["dora_over_lora_decode_paired" + suffix] = None if paired is None else round(paired, 4)
    for measure in ("train", "infer"):
        out[f"dora_over_lora_{measure}_autocast_norm_cache"] = ratio("ours_fused_reuse", "lora", "autocast", measure)
    peak_ours, peak_lora = (
        v("ours_fused", "autocast", "train", "peak_delta_mb"),
        v("lora", "autocast", "train", "peak_delta_mb"),
    )
    if peak_ours and peak_lora:
        out["peak_delta_over_lora_pct_autocast"] = round(100 * (peak_ours / peak_lora - 1), 2)
    modes = doc.get("fidelity", {}).get("metrics", {}).get("modes", {})
    out["logits_cos_gap_vs_upstream"] = modes.get("autocast", {}).get("logits_cos_gap_vs_upstream")
    out["logits_cos_gap_vs_upstream_bf16"] = modes.get("bf16", {}).get("logits_cos_gap_vs_upstream")
    conv = doc.get("convergence", {}).get("metrics", {})
    out["convergence_mean_abs_dloss"] = conv.get("ours_fused_vs_upstream", {}).get("mean_abs_dloss")
    out["convergence_noise_floor_mean_abs_dloss"] = conv.get("upstream_ulp_vs_upstream", {}).get("mean_abs_dloss")
    out["gpu"] = doc["env"].get("gpu")
    out["date"] = doc["env"].get("date")
    out["headline_rank"] = rank
    return out


def update_headline(doc: dict, path: Path) -> dict:
    """:func:`write_headline` of this run's :func:`headline_values`; points whose gradient proof failed are named."""
    for line in proof_failures(doc):
        print(f"ERROR {line}: left out of the headline", file=sys.stderr)
    return write_headline(doc.get("kind"), headline_values(doc), path)


def write_headline(kind: str, values: dict, path: Path) -> dict:
    """Read-modify-write ``path``: set the keys computed (not None), drop those the run could have measured but did
    not (None: no older run's value stays, nor its ``<key>_at``), keep every other key (added by hand); returns the
    keys set. Only a GPU run (``kind``) writes outside a ``cpu_smoke`` folder."""
    if kind != "gpu" and "cpu_smoke" not in path.parts:
        raise SystemExit(f"refusing to write {kind} numbers into {path}: CPU runs write under results/cpu_smoke/")
    current = json.loads(path.read_text()) if path.exists() else {}
    new = {k: v for k, v in values.items() if v is not None}
    for k, v in values.items():
        if v is None:
            current.pop(k, None)
            if not k.endswith("_at") and values.get(k + "_at") is None:
                current.pop(k + "_at", None)  # where an older run measured it: gone with the value
    current.update(new)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(current, indent=2, sort_keys=True) + "\n")
    return new


# ---------------------------------------------------------------------------------------------------------------
# The run document: environment, assembly, merge.
# ---------------------------------------------------------------------------------------------------------------


def environment(device: str, worker_env: dict) -> dict:
    env = {
        "date": datetime.date.today().isoformat(),
        "python": platform.python_version(),
        "device": device,
    }
    if device.startswith("cuda"):
        try:
            q = (
                subprocess.run(
                    ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                .stdout.strip()
                .splitlines()[0]
            )
            env["gpu"], env["driver"] = [x.strip() for x in q.split(",")]
        except (OSError, subprocess.CalledProcessError, IndexError):
            pass
    else:
        env["gpu"] = f"none (CPU: {platform.processor() or platform.machine()})"
    for name in ("torch", "triton", "transformers"):
        try:
            env[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            env[name] = None
    env.update({k: v for k, v in worker_env.items() if v is not None})
    return env


def new_doc(cfg: dict, argv: list) -> dict:
    return {
        "schema": SCHEMA,
        "kind": "gpu" if cfg["device"].startswith("cuda") else "cpu_smoke",
        "env": {},
        "config": cfg,
        "runs": [{"argv": argv, "started": datetime.datetime.now().isoformat(timespec="seconds")}],
        "impls": {},
        "speed": [],
        "fidelity": {},
        "convergence": {"config": cfg["convergence"], "losses": {}},
        "profile": {},
        "errors": [],
        "skipped": [],
    }


def absorb(doc: dict, result: dict, fidelity_files: dict) -> None:
    name = result["impl"]
    if "info" in result:
        doc["impls"][name] = {k: v for k, v in result["info"].items() if k != "env"}
        doc["env"].update(result["info"].get("env", {}))
    doc["speed"].extend(result.get("speed", []))
    for mode, path in result.get("fidelity", {}).items():
        fidelity_files[(name, mode)] = path
    if "convergence" in result:
        doc["convergence"]["losses"][name] = result["convergence"]["losses"]
        doc["convergence"].setdefault("tiers", {})[name] = result["convergence"]["tiers"]
    if "profile" in result:
        doc["profile"][name] = result["profile"]
    doc["errors"].extend(result.get("errors", []))


def _merge_key(record: dict) -> tuple:
    return record["mode"], record["rank"], "pair_ratios" in record, record.get("point")


def merge_docs(docs: list) -> dict:
    """Later documents win per (mode, rank) of speed records (in a grid: per point) and per fidelity/profile/convergence
    entry; the grids of grid runs (one per device call) join."""
    out = json.loads(json.dumps(docs[0]))
    for d in docs[1:]:
        if d["kind"] != out["kind"]:
            raise SystemExit(f"cannot merge a {d['kind']} run into a {out['kind']} run")
        if ("grid" in d["config"]) != ("grid" in out["config"]):
            raise SystemExit("cannot merge a grid run with a run that is not one")
        if "grid" in d["config"]:
            grid, labels = out["config"]["grid"], {p["label"] for p in out["config"]["grid"]["points"]}
            grid["models"].update(d["config"]["grid"]["models"])
            grid["points"] += [p for p in d["config"]["grid"]["points"] if p["label"] not in labels]
        if d["env"].get("gpu") != out["env"].get("gpu"):
            print(f"warning: merging runs on different GPUs: {out['env'].get('gpu')} / {d['env'].get('gpu')}")
        out["env"].update(d["env"])
        out["runs"].extend(d["runs"])
        out["impls"].update(d["impls"])
        # a later run replaces every speed record of each (mode, rank) it measured, so that a mode's and rank's rows
        # always come from one run (an implementation it left out is not filled in from an older revision); a paired
        # decode record carries its own LoRA twin, so paired and unpaired rows are replaced separately
        keys = {_merge_key(r) for r in d["speed"]}
        out["speed"] = [r for r in out["speed"] if _merge_key(r) not in keys]
        out["speed"].extend(d["speed"])
        if d["fidelity"].get("metrics", {}).get("modes"):
            out["fidelity"] = d["fidelity"]
        if d["convergence"]["losses"]:  # losses of different configurations do not mix: the later run's set wins
            conv = d["convergence"]
            out["convergence"] = {k: conv[k] for k in ("config", "losses", "tiers") if k in conv}
        out["profile"].update(d["profile"])
        out["errors"].extend(d["errors"])
        out["skipped"].extend(d["skipped"])
        cfg = out["config"]
        cfg["ranks"] = sorted(set(cfg["ranks"]) | set(d["config"]["ranks"]))
        for key in ("impls", "modes", "measures", "tasks"):
            cfg[key] += [x for x in d["config"][key] if x not in cfg[key]]
    out["convergence"]["metrics"] = convergence_metrics(out["convergence"]["losses"])
    out["speed"].sort(
        key=lambda r: (r.get("point", ""), r["mode"], r["rank"], r["measure"], list(IMPLS).index(r["impl"]))
    )
    return out


def scrub(text: str, places: dict) -> str:
    """Replace machine paths (install targets, work dir, repo, site-packages) by placeholders."""
    import re

    for label, place in places.items():
        text = text.replace(str(place), f"<{label}>")
    return re.sub(r"/[^\s\"']*/(site|dist)-packages/", "<site-packages>/", text)


def scrub_argv(doc: dict) -> dict:
    """``doc`` with every absolute path in its runs' command lines (a ``--workdir`` the places of :func:`scrub` do not
    name) cut to ``<abs>/`` and its last part: a committed JSON names no machine's folders."""
    for run in doc.get("runs") or []:
        if isinstance(run, dict) and isinstance(run.get("argv"), list):
            argv = run["argv"]
            run["argv"] = [f"<abs>/{Path(a).name}" if isinstance(a, str) and a.startswith("/") else a for a in argv]
    return doc


def write_doc(doc: dict, path: Path) -> None:
    doc = scrub_argv(doc)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)


SUMMARY_MEASURES = ("train", "train_accum4", "step_accum4", "infer", "decode_per_token", "decode_per_token_cached")


def _fmt(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def print_grid(doc: dict) -> None:
    print(f"\n== {doc['kind']} grid on {doc['env'].get('gpu')}: ours fused / LoRA per point (x: upstream / ours) ==")
    for row in grid_ratios(doc):
        names = {
            "train_step_paired": "train(paired)",
            "infer_step_paired": "infer(paired)",
            "decode_step_paired": "decode",
        }
        cells = "  ".join(f"{names.get(m, m)} {_fmt(v)}" for m, v in row["dora_over_lora"].items())
        print(f"{row['point']['label']:44s} {cells}  x{_fmt(row['speedup_vs_upstream_train'], '.2f')}")
    print("headline (worst over the grid): " + json.dumps(grid_headline_values(doc)))


def print_summary(doc: dict) -> None:
    if "grid" in doc["config"]:
        print_grid(doc)
    else:
        print_rank_tables(doc)
    for e in doc["errors"]:
        print(f"ERROR {e.get('impl')} {e.get('modes')} {e['task']}: {e['error'].strip().splitlines()[-1]}")
    for s in doc["skipped"]:
        print(f"SKIPPED {s}")
    for w in doc.get("warnings", []):
        print(f"WARNING {w}")


def print_rank_tables(doc: dict) -> None:
    rank = doc["config"]["headline_rank"]
    print(f"\n== {doc['kind']} on {doc['env'].get('gpu')}: median ms (peak delta MB) ==")
    for mode in doc["config"]["modes"]:
        for r in sorted({r["rank"] for r in doc["speed"]}):
            for impl in IMPLS:
                cells = []
                for m in SUMMARY_MEASURES:
                    t = speed_value(doc, impl, mode, m, r)
                    p = speed_value(doc, impl, mode, m, r, "peak_delta_mb")
                    if t is not None:
                        cells.append(f"{m} {t:9.2f}" + (f" ({p:7.0f})" if p is not None else ""))
                if cells:
                    print(f"{mode:8s} r={r:<4d} {impl:11s} " + "  ".join(cells))
    for r in doc["speed"]:
        if r.get("rounds") and r["measure"] in SUMMARY_MEASURES:
            per = " ".join(f"{x['median_ms']:.2f}" for x in r["rounds"])
            print(f"rounds {r['mode']:8s} r={r['rank']:<4d} {r['impl']:11s} {r['measure']}: {per}")
    for r in doc["speed"]:
        if "pair_ratios" in r:
            per = " ".join(f"{q:.3f}" for q in r["pair_ratios"])
            print(
                f"paired {r['mode']:8s} r={r['rank']:<4d} {r['impl']:11s} {r['measure']} {r['median_ms']:.2f} ms vs "
                f"LoRA {r['lora_median_ms']:.2f}, ratio median {r['ratio_median']:.3f} of: {per}"
            )
    fid = doc.get("fidelity", {}).get("metrics", {}).get("modes", {})
    for mode, per in fid.items():
        print(f"fidelity {mode}: logits_cos_gap_vs_upstream {per.get('logits_cos_gap_vs_upstream')}")
    conv = doc.get("convergence", {}).get("metrics", {})
    for key, val in conv.items():
        if key.endswith("upstream") or key.startswith("ours_eager_vs"):
            print(f"convergence {key}: mean |dloss| {val['mean_abs_dloss']:.3g}, max {val['max_abs_dloss']:.3g}")
    at = "every compiled point" if doc["config"].get("compile") else f"r={rank}"  # compiled keys: worst over points
    print(f"headline ({at}): {json.dumps(headline_values(doc))}")


# ---------------------------------------------------------------------------------------------------------------
# Entry points.
# ---------------------------------------------------------------------------------------------------------------


def tier_warnings(doc: dict) -> list:
    """Flag runs whose dispatch tiers contradict their label (e.g. "fused" that composed only eagerly)."""
    out = []
    for r in doc["speed"]:
        tiers = set(r.get("tiers") or {}) & {"eager", "fused_forward", "fused_backward"}
        where = r.get("point") or f"{r['mode']} r={r['rank']}"
        if r["impl"] == "ours_eager" and tiers - {"eager"}:
            out.append(f"ours_eager {where} {r['measure']} ran tiers {sorted(tiers)}")
        if r["impl"] == "ours_fused" and doc["kind"] == "gpu" and tiers and not tiers - {"eager"}:
            out.append(f"ours_fused {where} {r['measure']} ran only the eager tier")
    return out


def finish(doc: dict, out_path: Path, plots: bool) -> None:
    doc["convergence"]["metrics"] = convergence_metrics(doc["convergence"]["losses"])
    doc["warnings"] = tier_warnings(doc)
    write_doc(doc, out_path)
    if plots:
        import report

        for png in report.plot_all(doc, out_path.parent, out_path.stem):
            print(f"wrote {png}")


def print_grid_plan(cfg: dict) -> None:
    """The grid's points and, on a GPU, its split into device calls with each call's command."""
    points = cfg["grid"]["points"]
    print(f"grid {cfg['grid']['name']}: {len(points)} points (accum4: x4 accumulation too)")
    for p in points:
        print(f"  {p['label']}{' accum4' if p['accum4'] else ''}")
    if not cfg["device"].startswith("cuda"):
        return
    calls = plan_calls(cfg)
    print(f"device calls: {len(calls)} (each with --deadline-min 8.5)")
    for k, call in enumerate(calls, 1):
        modes = ",".join(call["modes"] or cfg["modes"])
        print(f"  call {k}: {','.join(call['shapes'])} {modes} ~{call['s'] / 60:.1f} min")
        print(f"    {call_command(cfg['grid']['name'], call, k)}")


def run(args, argv) -> int:
    cfg = resolve_config(args)
    jobs = plan_jobs(cfg)
    estimates = [estimate_s(cfg, j) for j in jobs]
    if "grid" in cfg:
        print_grid_plan(cfg)
    print(f"plan: {len(jobs)} subprocesses on {cfg['device']}")
    for j, e in zip(jobs, estimates):
        what = ",".join(j["tasks"]) + (f" round {j['round']}" if "round" in j else "")
        print(f"  {j['impl']:11s} {what:28s} {','.join(j['modes']):14s} ~{e / 60:4.1f} min")
    if cfg["device"].startswith("cuda"):
        print(f"estimated total ~{sum(estimates) / 60:.1f} min (rough FLOP/launch model; see estimate_s)")
    if args.dry_run:
        return 0
    if args.device.startswith("cuda") is False and not cfg["tiny"]:
        print("warning: a full-size run off the GPU will take very long")
    out_dir = (
        Path(args.out_dir) if args.out_dir else (RESULTS if cfg["device"].startswith("cuda") else RESULTS / "cpu_smoke")
    )
    name = "grid" if "grid" in cfg else cfg["preset"]
    out_path = out_dir / (args.out or f"model_{name}{'_tiny' if cfg['tiny'] else ''}.json")
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    wheels = {which: find_wheel(getattr(args, f"{which}_wheel"), which) for which in ("ours", "upstream")}
    needed = {IMPLS[j["impl"]]["wheel"] for j in jobs}
    targets = {w: install(wheels[w], Path(args.target_root)) for w in needed}
    places = {"targets": Path(args.target_root).resolve(), "workdir": workdir.resolve(), "repo": REPO}
    doc = new_doc(cfg, [Path(a).name if os.sep in a else a for a in argv])
    doc["env"] = environment(cfg["device"], {})
    doc["wheels"] = {w: wheels[w].name for w in needed}
    fidelity_files, raw_speed = {}, []
    t_start = time.perf_counter()
    deadline = args.deadline_min * 60 if args.deadline_min else None
    for job in jobs:
        elapsed = time.perf_counter() - t_start
        if deadline is not None and elapsed > deadline - 15:
            doc["skipped"].append({k: job[k] for k in ("impl", "tasks", "modes", "round") if k in job})
            continue
        result = run_job(job, cfg, targets, workdir, None if deadline is None else deadline - elapsed)
        for e in result.get("errors", []):
            e["error"] = scrub(e["error"], places)
        for r in result.get("speed", []):
            r["round"] = job.get("round", 0)
        for line in proof_failures({"speed": result.get("speed", [])}):
            print(f"ERROR {line}: this record is left out of every headline", flush=True)
            result["errors"].append({"task": "grad_proof", "impl": job["impl"], "modes": job["modes"], "error": line})
        raw_speed += result.get("speed", [])
        absorb(doc, result, fidelity_files)
        doc["speed"] = collapse_rounds(raw_speed)
        if fidelity_files:
            doc["fidelity"] = {"rank": cfg["fidelity"]["rank"], "metrics": fidelity_metrics(fidelity_files)}
        write_doc(doc, out_path)  # after every job, so a killed call still leaves the finished part
    doc["runs"][-1]["finished"] = datetime.datetime.now().isoformat(timespec="seconds")
    doc["runs"][-1]["wall_s"] = round(time.perf_counter() - t_start, 1)
    finish(doc, out_path, plots=not args.no_plots)
    print_summary(doc)
    print(f"wrote {out_path}")
    if args.headline_path:
        update_headline(doc, Path(args.headline_path))
    return 1 if doc["errors"] else 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.merge:
        if not args.output:
            raise SystemExit("--merge needs -o OUT.json")
        doc = merge_docs([json.loads(Path(p).read_text()) for p in args.merge])
        finish(doc, Path(args.output), plots=not args.no_plots)
        print_summary(doc)
        return 0
    if args.headline:
        docs = [json.loads(Path(p).read_text()) for p in args.headline]
        default = Path(args.headline[0]).resolve().parent / "headline.json"
        path = Path(args.headline_path) if args.headline_path else default
        if len(docs) == 1:
            written = update_headline(docs[0], path)
        elif all(d["config"].get("compile") for d in docs):  # the compiled keys: the worst case over the runs
            for doc in docs:
                for line in proof_failures(doc):
                    print(f"ERROR {line}: left out of the headline", file=sys.stderr)
            named = [(Path(p).name, d) for p, d in zip(args.headline, docs)]
            kinds = {d.get("kind") for d in docs}
            written = write_headline(
                kinds.pop() if len(kinds) == 1 else "mixed", compiled_headline_over_runs(named), path
            )
        else:
            raise SystemExit("--headline takes several JSONs only for --compile runs (their worst case)")
        print(json.dumps(written, indent=2))
        print(f"updated {path}")
        return 0
    return run(args, argv)


if __name__ == "__main__":
    sys.exit(main())
