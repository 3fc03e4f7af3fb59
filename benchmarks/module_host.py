"""Per-module cost of DoRA against plain LoRA, split into host time and GPU time.

Host time: one PEFT-wrapped ``nn.Linear`` at a small shape (1024 x 1024, r = 64, 64 tokens), so that the GPU is
never the bottleneck and a loop of N calls measures how long the host takes to issue each phase: training forward,
backward, the checkpointed forward + backward (its backward includes the recompute), an inference forward and a
1-token decode forward. LoRA and DoRA alternate over several rounds and each phase keeps its minimum. The same
for the pieces of a DoRA forward (the factored norm, the one-pass output launch) and for reference launches (one
PyTorch op, one Triton kernel).

GPU time: the same phases at one of the model benchmark's shapes (the MLP up projection, 4096 -> 14336, r = 384,
4096 tokens), from torch.profiler, kernel by kernel.

    PYTHONPATH=<peft install> python benchmarks/module_host.py --out $OUT/module_host.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import time

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint


def build(impl: str, mode: str, d_in: int, d_out: int, rank: int, device):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(d_in, d_out, bias=False)).to(device=device, dtype=torch.bfloat16)
    config = LoraConfig(r=rank, lora_alpha=rank // 2, use_rslora=True, target_modules=["0"], use_dora=impl == "dora")
    model = get_peft_model(base, config)
    if mode == "bf16":
        model = model.to(torch.bfloat16)  # adapters in bf16 too; autocast mode keeps PEFT's fp32 adapters
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return model


def precision(mode: str, device):
    if mode == "autocast":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def host_loop(fn, n: int, warmup: int = 20) -> float:
    """Mean host µs per call of ``fn`` (timed around the call, no synchronisation inside the loop)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    total = 0.0
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        total += time.perf_counter() - t0
    torch.cuda.synchronize()
    return 1e6 * total / n


def host_phases(model, mode: str, n: int, device) -> dict:
    ctx = precision(mode, device)
    x = torch.randn(64, 1024, device=device, dtype=torch.bfloat16)
    gy = torch.randn(64, 1024, device=device, dtype=torch.bfloat16)
    out: dict[str, float] = {}
    model.train()
    state = {}

    def fwd():
        with ctx:
            state["y"] = model(x)

    def bwd():
        state.pop("y").backward(gy)

    def fwd_bwd_timed(f, b, n):
        tf = tb = 0.0
        for i in range(n + 20):
            t0 = time.perf_counter()
            f()
            t1 = time.perf_counter()
            b()
            t2 = time.perf_counter()
            if i >= 20:
                tf, tb = tf + t1 - t0, tb + t2 - t1
            if i == 19:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        return 1e6 * tf / n, 1e6 * tb / n

    out["train_fwd_us"], out["train_bwd_us"] = fwd_bwd_timed(fwd, bwd, n)

    def fwd_ckpt():
        with ctx:
            state["y"] = checkpoint(model, x, use_reentrant=False)

    out["ckpt_fwd_us"], out["ckpt_bwd_us"] = fwd_bwd_timed(fwd_ckpt, bwd, n)
    model.eval()
    x_inf = torch.randn(4096, 1024, device=device, dtype=torch.bfloat16)
    x_dec = torch.randn(1, 1024, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        out["infer_fwd_us"] = host_loop(lambda: (ctx.__enter__(), model(x_inf), ctx.__exit__(None, None, None)), n)
        out["decode_fwd_us"] = host_loop(lambda: (ctx.__enter__(), model(x_dec), ctx.__exit__(None, None, None)), n)
    model.train()
    return out


def host_rounds(mode: str, n: int, rounds: int, device) -> dict:
    """LoRA and DoRA measured in alternation, ``rounds`` times; the minimum per phase (the host's noise is one-sided:
    other work on the machine only ever adds time)."""
    models = {impl: build(impl, mode, 1024, 1024, 64, device) for impl in ("lora", "dora")}
    best: dict = {impl: {} for impl in models}
    for _ in range(rounds):
        for impl, model in models.items():
            for k, v in host_phases(model, mode, n, device).items():
                best[impl][k] = min(v, best[impl].get(k, float("inf")))
    return best


def host_pieces(mode: str, n: int, device) -> dict:
    """The pieces of a DoRA forward and two reference launches, host µs per call."""
    from peft.tuners.lora import dora, dora_fused

    model = build("dora", mode, 1024, 1024, 64, device)
    layer = model.base_model.model[0]
    w = layer.base_layer.weight
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    s = layer.scaling["default"]
    out = {"norm_us": host_loop(lambda: dora.factored_row_norm(w, a, b, s), n)}
    w_sq = dora.row_sq_norm(w)
    out["norm_cached_w_sq_us"] = host_loop(lambda: dora.factored_row_norm(w, a, b, s, w_sq=w_sq), n)
    mag = layer.lora_magnitude_vector["default"].weight
    norm = dora.factored_row_norm(w, a, b, s)
    result = torch.randn(64, 1024, device=device, dtype=torch.bfloat16, requires_grad=True)
    lora = torch.randn(64, 1024, device=device, dtype=torch.bfloat16)

    def output():
        fresh = lora.clone().requires_grad_() * 1
        strides = dora_fused._output_layout(result, fresh, None, mag, norm)
        return dora_fused._fused_output(result, fresh, mag, norm, s, 1e-6, None, strides)

    out["clone_mul_us"] = host_loop(lambda: lora.clone().requires_grad_() * 1, n)
    out["output_launch_us"] = host_loop(output, n) - out["clone_mul_us"]
    t = torch.zeros(1024, device=device)
    out["torch_add_us"] = host_loop(lambda: t.add_(1.0), n)
    out["forward_norm_train_us"] = host_loop(
        lambda: layer.lora_magnitude_vector["default"]._forward_norm(w, a, b, s, "default"), n
    )
    return out


def gpu_breakdown(impl: str, mode: str, device) -> dict:
    """Kernel time by kernel name for one training forward + backward and one inference forward of the up
    projection (4096 -> 14336, r = 384, 4096 tokens), from torch.profiler (ms, summed over the kernels)."""
    from torch.profiler import ProfilerActivity, profile

    model = build(impl, mode, 4096, 14336, 384, device)
    ctx = precision(mode, device)
    x = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    gy = torch.randn(4096, 14336, device=device, dtype=torch.bfloat16)
    res = {}
    for phase in ("train", "infer"):
        model.train(phase == "train")

        def run():
            with ctx, torch.set_grad_enabled(phase == "train"):
                y = model(x)
            if phase == "train":
                y.backward(gy)

        for _ in range(3):
            run()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                run()
            torch.cuda.synchronize()
        kernels = collections.Counter()
        for evt in prof.key_averages():
            t = getattr(evt, "self_device_time_total", 0)
            if t > 0:
                kernels[evt.key[:90]] += t / 5 / 1000
        res[phase] = {"total_ms": sum(kernels.values()), "kernels_ms": dict(kernels.most_common(25))}
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            run()
        torch.cuda.synchronize()
        res[phase]["wall_ms"] = (time.perf_counter() - t0) * 100
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--skip-gpu", action="store_true")
    args = p.parse_args()
    device = torch.device("cuda")
    import peft

    res = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "peft": peft.__version__,
        "iters": args.iters,
        "rounds": args.rounds,
        "modes": {},
    }
    for mode in ("autocast", "bf16"):
        m = res["modes"][mode] = {}
        m.update(host_rounds(mode, args.iters, args.rounds, device))
        for impl in ("lora", "dora"):
            print(mode, impl, json.dumps(m[impl]), flush=True)
        m["dora_minus_lora_us"] = {k: m["dora"][k] - m["lora"][k] for k in m["lora"]}
        pieces = [host_pieces(mode, args.iters, device) for _ in range(args.rounds)]
        m["dora_pieces"] = {k: min(p[k] for p in pieces) for k in pieces[0]}
        print(mode, "pieces", json.dumps(m["dora_pieces"]), flush=True)
        if not args.skip_gpu:
            m["gpu_up_proj"] = {impl: gpu_breakdown(impl, mode, device) for impl in ("lora", "dora")}
            for impl in ("lora", "dora"):
                g = m["gpu_up_proj"][impl]
                print(mode, impl, "gpu", {k: (round(v["total_ms"], 3), round(v["wall_ms"], 3)) for k, v in g.items()})
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
