"""The split norm (fp32 adapters on a bf16 W, autocast) per projection shape and rank on the GPU: the installed
``split_row_norm`` ("cur") against a candidate with B·G as a cuBLAS GEMM of 3-way bf16 splits made by PyTorch ops
("b"), GPU time per kernel (torch.profiler) and max relative error against fp64 for realistic
(‖s·B·A‖ = 0.1‖W‖) and adversarial adapters. Produced ``results/split_norm_candidates.json`` (at 9b40524, where
"cur" was the 3xTF32 Triton epilogue) and ``results/split_norm_after.json`` (at eb4bd90, "cur" = cuBLAS B·G).
The candidate now uses the installed row-wise epilogue kernel (the runs above used a copy of it in this script), so
it needs eb4bd90 or later.

    PYTHONPATH=<peft install> python benchmarks/split_norm_candidates.py norm   # $OUT/diag.json
"""

import json
import os
import sys

import torch
import triton

from peft.tuners.lora import dora_norm_triton as N


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import kernel_us  # noqa: E402


def mm32(a, b):
    return torch.mm(a, b, out_dtype=torch.float32) if a.is_cuda else a.float() @ b.float()


def cand_b(weight, lora_A, lora_B, scale, w_sq):
    d_out, d_in = weight.shape
    r = lora_A.shape[0]
    h = N._split_t(lora_A, weight.dtype)
    u2 = mm32(weight, h)
    gram2 = mm32(h.T, h)
    g = gram2[:r, :r] + gram2[:r, r:] + gram2[r:, :r] + gram2[r:, r:]
    dt = weight.dtype
    gs = torch.empty((3 * r, r), dtype=dt, device=g.device)
    gs[:r].copy_(g)
    gs[r : 2 * r].copy_(gs[:r])
    torch.sub(g, gs[:r], out=gs[2 * r :])
    bs = torch.empty((d_out, 3 * r), dtype=dt, device=g.device)
    bs[:, :r].copy_(lora_B)
    torch.sub(lora_B, bs[:, :r], out=bs[:, r : 2 * r])
    bs[:, 2 * r :].copy_(bs[:, :r])
    bg = mm32(bs, gs)
    out = torch.empty(d_out, dtype=torch.float32, device=weight.device)
    N._norm_epilogue_kernel[(triton.cdiv(d_out, 16),)](
        u2, bg, lora_B, w_sq, out, d_out, r, lora_B.stride(0), lora_B.stride(1), 2.0 * scale, scale * scale,
        BLOCK_M=16, BLOCK_N=128, enable_fp_fusion=False,
    )  # fmt: skip
    return out


def current(weight, lora_A, lora_B, scale, w_sq):
    return N.split_row_norm(weight, lora_A, lora_B, scale, w_sq, weight.shape[1])


def ref64(weight, lora_A, lora_B, scale):
    w = weight.double() + scale * (lora_B.double() @ lora_A.double())
    return w.norm(dim=1)


def make(d_out, d_in, r, rel, device, adversarial=False):
    g = torch.Generator(device="cpu").manual_seed(d_out + d_in + r)
    W = (torch.randn(d_out, d_in, generator=g) * 0.02).to(torch.bfloat16)
    A = torch.randn(r, d_in, generator=g) / d_in**0.5
    B = torch.randn(d_out, r, generator=g)
    if adversarial:  # rows of B aligned with a common direction, A rows correlated with W
        A = A + 0.5 * W.float()[:r] / W.float()[:r].norm(dim=1, keepdim=True)
    scale = 0.7
    ba = (scale * (B @ A)).norm()
    B = B * (rel * W.float().norm() / ba)
    return W.to(device), A.to(device), B.to(device), scale


out = {}
dev = torch.device("cuda")


def ktimes(fn, n=20):
    kernels = kernel_us(fn, n)
    return kernels, round(sum(kernels.values()), 1)


if "norm" in sys.argv:
    for d_out, d_in in [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)]:
        for r in (384, 768):
            W, A, B, s = make(d_out, d_in, r, 0.1, dev)
            wsq = W.float().pow(2).sum(1)
            ref = ref64(W, A, B, s)
            row = {}
            for name, f in (("cur", current), ("b", cand_b)):
                o = f(W, A, B, s, wsq)
                err = ((o.double() - ref).abs() / ref).max().item()
                k, tot = ktimes(lambda: f(W, A, B, s, wsq))
                row[name] = {"err": err, "gpu_us": tot, "kernels": k}
                print(d_out, d_in, r, name, f"err {err:.2e} gpu {tot:.1f} us", k, flush=True)
            Wa, Aa, Ba, sa = make(d_out, d_in, r, 3.0, dev, adversarial=True)
            refa = ref64(Wa, Aa, Ba, sa)
            wsqa = Wa.float().pow(2).sum(1)
            for name, f in (("cur", current), ("b", cand_b)):
                o = f(Wa, Aa, Ba, sa, wsqa)
                row[name]["err_adv"] = ((o.double() - refa).abs() / refa).max().item()
            print("  adv", {k: v["err_adv"] for k, v in row.items()}, flush=True)
            out[f"norm_{d_out}x{d_in}_r{r}"] = row

json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "diag.json"), "w"), indent=1)
