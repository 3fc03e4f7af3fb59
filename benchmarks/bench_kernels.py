"""Fused DoRA kernels vs the eager PyTorch sequence and vs a measured device-to-device copy, on one CUDA GPU.

    python benchmarks/bench_kernels.py --out benchmarks/results [--junit gpu_junit.xml] [--sweep]
    python benchmarks/bench_kernels.py --merge-headline benchmarks/results/bench_kernels.json

Bytes counted per call (A = one activation tensor): compose 3A (lora, base read; out written), forward-and-inner
4A, backward 4A (d_out, inner read; d_lora, d_base written). "pct of copy" is achieved bandwidth over the copy
bandwidth measured on a tensor of the same size; the backward's roofline is 4A at that copy bandwidth. CUDA events,
warm-up, median of >= 20 timed calls, inputs drawn at random (never zeros).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import torch
from timing import loop_us

from peft.tuners.lora import dora_dispatch as dispatch
from peft.tuners.lora import dora_fused as F


TOKENS = (2048, 8192, 32768, 65536)
D_OUT = (2048, 4096, 14336, 28672)
SMALL_GRID = ((8192, 4096), (32768, 14336))  # fp16 / fp32: the two shapes that matter most
HEADLINE_SHAPE = (32768, 14336)
REPS, WARMUP = 25, 5


def _time(fn, reps=REPS, warmup=WARMUP):
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    ms = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    return {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms), "reps": reps}


def _acts(tokens, d_out, dtype, n):
    gen = torch.Generator(device="cuda").manual_seed(tokens + d_out)
    return [torch.randn(tokens, d_out, device="cuda", dtype=dtype, generator=gen) for _ in range(n)]


def bench_shape(tokens, d_out, dtype):
    lora, base, d_out_t = _acts(tokens, d_out, dtype, 3)
    g = 1 + 0.05 * torch.randn(d_out, device="cuda")
    act_bytes = lora.numel() * lora.element_size()
    dst = torch.empty_like(lora)
    copy = _time(lambda: dst.copy_(lora))
    copy_gbs = 2 * act_bytes / copy["median_ms"] / 1e6
    out, inner = F.fused_dora_forward_and_inner(lora, base, g, 0.5)
    rows = {
        "compose_fused": (lambda: F.fused_dora_compose(lora, base, g, 0.5, inplace=False), 3),
        "compose_eager": (lambda: F.compose_torch(lora, base, g, 0.5), 3),
        "fwd_inner_fused": (lambda: F.fused_dora_forward_and_inner(lora, base, g, 0.5), 4),
        "fwd_inner_eager": (lambda: F._forward_and_inner_torch(lora, base, g, 0.5), 4),
        "backward_fused": (lambda: F._fused_backward(d_out_t, inner, g, 0.5, True, True, True), 4),
        "backward_eager": (lambda: F._backward_torch(d_out_t, inner, g, 0.5, True, True, True), 4),
    }
    result = {"tokens": tokens, "d_out": d_out, "dtype": str(dtype).removeprefix("torch."), "copy": copy,
              "copy_GBps": copy_gbs}  # fmt: skip
    for name, (fn, n_act) in rows.items():
        t = _time(fn)
        gbs = n_act * act_bytes / t["median_ms"] / 1e6
        result[name] = {**t, "GBps": gbs, "pct_of_copy": 100 * gbs / copy_gbs}
    for op in ("compose", "fwd_inner", "backward"):
        result[f"{op}_speedup_vs_eager"] = result[f"{op}_eager"]["median_ms"] / result[f"{op}_fused"]["median_ms"]
    return result


def bench_crossover():
    """Forward + backward of the training composition, fused autograd vs eager autograd, from decode to prefill."""
    rows = []
    for d_out in (1024, 4096):
        for tokens in (1, 16, 256, 1024, 4096, 8192, 16384, 32768):
            lora, base, d = _acts(tokens, d_out, torch.bfloat16, 3)
            lora.requires_grad_()
            base.requires_grad_()
            g = (1 + 0.05 * torch.randn(d_out, device="cuda")).requires_grad_()

            def fused():
                F.FusedDoRAComposeFunction.apply(lora, base, g, 0.5).backward(d)

            def eager():
                F.compose_torch(lora, base, g, 0.5).backward(d)

            tf, te = _time(fused, reps=30, warmup=5), _time(eager, reps=30, warmup=5)
            rows.append({"tokens": tokens, "d_out": d_out, "numel": tokens * d_out, "fused": tf, "eager": te,
                         "fused_faster": tf["median_ms"] <= te["median_ms"]})  # fmt: skip
    losing = [r["numel"] for r in rows if not r["fused_faster"]]
    return {"rows": rows, "smallest_numel_where_fused_always_wins": (max(losing) + 1) if losing else 0,
            "threshold_in_code": dispatch.BACKWARD_CROSSOVER_NUMEL}  # fmt: skip


def host_us(fn, calls=3000):
    """Wall time per call in µs (median, min, max of 5 loops) after a warm-up; with tiny tensors the GPU idles, so
    this is the host cost of a call."""
    t = loop_us(fn, torch.cuda.synchronize, warmup=200, loops=5, calls=calls)
    return {"median_us": t["median"], "min_us": t["min"], "max_us": t["max"]}


def bench_host_overhead():
    """Host cost of one fused call on tiny tensors, next to the eager sequence."""
    lora, base = _acts(1, 64, torch.bfloat16, 2)
    g = 1 + 0.05 * torch.randn(64, device="cuda")
    d = torch.randn_like(lora)
    cases = {
        "fused_compose": lambda: F.fused_dora_compose(lora, base, g, 0.5, inplace=False),
        "fused_compose_inplace": lambda: F.fused_dora_compose(lora, base, g, 0.5, inplace=True),
        "fused_forward_and_inner": lambda: F.fused_dora_forward_and_inner(lora, base, g, 0.5),
        "fused_backward": lambda: F._fused_backward(d, base, g, 0.5, True, True, True),
        "eager_compose": lambda: F.compose_torch(lora, base, g, 0.5),
    }
    return {name: host_us(fn) for name, fn in cases.items()}


def policy_sweep():
    """Block-size candidates at the headline shape (bf16), to choose the launch policy from data."""
    tokens, d_out = HEADLINE_SHAPE
    lora, base, d = _acts(tokens, d_out, torch.bfloat16, 3)
    g = 1 + 0.05 * torch.randn(d_out, device="cuda")
    out = torch.empty_like(lora)
    inner = torch.empty_like(lora)
    act_bytes = lora.numel() * 2
    original = F._elementwise_policy
    rows = []
    try:
        for block_n, tile, warps in ((256, 2048, 4), (512, 4096, 4), (512, 4096, 8), (1024, 4096, 4),
                                     (1024, 8192, 8), (256, 4096, 4), (512, 8192, 8), (2048, 16384, 16)):  # fmt: skip
            F._elementwise_policy = lambda rb, cb, bn=block_n, t=tile, w=warps: (max(1, min(t // min(cb, bn), rb)),
                                                                                min(cb, bn), w)  # fmt: skip
            F._backward_rows_per_program.cache_clear()
            tc = _time(lambda: F._compose_triton(lora, base, g, 0.5, out))
            ti = _time(lambda: F._compose_triton(lora, base, g, 0.5, out, inner))
            tb = _time(lambda: F._backward_triton(d, inner, g, 0.5, True, True, True))
            rows.append({"block_n": block_n, "tile": tile, "warps": warps,
                         "compose_GBps": 3 * act_bytes / tc["median_ms"] / 1e6,
                         "fwd_inner_GBps": 4 * act_bytes / ti["median_ms"] / 1e6,
                         "backward_GBps": 4 * act_bytes / tb["median_ms"] / 1e6})  # fmt: skip
    finally:
        F._elementwise_policy = original
        F._backward_rows_per_program.cache_clear()
    return rows


BAND_ROWS = (128, 256, 512, 1024, 2048, 4096)
BAND_D_OUT = (1024, 4096, 14336)


def band_sweep():
    """The backward at few tokens (bf16, every gradient): d_m finished in the backward kernel's one band of narrow
    column blocks (``min_block_n`` 16 or 32) against the two-stage sum (backward over row bands, then the column-sum
    kernel): GPU time per call and the time per call of back-to-back calls, to choose ``SINGLE_BAND_NUMEL`` and the
    one band's policy from data."""
    rows_out = []
    saved = F.SINGLE_BAND_NUMEL, F._SINGLE_BAND_MIN_BLOCK_N
    try:
        for tokens in BAND_ROWS:
            for d_out in BAND_D_OUT:
                d, inner = _acts(tokens, d_out, torch.bfloat16, 2)
                g = 1 + 0.05 * torch.randn(d_out, device="cuda")
                row = {"tokens": tokens, "d_out": d_out}
                for name, single, min_n in (("two_stage", 0, 32), ("one_band_n32", 1 << 30, 32),
                                            ("one_band_n16", 1 << 30, 16)):  # fmt: skip
                    F.SINGLE_BAND_NUMEL, F._SINGLE_BAND_MIN_BLOCK_N = single, min_n
                    F._single_band_policy.cache_clear()
                    fn = lambda: F._backward_triton(d, inner, g, 0.5, True, True, True)  # noqa: E731
                    row[name + "_gpu_us"] = round(_time(fn, reps=50, warmup=10)["median_ms"] * 1e3, 2)
                    # back-to-back calls: max(host, GPU) per call, what a host-bound step pays
                    row[name + "_loop_us"] = round(loop_us(fn, torch.cuda.synchronize, 10, 5, 100)["median"], 2)
                rows_out.append(row)
                print(row, flush=True)
    finally:
        F.SINGLE_BAND_NUMEL, F._SINGLE_BAND_MIN_BLOCK_N = saved
        F._single_band_policy.cache_clear()
    return rows_out


def _junit_counts(path):
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    total = sum(int(s.get("tests", 0)) for s in suites)
    failed = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    return {"passed": total - failed - skipped, "failed": failed, "skipped": skipped}


def _env():
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        driver = "unknown"
    import triton

    return {"gpu": torch.cuda.get_device_name(), "driver": driver, "torch": torch.__version__,
            "triton": triton.__version__, "python": platform.python_version(),
            "date": datetime.date.today().isoformat()}  # fmt: skip


def headline(data):
    shape = next(r for r in data["shapes"] if (r["tokens"], r["d_out"]) == HEADLINE_SHAPE and r["dtype"] == "bfloat16")
    return {
        "compose_fwd_pct_of_copy_bf16": round(shape["compose_fused"]["pct_of_copy"], 1),
        "fwd_inner_pct_of_copy_bf16": round(shape["fwd_inner_fused"]["pct_of_copy"], 1),
        "backward_pct_of_roofline_bf16": round(shape["backward_fused"]["pct_of_copy"], 1),
        "host_us_per_fused_call": round(data["host_overhead"]["fused_compose"]["median_us"], 2),
        "gpu": data["env"]["gpu"],
        "date": data["env"]["date"],
    }


def merge_headline(json_path):
    """Add this run's headline keys to headline.json beside it, keeping every other key there."""
    json_path = Path(json_path)
    target = json_path.parent / "headline.json"
    merged = json.loads(target.read_text()) if target.exists() else {}
    merged.update(headline(json.loads(json_path.read_text())))
    target.write_text(json.dumps(merged, indent=2, sort_keys=True) + "\n")
    return merged


def plot(data, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in data["shapes"] if r["dtype"] == "bfloat16"]
    labels = [f"{r['tokens'] // 1024}k×{r['d_out']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.6), 4.5))
    width = 0.14
    series = [("compose_fused", "compose fused"), ("compose_eager", "compose eager"),
              ("fwd_inner_fused", "fwd+inner fused"), ("fwd_inner_eager", "fwd+inner eager"),
              ("backward_fused", "backward fused"), ("backward_eager", "backward eager")]  # fmt: skip
    for i, (key, label) in enumerate(series):
        ax.bar([x + (i - 2.5) * width for x in range(len(rows))], [r[key]["pct_of_copy"] for r in rows], width,
               label=label)  # fmt: skip
    ax.axhline(100, color="k", lw=0.8)
    ax.set_xticks(range(len(rows)), labels, rotation=60, fontsize=7)
    ax.set_ylabel("% of measured copy bandwidth")
    ax.set_title(f"DoRA kernels, bf16, {data['env']['gpu']}")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--junit", help="pytest --junitxml file of the GPU test run, for the pass/fail counts")
    parser.add_argument("--sweep", action="store_true", help="also time launch-policy candidates")
    parser.add_argument("--merge-headline", metavar="JSON", help="only merge JSON's headline into headline.json")
    parser.add_argument("--bands", metavar="JSON", help="only the backward's one-band vs two-stage sweep, to JSON")
    args = parser.parse_args()
    if args.merge_headline:
        print(json.dumps(merge_headline(args.merge_headline), indent=2))
        return
    if args.bands:
        Path(args.bands).write_text(json.dumps({"env": _env(), "rows": band_sweep()}, indent=1) + "\n")
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = {"env": _env(), "bytes_model": __doc__.split("\n\n")[2], "shapes": []}
    if args.junit:
        data["gpu_tests"] = _junit_counts(args.junit)
    data["host_overhead"] = bench_host_overhead()
    data["crossover"] = bench_crossover()
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        grid = [(t, d) for t in TOKENS for d in D_OUT] if dtype == torch.bfloat16 else SMALL_GRID
        for tokens, d_out in grid:
            data["shapes"].append(bench_shape(tokens, d_out, dtype))
            torch.cuda.empty_cache()  # the shape's tensors are gone with bench_shape's frame
            r = data["shapes"][-1]
            print(f"{r['dtype']:>8} {tokens:>6}x{d_out:<6} copy {r['copy_GBps']:7.0f} GB/s | "
                  f"compose {r['compose_fused']['pct_of_copy']:5.1f}% ({r['compose_speedup_vs_eager']:.2f}x) | "
                  f"fwd+inner {r['fwd_inner_fused']['pct_of_copy']:5.1f}% ({r['fwd_inner_speedup_vs_eager']:.2f}x) | "
                  f"bwd {r['backward_fused']['pct_of_copy']:5.1f}% ({r['backward_speedup_vs_eager']:.2f}x)",
                  flush=True)  # fmt: skip
    if args.sweep:
        data["policy_sweep"] = policy_sweep()
    data["headline"] = headline(data)
    (out / "bench_kernels.json").write_text(json.dumps(data, indent=2) + "\n")
    plot(data, out / "bench_kernels.png")
    print(json.dumps({"headline": data["headline"], "host_overhead": data["host_overhead"],
                      "crossover": {k: v for k, v in data["crossover"].items() if k != "rows"},
                      "policy_sweep": data.get("policy_sweep")}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
