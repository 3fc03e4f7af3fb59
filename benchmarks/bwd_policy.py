"""GPU time of the one-pass output's backward (backward kernel + d_m column sum) under launch policies: target
program count and maximum row bands (``dora_fused._BACKWARD_PROGRAMS`` / ``_BACKWARD_MAX_BANDS``), at the model
benchmark's shapes (4096 tokens; d_out 1024, 4096, 14336; bf16). The first configuration is the policy before
2026-11-22 (4096 programs, no band cap, an 8 x 256 column-sum tile); ``dm_rel_vs_first`` is d_m's max relative change
against it (a different summation order).

    PYTHONPATH=<peft install> python benchmarks/bwd_policy.py     # writes $OUT/bwd_policy.json (or /tmp)
"""

import json
import os
import sys

import torch

from peft.tuners.lora import dora_fused as F


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import kernel_us  # noqa: E402


# (target programs, max bands, old 8 x 256 column-sum tile)
POLICIES = [(4096, 10**9, True), (4096, 128, False), (2048, 128, False), (1024, 128, False), (1024, 64, False),
            (512, 64, False), (1024, 32, False)]  # fmt: skip


def main() -> None:
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    policy = F._column_sum_policy
    for d_out in (1024, 4096, 14336):
        d_y = torch.randn(4096, d_out, device="cuda", dtype=torch.bfloat16)
        y = torch.randn(4096, d_out, device="cuda", dtype=torch.bfloat16)
        m = torch.rand(d_out, device="cuda") + 0.5
        norm = torch.rand(d_out, device="cuda") + 0.5
        ref = None
        for programs, max_bands, old_sum in POLICIES:
            F._BACKWARD_PROGRAMS, F._BACKWARD_MAX_BANDS = programs, max_bands
            F._backward_rows_per_program.cache_clear()
            F._column_sum_policy = (lambda bands: (8, 256)) if old_sum else policy

            def fn():
                return F._backward_triton(d_y, y, m, 0.5, True, True, True, None, norm, 1e-6, None, True)

            d_m = fn()[2].double()
            ref = d_m if ref is None else ref
            kernels = kernel_us(fn, name_chars=40)
            key = f"{d_out}_p{programs}_b{max_bands}_{'old' if old_sum else 'new'}"
            rel = ((d_m - ref).abs().max() / ref.abs().max()).item()
            out[key] = {"kernels_us": kernels, "total_us": round(sum(kernels.values()), 2), "dm_rel_vs_first": rel}
            print(key, out[key], flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "bwd_policy.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
