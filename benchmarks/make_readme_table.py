"""Render the benchmark tables of ``docs/benchmarks.md`` (markdown) from a ``bench_model.py`` (a grid run: its worst
cases) or ``bench_kernels.py`` JSON.

    python benchmarks/make_readme_table.py benchmarks/results/model_llama.json            # print the table
    python benchmarks/make_readme_table.py RESULT.json --write docs/benchmarks.md          # replace it in place

``--write`` replaces the text between ``<!-- bench-model:begin -->`` and ``<!-- bench-model:end -->``; the file
must already hold both markers. Every number comes from the JSON; nothing is typed by hand.
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
    measures = (("train", "train step"), ("infer", "inference"), ("decode_step_paired", "1-token decode"))
    lines = []
    if doc["kind"] != "gpu":
        lines += ["**CPU smoke run: these numbers only show that the pipeline works; they are not a benchmark.**", ""]
    lines += [
        f"{len(rows)} grid points on {env.get('gpu')}, driver {env.get('driver')}, torch {env.get('torch')}, triton "
        f"{env.get('triton')}, transformers {env.get('transformers')}; {env.get('date')}. Ours fused / plain LoRA time "
        "(median of per-round ratios; decode paired in one process), the worst point of each shape and mode with "
        "where it is (train: the step or, marked accum4, the ×4 accumulation step); speed-up = upstream DoRA / ours.",
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
        for mode in ("autocast", "bf16"):
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json")
    p.add_argument("--ranks", help="comma list of ranks to show (default: all in the JSON)")
    p.add_argument("--write", metavar="MARKDOWN", help="replace the table between the markers in this file")
    p.add_argument("--marker", default="model", help="write between <!-- bench-MARKER:begin/end --> (model tables)")
    args = p.parse_args(argv)
    doc = json.loads(Path(args.json).read_text())
    if "shapes" in doc:  # a bench_kernels.py result
        table, table_markers = render_kernels(doc), (KERNEL_BEGIN, KERNEL_END)
    elif doc["config"].get("grid"):
        table, table_markers = render_grid(doc), markers(args.marker)
    else:
        table = render(doc, [int(r) for r in args.ranks.split(",")] if args.ranks else None)
        table_markers = markers(args.marker)
    if args.write:
        write_into(Path(args.write), table, *table_markers)
        print(f"updated {args.write}")
    else:
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
