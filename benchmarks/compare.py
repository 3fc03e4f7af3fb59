"""See the speed-up on your own GPU: upstream PEFT 0.21.2's DoRA vs ours vs plain LoRA, one command.

    python benchmarks/compare.py                                   # Llama-3.2-1B-like, r = 16, seq 1024, autocast
    python benchmarks/compare.py --size 8b --rank 64 --seq 4096 --modes autocast,bf16

It builds our wheel from this checkout (``pip wheel``, no build isolation) unless ``--ours-wheel`` names one, takes
the pinned upstream wheel through ``tools/upstream.py`` (pip download, sha256-checked; ``PEFT_UPSTREAM_WHEEL`` on an
offline machine), and runs ``bench_model.py``'s speed task on a model built from a config with random weights (no
downloads): each implementation in its own subprocess, a progress line per job. It then prints the times, DoRA/LoRA
and the speed-up over upstream, and the dispatch tiers our DoRA really ran (on a CPU, or without Triton, that is
the eager PyTorch tier, and the report says so).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import bench_model  # noqa: E402

from tools import upstream  # noqa: E402


# decoder dims of the public configs these sizes are named after (layers are --layers: the per-layer cost is what
# the ratio measures, and fewer layers keep the run to minutes)
SIZES = {
    "1b": {"hidden": 2048, "intermediate": 8192, "heads": 32, "kv_heads": 8},  # Llama-3.2-1B
    "3b": {"hidden": 3072, "intermediate": 8192, "heads": 24, "kv_heads": 8},  # Llama-3.2-3B
    "8b": {"hidden": 4096, "intermediate": 14336, "heads": 32, "kv_heads": 8},  # Llama-3.1-8B
    "tiny": {"hidden": 64, "intermediate": 176, "heads": 4, "kv_heads": 2},  # a CPU check of the command itself
}
FUSED_TIERS = ("fused_backward", "fused_forward", "decode", "small_forward")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="1b")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--modes", default="autocast", help="comma list of autocast, bf16")
    p.add_argument("--measures", default="train,infer", help="comma list of train, train_accum4, infer, decode")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cuda")
    p.add_argument("--ours-wheel", help="our built wheel (default: build one from this checkout)")
    p.add_argument("--upstream-wheel", help="the pinned upstream wheel (default: tools/upstream.py fetches it)")
    work = str(Path(tempfile.gettempdir()) / "peft_dora_compare")
    p.add_argument("--work", default=work, help="wheels, installs, JSON")
    return p.parse_args(argv)


def build_ours(dest: Path) -> Path:
    """Our wheel, built from this checkout into ``dest`` (replacing an older one there)."""
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("peft-*+dora*.whl"):
        old.unlink()
    print("building our wheel from this checkout ...", flush=True)
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dest), "."]
    subprocess.run(cmd, check=True, cwd=HERE.parent)
    return next(dest.glob("peft-*+dora*.whl"))


def bench_argv(args, ours: Path, upstream_wheel: Path, work: Path) -> list:
    dims = SIZES[args.size]
    return [
        "--ours-wheel", str(ours), "--upstream-wheel", str(upstream_wheel),
        "--impls", "upstream,ours_fused,lora", "--tasks", "speed", "--measures", args.measures,
        "--modes", args.modes, "--ranks", str(args.rank), "--headline-rank", str(args.rank),
        "--hidden", str(dims["hidden"]), "--intermediate", str(dims["intermediate"]),
        "--heads", str(dims["heads"]), "--kv-heads", str(dims["kv_heads"]),
        "--layers", str(args.layers), "--seq", str(args.seq), "--loss-tokens", str(min(args.seq, 1024)),
        "--batch", str(args.batch), "--repeats", str(args.repeats), "--device", args.device,
        "--prompt-tokens", str(min(args.seq, 128)), "--new-tokens", "32",
        "--vocab", "512" if args.size == "tiny" else "32000",
        "--target-root", str(work / "installs"), "--workdir", str(work / "jobs"),
        "--out-dir", str(work), "--out", "compare.json", "--no-plots",
    ]  # fmt: skip


def ours_label(doc: dict) -> str:
    """'ours (fused)' where our DoRA ran a fused tier, else a label that says the eager tier ran, and why it may."""
    tiers = {}
    for r in doc["speed"]:
        if r["impl"] == "ours_fused":
            for tier, n in (r.get("tiers") or {}).items():
                tiers[tier] = tiers.get(tier, 0) + n
    ran = sorted(t for t in tiers if t in FUSED_TIERS or t == "eager")
    if any(t in FUSED_TIERS for t in ran):
        return f"ours (tiers: {', '.join(ran)})"
    return "ours (eager tier only: a CPU, no Triton, or PEFT_DORA_FUSED=0)"


def report(doc: dict) -> str:
    cfg = doc["config"]
    ck = cfg["model"]["config_kwargs"]
    lines = [
        f"\n{doc['env'].get('gpu') or 'CPU'}: Llama-like, hidden {ck['hidden_size']}, "
        f"{ck['num_hidden_layers']} layers, "
        f"seq {cfg['model']['seq']}, batch {cfg['model']['batch']}, r = {cfg['ranks'][0]}; median ms",
        f"{'mode':9s}{'measure':9s}{'upstream DoRA':>15s}{'ours':>10s}{'LoRA':>10s}{'ours/LoRA':>11s}"
        f"{'upstream/ours':>15s}",
    ]
    rank = cfg["ranks"][0]
    for mode in cfg["modes"]:
        for measure in cfg["measures"]:
            measure = "decode_per_token" if measure == "decode" else measure
            t = {i: bench_model.speed_value(doc, i, mode, measure, rank) for i in ("upstream", "ours_fused", "lora")}
            if None in t.values():
                continue
            lines.append(
                f"{mode:9s}{measure[:8]:9s}{t['upstream']:15.2f}{t['ours_fused']:10.2f}{t['lora']:10.2f}"
                f"{t['ours_fused'] / t['lora']:11.3f}{t['upstream'] / t['ours_fused']:15.2f}"
            )
    lines.append(ours_label(doc))
    lines += [f"ERROR {e.get('impl')}: {e['error'].strip().splitlines()[-1]}" for e in doc.get("errors", [])]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    work = Path(args.work)
    ours = Path(args.ours_wheel) if args.ours_wheel else build_ours(work / "wheels")
    upstream_wheel = Path(args.upstream_wheel) if args.upstream_wheel else upstream.wheel()
    rc = bench_model.main(bench_argv(args, ours, upstream_wheel, work))
    print(report(json.loads((work / "compare.json").read_text())))
    return rc


if __name__ == "__main__":
    sys.exit(main())
