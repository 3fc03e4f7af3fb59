"""Where a QDoRA eval forward's extra host time goes at 1024 tokens, without a profiler.

``bench_qdora.py`` measured QDoRA's eval forward at 1.21-1.23x QLoRA's (NF4, r 16/64, seq 1024, paired), with a host
issue time about twice QLoRA's in the separately timed measure, while ``profile_qdora.py --measure infer`` found the
GPU busy for as long as QLoRA's, as many launches, and Python within 1 ms under cProfile. This times the forward on
the real host for a QDoRA adapter and its QLoRA twin on one quantized base (``set_adapter`` between them), in
alternating rounds: ``issue_ms``, ``perf_counter`` from an idle GPU to the call's return (the host's issue time), and
``wall_ms``, to the end of the GPU work; variants: ``as_is``; ``eager`` (``PEFT_DORA_FUSED=0``: no Triton launch, the
PyTorch tiers); ``wide8M`` (``dora_dispatch.SMALL_FORWARD_WIDE_NUMEL`` raised to 2^23: an fp32 result beside the
bf16 branch takes the small tier's PyTorch composition up to 2^23 outputs instead of the one-pass Triton kernel);
``small64M`` (both small-tier limits at 2^26: every module of the model on the small tier). ``--variants`` picks
them; ``syncs``, one more forward each under ``torch.cuda.set_sync_debug_mode("warn")`` counting the
host-device syncs it makes.

    PYTHONPATH=<ours> python benchmarks/probe_qdora_infer_host.py --out $OUT/probe_qdora_infer_host.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch


sys.path.insert(0, str(Path(__file__).resolve().parent))
import qdora_worker as qw  # noqa: E402
from probe_syncs import synced  # noqa: E402
from profile_qdora import quantized_base  # noqa: E402


VARIANTS = {
    "as_is": ({}, {}),
    "eager": ({"fused": False}, {}),
    "wide8M": ({}, {"SMALL_FORWARD_WIDE_NUMEL": 1 << 23}),
    "small64M": ({}, {"SMALL_FORWARD_WIDE_NUMEL": 1 << 26, "SMALL_FORWARD_NUMEL": 1 << 26}),
}  # name -> (dora_settings.override fields, dora_dispatch limits for the variant)


@contextlib.contextmanager
def limits(values: dict):
    from peft.tuners.lora import dora_dispatch

    saved = {k: getattr(dora_dispatch, k) for k in values}
    for k, v in values.items():
        setattr(dora_dispatch, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(dora_dispatch, k, v)


def timed(model, ids, calls: int) -> dict:
    issue, wall = [], []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            model(input_ids=ids, use_cache=False)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        issue.append((t1 - t0) * 1e3)
        wall.append((t2 - t0) * 1e3)
    return {"issue_ms": round(statistics.median(issue), 3), "wall_ms": round(statistics.median(wall), 3)}


def syncs(model, ids) -> int:
    """The host syncs of one eval forward (``probe_syncs.synced``: real syncs only, not the debug mode's notice)."""

    def forward():
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            model(input_ids=ids, use_cache=False)

    return len(synced(forward))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quant", default="nf4")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--variants", default="as_is,eager", help="comma-separated, of " + ",".join(VARIANTS))
    p.add_argument("--out", required=True)
    args = p.parse_args()
    import peft
    from peft.tuners.lora import dora_settings

    device = torch.device("cuda")
    base, ids = quantized_base(args.quant, args.layers, args.seq, device)
    model = qw.wrap(base, args.rank, True)
    qw.seed_adapters(model, 0, 1.0)
    model.add_adapter("twin", qw.lora_config(args.rank, dora=False))
    qw.seed_adapters(model, 0, 1.0, adapter="twin")
    model.eval()
    sides = {"qdora": "default", "qlora": "twin"}
    variants = {name: VARIANTS[name] for name in args.variants.split(",")}
    rounds = []
    for r in range(args.rounds):
        row = {}
        for variant, (fields, values) in variants.items():
            with dora_settings.override(**fields), limits(values):
                for side, adapter in sides.items() if r % 2 == 0 else reversed(sides.items()):
                    model.set_adapter(adapter)
                    model.eval()
                    timed(model, ids, 2)  # warm-up: the kept norms and factors of this adapter and variant
                    row[f"{variant}/{side}"] = timed(model, ids, args.calls)
        rounds.append(row)
        print(r, json.dumps(row))
    result = {
        "peft": Path(peft.__file__).parent.parent.name,
        "gpu": torch.cuda.get_device_name(),
        "args": {k: v for k, v in vars(args).items() if k != "out"},  # no machine folders in a committed result
        "rounds": rounds,
        "median": {
            key: {m: round(statistics.median(x[key][m] for x in rounds), 3) for m in ("issue_ms", "wall_ms")}
            for key in rounds[0]
        },
        "syncs_per_forward": {},
    }
    for side, adapter in sides.items():
        model.set_adapter(adapter)
        result["syncs_per_forward"][side] = syncs(model, ids)
    print(json.dumps(result["median"], indent=1), result["syncs_per_forward"])
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
