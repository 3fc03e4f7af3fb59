"""Reports of the benchmark JSONs: markdown tables for ``docs/benchmarks.md`` (``bench_model.py`` results, a grid
run's worst cases, ``bench_kernels.py`` results) and PNG plots of ``bench_model.py`` results (step times, peak
memory, convergence, every round's DoRA/LoRA ratio; for a grid run, heatmaps of ours fused / plain LoRA per measure,
rank x sequence, a panel per shape and precision mode).

    python benchmarks/report.py benchmarks/results/model_llama.json                  # print the table
    python benchmarks/report.py RESULT.json --write docs/benchmarks.md               # replace it in place
    python benchmarks/report.py benchmarks/results/model_llama.json --plots [--out-dir DIR]   # the PNGs

``--write`` replaces the text between ``<!-- bench-model:begin -->`` and ``<!-- bench-model:end -->`` (``--marker``
names another pair); the file must already hold both markers. Every number comes from the JSON; nothing is typed
by hand. ``bench_model.py`` writes the plots itself after a run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def markers(name: str) -> tuple[str, str]:
    """The README comments a table named ``name`` is written between."""
    return f"<!-- bench-{name}:begin -->", f"<!-- bench-{name}:end -->"


BEGIN, END = markers("model")
IMPLS = (
    ("upstream", "upstream PEFT 0.21.2 DoRA"),
    ("ours_eager", "ours, eager"),
    ("ours_fused", "ours, fused"),
    ("lora", "plain LoRA (floor)"),
    ("ours_fused_reuse", "ours, fused, `PEFT_DORA_NORM_CACHE=1`"),
    ("ours_fused_forced", "ours, fused forced (`PEFT_DORA_FUSED_BACKWARD=1`)"),
)
COLUMNS = (
    ("train", "train step ms"),
    ("train_accum4", "train ×4 accum ms"),
    ("infer", "inference ms"),
    ("decode_per_token", "decode ms/token"),
)


def _get(doc, impl, mode, measure, rank, key="median_ms"):
    for r in doc["speed"]:
        if (r["impl"], r["mode"], r["measure"], r["rank"]) == (impl, mode, measure, rank):
            return r.get(key)
    return None


def _fmt(x, spec=".1f"):
    return "–" if x is None else format(x, spec)


def render(doc: dict, ranks=None) -> str:
    cfg, env = doc["config"], doc["env"]
    ck = cfg["model"]["config_kwargs"]
    ranks = ranks or sorted({r["rank"] for r in doc["speed"]})
    lines = []
    if doc["kind"] != "gpu":
        lines.append("**CPU smoke run: these numbers only show that the pipeline works; they are not a benchmark.**")
        lines.append("")
    lines.append(
        f"{cfg['preset']} architecture from a config, {ck['num_hidden_layers']} layers, hidden {ck['hidden_size']}, "
        f"intermediate {ck['intermediate_size']}, seq {cfg['model']['seq']} (loss on the last "
        f"{cfg['model']['loss_tokens']}), batch {cfg['model']['batch']}, bf16 base, gradient checkpointing; "
        f"{env.get('gpu')}, driver {env.get('driver')}, torch {env.get('torch')}, triton {env.get('triton')}, "
        f"transformers {env.get('transformers')}; {env.get('date')}. Median of {cfg['repeats']} (after warm-up); "
        "speedup = upstream time / this time; peak = `max_memory_allocated` over the static model+adapter "
        "allocation in a training step."
    )
    lines.append("")
    head = (
        ["mode", "r", "implementation"] + [c for _, c in COLUMNS] + ["speedup train / infer / decode", "train peak MB"]
    )
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for mode in ("autocast", "bf16"):
        for rank in ranks:
            for impl, label in IMPLS:
                times = [_get(doc, impl, mode, m, rank) for m, _ in COLUMNS]
                if all(t is None for t in times):
                    continue
                ups = [_get(doc, "upstream", mode, m, rank) for m in ("train", "infer", "decode_per_token")]
                mine = [times[0], times[2], times[3]]
                speed = " / ".join(
                    "–" if (u is None or t is None or impl in ("upstream", "lora")) else f"{u / t:.2f}×"
                    for u, t in zip(ups, mine)
                )
                cells = [mode, str(rank), label] + [_fmt(t, ".2f") for t in times]
                cells += [speed, _fmt(_get(doc, impl, mode, "train", rank, "peak_delta_mb"), ".0f")]
                lines.append("| " + " | ".join(cells) + " |")
    fid = doc.get("fidelity", {}).get("metrics", {}).get("modes", {})
    if fid:
        lines.append("")
        lines.append(f"Fidelity at r={doc['fidelity']['rank']} (cosine to an fp32 run of the same weights):")
        lines.append("")
        lines.append("| mode | implementation | logits cos | logits max abs | grad cos A / B / magnitude |")
        lines.append("|---|---|---|---|---|")
        for mode, per in fid.items():
            for impl, label in IMPLS[:3]:
                if impl not in per:
                    continue
                v = per[impl]["vs_fp32"]
                grads = " / ".join(_fmt(v.get(f"grad_cos_{k}"), ".6f") for k in ("lora_A", "lora_B", "magnitude"))
                lines.append(f"| {mode} | {label} | {v['logits_cos']:.7f} | {v['logits_maxabs']:.3g} | {grads} |")
    conv = doc.get("convergence", {}).get("metrics", {})
    if "ours_fused_vs_upstream" in conv:
        c, cc = conv["ours_fused_vs_upstream"], doc["convergence"]["config"]
        lines.append("")
        text = (
            f"Convergence ({cc['steps']} AdamW steps at lr {cc['lr']:g}, {cc['mode']}, r={cc['rank']}, "
            f"{len(cc['seeds'])} seeds): mean |Δloss| per step ours fused vs upstream {c['mean_abs_dloss']:.2e} "
            f"(max {c['max_abs_dloss']:.2e})"
        )
        floor = conv.get("upstream_ulp_vs_upstream")
        if floor:
            text += (
                f"; the task's own noise floor, upstream against upstream with every initial magnitude one ulp "
                f"higher: {floor['mean_abs_dloss']:.2e} (max {floor['max_abs_dloss']:.2e})"
            )
        lines.append(text + ".")
    if "ours_eager_vs_ours_fused_forced" in conv:
        c = conv["ours_eager_vs_ours_fused_forced"]
        lines.append(
            f"Ours eager vs ours with the fused kernels forced on every module: {c['mean_abs_dloss']:.2e} "
            f"(max {c['max_abs_dloss']:.2e}); final losses per seed: "
            + "; ".join(
                f"{impl} " + ", ".join(f"{v:.3f}" for v in finals.values())
                for impl, finals in conv.get("final_loss", {}).items()
            )
            + "."
        )
    return "\n".join(lines) + "\n"


def render_grid(doc: dict) -> str:
    """A grid run (``bench_model.py --grid``): per shape and precision mode, the worst ours fused / LoRA of each
    measure and its point, the median training ratio and the smallest training speed-up over upstream."""
    import statistics

    import bench_model  # beside this file

    rows, env = bench_model.grid_ratios(doc), doc["env"]
    measures = (("train", "train step"), ("train_step_paired", "train step (paired)"), ("infer", "inference"),
                ("infer_step_paired", "inference (paired)"), ("decode_step_paired", "1-token decode"))  # fmt: skip
    lines = []
    if doc["kind"] != "gpu":
        lines += ["**CPU smoke run: these numbers only show that the pipeline works; they are not a benchmark.**", ""]
    lines += [
        f"{len(rows)} grid points on {env.get('gpu')}, driver {env.get('driver')}, torch {env.get('torch')}, triton "
        f"{env.get('triton')}, transformers {env.get('transformers')}; {env.get('date')}. Ours fused / plain LoRA time "
        "(median of per-round ratios; paired: DoRA and a LoRA twin adapter stepped back to back in one process, the "
        "median of the pairs' ratios), the worst point of each shape and mode with "
        "where it is (train: the step or, marked accum4, the ×4 accumulation step); speed-up = upstream DoRA / ours "
        "(where upstream's step was paired with its own LoRA twin in its process: upstream's DoRA/LoRA over ours').",
        "",
        "| shape | mode | " + " | ".join(f"worst {label}" for _, label in measures) + " | median train | "
        "smallest speed-up over upstream (train) |",
        "|---|---|" + "---|" * (len(measures) + 2),
    ]

    def worst(group: list, values, pick=max) -> str:
        """The ``pick`` of ``values(row)`` (pairs of value and measure) over ``group``, with its point."""
        found = [(v, r["point"], m) for r in group for v, m in values(r) if v is not None]
        if not found:
            return "–"
        value, point, m = pick(found, key=lambda f: f[0])
        where = f"r{point['rank']} seq{point['seq']} b{point['batch']} {point['targets']} drop{point['dropout']:g}"
        return f"{value:.2f} ({where}{' accum4' if m == 'train_accum4' else ''})"

    def ratios(measures_of):
        return lambda r: [(r["dora_over_lora"].get(m), m) for m in measures_of]

    shapes = list(dict.fromkeys(r["point"]["shape"] for r in rows))
    for shape in shapes:
        for mode in bench_model.GRID_MODES:
            group = [r for r in rows if r["point"]["shape"] == shape and r["point"]["mode"] == mode]
            if not group:
                continue
            cells = [worst(group, ratios(bench_model.TRAIN_MEASURES if m == "train" else (m,))) for m, _ in measures]
            train = [r["dora_over_lora"].get(m) for r in group for m in bench_model.TRAIN_MEASURES]
            train = [v for v in train if v is not None]
            cells.append(f"{statistics.median(train):.2f}" if train else "–")
            cells.append(worst(group, lambda r: [(r["speedup_vs_upstream_train"], "train")], min))
            lines.append(f"| {shape} | {mode} | " + " | ".join(cells) + " |")
    head = bench_model.grid_headline_values(doc)
    lines += ["", "Headline (`headline.json`): " + ", ".join(f"`{k}` {v}" for k, v in head.items()) + "."]
    return "\n".join(lines) + "\n"


KERNEL_BEGIN, KERNEL_END = markers("kernels")
KERNELS = (("compose", "compose"), ("fwd_inner", "forward-and-inner"), ("backward", "backward (with d_mag)"))


def render_kernels(doc: dict) -> str:
    """The kernel benchmark (``bench_kernels.py`` JSON): % of the measured copy bandwidth and speed-up vs eager."""
    env, host = doc["env"], doc["host_overhead"]
    lines = [
        f"{env['gpu']}, driver {env['driver']}, torch {env['torch']}, triton {env['triton']}; {env['date']}. "
        "Achieved bandwidth as % of a device-to-device copy of the same size measured in the same run (the "
        "backward's roofline: 4 activation passes at that bandwidth), and speed-up over the eager PyTorch sequence.",
        "",
        "| dtype | tokens × d_out | " + " | ".join(f"{label} % / speed-up" for _, label in KERNELS) + " |",
        "|---|---|" + "---|" * len(KERNELS),
    ]
    for r in doc["shapes"]:
        if r["tokens"] * r["d_out"] < 2**27 and r["dtype"] != "bfloat16":
            continue
        cells = [r["dtype"], f"{r['tokens']} × {r['d_out']}"]
        for op, _ in KERNELS:
            cells.append(f"{r[op + '_fused']['pct_of_copy']:.1f} % / {r[op + '_speedup_vs_eager']:.2f}×")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(
        "Host time per call (tiny tensors, GPU idle): "
        + ", ".join(f"{k.replace('_', ' ')} {v['median_us']:.0f} µs" for k, v in host.items())
        + "."
    )
    return "\n".join(lines) + "\n"


def write_into(path: Path, table: str, begin: str = BEGIN, end: str = END) -> None:
    text = path.read_text()
    if begin not in text or end not in text:
        raise SystemExit(f"{path} lacks the markers {begin} ... {end}; add them where the table belongs")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{begin}\n{table}{end}{tail}")


# ---------------------------------------------------------------------------------------------------------------
# Plots.
# ---------------------------------------------------------------------------------------------------------------

IMPL_ORDER = ("upstream", "ours_eager", "ours_fused", "lora")
IMPL_LABEL = {
    "upstream": "upstream PEFT DoRA",
    "ours_eager": "ours (eager)",
    "ours_fused": "ours (fused)",
    "lora": "plain LoRA",
}
PANELS = (
    ("train", "training step"),
    ("train_accum4", "training, 4-step accumulation"),
    ("infer", "inference forward"),
    ("decode_per_token", "decode, per token"),
    ("decode_per_token_cached", "decode, per token, DoraCaching"),
)


def _title(doc: dict, what: str) -> str:
    env, cfg = doc["env"], doc["config"]
    ck = cfg["model"]["config_kwargs"]
    head = f"{what}: {cfg['preset']} {ck['num_hidden_layers']}L h{ck['hidden_size']} seq {cfg['model']['seq']}"
    if cfg.get("grid"):
        head = f"{what}: grid '{cfg['grid']['name']}', {len(cfg['grid']['points'])} points"
    if cfg.get("compile"):
        head += f", torch.compile(mode={cfg['compile']!r})"
    if doc["kind"] != "gpu":
        return f"CPU SMOKE RUN, NOT A BENCHMARK - {head}"
    return f"{head} on {env.get('gpu')} ({env.get('date')})"


def _grouped_bars(ax, doc, mode, measure, key):
    records = [r for r in doc["speed"] if r["mode"] == mode and r["measure"] == measure and r.get(key) is not None]
    ranks = sorted({r["rank"] for r in records})
    impls = [i for i in IMPL_ORDER if any(r["impl"] == i for r in records)]
    width = 0.8 / max(1, len(impls))
    for k, impl in enumerate(impls):
        xs, ys, lo, hi = [], [], [], []
        for j, rank in enumerate(ranks):
            r = next((r for r in records if r["impl"] == impl and r["rank"] == rank), None)
            if r is None:
                continue
            xs.append(j + (k - (len(impls) - 1) / 2) * width)
            ys.append(r[key])
            if key == "median_ms":
                lo.append(r[key] - r["min_ms"])
                hi.append(r["max_ms"] - r[key])
        err = [lo, hi] if key == "median_ms" else None
        ax.bar(xs, ys, width, yerr=err, capsize=2, label=IMPL_LABEL[impl])
    ax.set_xticks(range(len(ranks)), [f"r={r}" for r in ranks])


def plot_speed(doc: dict, path: Path, key: str, ylabel: str, what: str) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in ("autocast", "bf16") if any(r["mode"] == m for r in doc["speed"])]
    panels = [p for p in PANELS if any(r["measure"] == p[0] and r.get(key) is not None for r in doc["speed"])]
    if not modes or not panels:
        return None
    fig, axes = plt.subplots(len(panels), len(modes), figsize=(5.5 * len(modes), 3.2 * len(panels)), squeeze=False)
    for i, (measure, label) in enumerate(panels):
        for j, mode in enumerate(modes):
            ax = axes[i][j]
            _grouped_bars(ax, doc, mode, measure, key)
            ax.set_title(f"{label} ({mode})", fontsize=10)
            ax.set_ylabel(ylabel)
            ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(_title(doc, what), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_convergence(doc: dict, path: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    losses = doc.get("convergence", {}).get("losses", {})
    if not losses:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    for impl in IMPL_ORDER:
        for seed, curve in losses.get(impl, {}).items():
            ax1.plot(curve, lw=0.8, label=f"{IMPL_LABEL[impl]} seed {seed}")
    ax1.set_xlabel("step")
    ax1.set_ylabel("loss")
    ax1.legend(fontsize=7)
    for a, b in (("ours_fused", "upstream"), ("ours_eager", "upstream"), ("ours_eager", "ours_fused")):
        for seed in losses.get(a, {}):
            if seed in losses.get(b, {}):
                d = [max(abs(x - y), 1e-9) for x, y in zip(losses[a][seed], losses[b][seed])]  # 0 on a log axis
                ax2.plot(d, lw=0.8, label=f"{a} vs {b}, seed {seed}")
    ax2.set_xlabel("step")
    ax2.set_ylabel("|Δloss| (floored at 1e-9)")
    ax2.set_yscale("log")
    ax2.legend(fontsize=7)
    conv = doc["convergence"]["config"]
    fig.suptitle(_title(doc, f"convergence (r={conv['rank']}, {conv['mode']}, {conv['steps']} steps)"), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


RATIO_PANELS = (  # measure, label, the target for DoRA/LoRA
    ("train", "training step", 1.10),
    ("infer", "inference", 1.05),
    ("decode_per_token", "decode / token", 1.10),
    ("decode_per_token_paired", "decode, paired", 1.10),
)


def _round_ratios(doc: dict, mode: str, measure: str, rank: int) -> list:
    """Ours fused over LoRA as the headline takes them: every pair of a paired measure, else one ratio per round both
    ran in, else the one ratio of their medians."""
    import bench_model  # beside this file; it imports this module only inside a function

    paired = bench_model.speed_value(doc, "ours_fused", mode, measure, rank, "pair_ratios")
    if paired:
        return list(paired)
    ratio = bench_model.time_ratio(doc, "ours_fused", "lora", mode, measure, rank)
    return bench_model.round_ratios(doc, "ours_fused", "lora", mode, measure, rank) or ([ratio] if ratio else [])


def plot_ratios(doc: dict, path: Path) -> Path | None:
    """DoRA (ours fused) over plain LoRA at the headline rank: each round's ratio (each pair's, for the paired
    decode measure) as a dot, the median as a black line, the target as a red dashed line."""
    import statistics

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rank = doc["config"]["headline_rank"]
    modes = [m for m in ("autocast", "bf16") if any(r["mode"] == m for r in doc["speed"])]
    panels = [(p, [_round_ratios(doc, m, p[0], rank) for m in modes]) for p in RATIO_PANELS]
    panels = [(p, per_mode) for p, per_mode in panels if any(per_mode)]
    if not panels:
        return None
    fig, ax = plt.subplots(figsize=(1.1 * len(panels) * (len(modes) + 1) + 1.5, 4.5))
    ticks, labels = [], []
    for i, ((measure, label, target), per_mode) in enumerate(panels):
        for j, (mode, ratios) in enumerate(zip(modes, per_mode)):
            x = i * (len(modes) + 1) + j
            if ratios:
                color = "C0" if mode == "autocast" else "C1"
                ax.plot([x] * len(ratios), ratios, ".", color=color, ms=6, alpha=0.7)
                ax.hlines(statistics.median(ratios), x - 0.3, x + 0.3, colors="k", lw=2)
                ax.hlines(target, x - 0.4, x + 0.4, colors="r", linestyles="dashed", lw=1)
            ticks.append(x)
            labels.append(f"{label}\n{mode}, n={len(ratios)}")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(ticks, labels, fontsize=7)
    ax.set_ylabel("DoRA / LoRA time")
    ax.grid(axis="y", alpha=0.3)
    fig.suptitle(
        _title(doc, f"ours fused / plain LoRA, r={rank} (dots: rounds or pairs; black: median; red: target)"),
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


GRID_PANELS = (  # measure (or the upstream speed-up), file suffix, label, target, is a larger value worse
    ("train", "train", "training step, ours fused / LoRA", 1.10, True),
    ("train_accum4", "train_accum4", "x4 accumulation step, ours fused / LoRA", 1.10, True),
    ("train_step_paired", "train_paired", "training step (paired in one process), ours fused / LoRA", 1.10, True),
    ("infer", "infer", "inference forward, ours fused / LoRA", 1.05, True),
    ("infer_step_paired", "infer_paired", "inference forward (paired in one process), ours fused / LoRA", 1.05, True),
    ("decode_step_paired", "decode", "1-token decode (paired in one process), ours fused / LoRA", 1.10, True),
    ("speedup_vs_upstream_train", "speedup_vs_upstream", "training step, upstream DoRA / ours fused", 1.3, False),
)


def plot_grid(doc: dict, out_dir: Path, stem: str) -> list:
    """One PNG per measure: a heatmap per (precision mode, shape), rank down, sequence across; a cell holding several
    points (batch, targets, dropout) shows the worst of them and how many there are. Red: past the target."""
    import bench_model  # beside this file; it imports this module only inside a function
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm

    rows = bench_model.grid_ratios(doc)
    shapes = list(dict.fromkeys(r["point"]["shape"] for r in rows))
    modes = [m for m in bench_model.GRID_MODES if any(r["point"]["mode"] == m for r in rows)]
    ranks = sorted({r["point"]["rank"] for r in rows})
    seqs = sorted({r["point"]["seq"] for r in rows})
    made = []
    for key, suffix, label, target, larger_worse in GRID_PANELS:

        def value(row):
            return row.get(key, row["dora_over_lora"].get(key))

        if not any(value(r) is not None for r in rows):
            continue
        worst = max if larger_worse else min
        norm = TwoSlopeNorm(vcenter=target, vmin=0.8, vmax=1.6) if larger_worse else TwoSlopeNorm(target, 1.0, 4.0)
        cmap = "RdYlGn_r" if larger_worse else "RdYlGn"
        size = (3.3 * len(shapes) + 1.2, 2.9 * len(modes) + 0.6)
        fig, axes = plt.subplots(len(modes), len(shapes), figsize=size, squeeze=False, layout="constrained")
        for i, mode in enumerate(modes):
            for j, shape in enumerate(shapes):
                ax = axes[i][j]
                grid = np.full((len(ranks), len(seqs)), np.nan)
                counts = np.zeros_like(grid, dtype=int)
                for r in rows:
                    p, v = r["point"], value(r)
                    if p["shape"] != shape or p["mode"] != mode or v is None:
                        continue
                    y, x = ranks.index(p["rank"]), seqs.index(p["seq"])
                    grid[y, x] = v if np.isnan(grid[y, x]) else worst(grid[y, x], v)
                    counts[y, x] += 1
                image = ax.imshow(grid, cmap=cmap, norm=norm, aspect="auto")
                for (y, x), v in np.ndenumerate(grid):
                    if not np.isnan(v):
                        text = f"{v:.2f}" + (f"\n({counts[y, x]})" if counts[y, x] > 1 else "")
                        bad = v > target if larger_worse else v < target
                        ax.text(x, y, text, ha="center", va="center", fontsize=7, weight="bold" if bad else "normal")
                ax.set_xticks(range(len(seqs)), [str(s) for s in seqs], fontsize=7)
                ax.set_yticks(range(len(ranks)), [f"r{r}" for r in ranks], fontsize=7)
                ax.set_title(f"{shape}, {mode}", fontsize=9)
                if i == len(modes) - 1:
                    ax.set_xlabel("sequence", fontsize=8)
        fig.colorbar(image, ax=axes, shrink=0.8, label=f"target {target}")
        legend = "worst point per cell (n: points in it), bold: misses the target"
        fig.suptitle(f"{_title(doc, label)}\n{legend}", fontsize=9)
        path = out_dir / f"{stem}_{suffix}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)
    return made


def plot_all(doc: dict, out_dir: Path, stem: str) -> list:
    out_dir.mkdir(parents=True, exist_ok=True)
    if doc["config"].get("grid"):
        return plot_grid(doc, out_dir, stem)
    made = [
        plot_speed(doc, out_dir / f"{stem}_time.png", "median_ms", "ms (median, min–max)", "time"),
        plot_speed(doc, out_dir / f"{stem}_memory.png", "peak_delta_mb", "peak − static, MB", "peak memory"),
        plot_convergence(doc, out_dir / f"{stem}_convergence.png"),
        plot_ratios(doc, out_dir / f"{stem}_dora_over_lora.png"),
    ]
    return [p for p in made if p is not None]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json")
    p.add_argument("--ranks", help="comma list of ranks to show (default: all in the JSON)")
    p.add_argument("--write", metavar="MARKDOWN", help="replace the table between the markers in this file")
    p.add_argument(
        "--marker", help="write between <!-- bench-MARKER:begin/end --> (default: grid for a grid run, else model)"
    )
    p.add_argument("--plots", action="store_true", help="write the PNGs of a bench_model.py result instead")
    p.add_argument("--out-dir", help="where --plots writes (default: beside the JSON)")
    args = p.parse_args(argv)
    src = Path(args.json)
    doc = json.loads(src.read_text())
    if args.plots:
        for png in plot_all(doc, Path(args.out_dir) if args.out_dir else src.parent, src.stem):
            print(f"wrote {png}")
        return 0
    if "shapes" in doc:  # a bench_kernels.py result
        table, table_markers = render_kernels(doc), (KERNEL_BEGIN, KERNEL_END)
    elif doc["config"].get("grid"):  # by default into its own block: a grid table never replaces the model table
        table, table_markers = render_grid(doc), markers(args.marker or "grid")
    else:
        table = render(doc, [int(r) for r in args.ranks.split(",")] if args.ranks else None)
        table_markers = markers(args.marker or "model")
    if args.write:
        write_into(Path(args.write), table, *table_markers)
        print(f"updated {args.write}")
    else:
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
