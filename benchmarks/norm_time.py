"""GPU and host time of the factored norm for every projection of one Llama layer (4096 / 14336, 32 / 8 heads),
fp32 adapters on a bf16 weight (PEFT's autocast default): the split norm (default) against the PyTorch form
(``PEFT_DORA_NORM_KERNEL=0``), each checked against fp64.

    PYTHONPATH=<peft install> python benchmarks/norm_time.py --out $OUT/norm_time.json
"""

import argparse
import json
import os
import time

import torch

from peft.tuners.lora import dora


SHAPES = {"q": (4096, 4096), "k": (1024, 4096), "v": (1024, 4096), "o": (4096, 4096), "gate": (14336, 4096),
          "up": (14336, 4096), "down": (4096, 14336)}  # fmt: skip


def layer(rank: int, gen: torch.Generator):
    mods = []
    for d_out, d_in in SHAPES.values():
        w = (torch.randn(d_out, d_in, device="cuda", generator=gen) * 0.02).bfloat16()
        a = torch.randn(rank, d_in, device="cuda", generator=gen) / d_in**0.5
        b = torch.randn(d_out, rank, device="cuda", generator=gen) * 0.01
        mods.append((w, a, b, dora.row_sq_norm(w)))
    return mods


def timed(mods, reps: int = 20):
    def once():
        for w, a, b, w_sq in mods:
            dora.factored_row_norm(w, a, b, 2.0, w_sq=w_sq)

    once()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(reps):
        once()
    e1.record()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        once()
    host = (time.perf_counter() - t0) / reps
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / reps, host * 1e3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "ranks": {}}
    for rank in (64, 384, 768):
        mods = layer(rank, gen)
        row = res["ranks"][str(rank)] = {}
        for path, flag in (("split", None), ("torch_form", "0")):
            if flag is None:
                os.environ.pop("PEFT_DORA_NORM_KERNEL", None)
            else:
                os.environ["PEFT_DORA_NORM_KERNEL"] = flag
            dora._invalidate_fused_cache()
            gpu_ms, host_ms = timed(mods)
            err = 0.0
            for w, a, b, w_sq in mods[:2]:
                ref = torch.linalg.vector_norm(w.double() + 2.0 * b.double() @ a.double(), dim=1)
                got = dora.factored_row_norm(w, a, b, 2.0, w_sq=w_sq)
                err = max(err, ((got.double() - ref).abs() / ref).max().item())
            row[path] = {"layer_ms_gpu_wall": gpu_ms, "layer_ms_host_issue": host_ms, "max_rel_err_q_k": err}
        print(rank, json.dumps(row), flush=True)
    os.environ.pop("PEFT_DORA_NORM_KERNEL", None)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
