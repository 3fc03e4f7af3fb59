"""Decode-shape cost of one adapted Linear (4096 x 4096, r = 384, 1 token, eval, no_grad) on the GPU machine: plain LoRA
against our DoRA with the default tiers, without the small-input path, eager, and without norm reuse; µs per call
(loop, host issue and CUDA events) plus a cProfile split, then the pieces of the composition alone.

    PYTHONPATH=<our install> python benchmarks/decode_host.py     # writes $OUT/decode_host.json (or /tmp)
"""

import cProfile
import functools
import io
import json
import os
import pstats
import sys
import time

import torch
from torch import nn


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import loop_us  # noqa: E402

import peft  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from peft.tuners.lora import dora  # noqa: E402
from peft.tuners.lora import dora_fused as F  # noqa: E402


print(peft.__file__, torch.__version__, torch.cuda.get_device_name(), flush=True)
out = {}


def build(dora_on, mode, d_out=4096, d_in=4096, r=384):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(d_in, d_out, bias=False)).to("cuda", torch.bfloat16)
    cfg = LoraConfig(
        r=r, lora_alpha=r / 2, use_rslora=True, use_dora=dora_on, target_modules=["0"], init_lora_weights=False
    )
    m = get_peft_model(base, cfg, autocast_adapter_dtype=(mode == "autocast"))
    if mode == "bf16":
        m = m.to(torch.bfloat16)
    return m.eval()


def ctx(mode):
    return torch.autocast("cuda", dtype=torch.bfloat16) if mode == "autocast" else torch.autocast("cuda", enabled=False)


sync = torch.cuda.synchronize
for mode in ("autocast", "bf16"):
    for name, dora_on, env in (
        ("lora", False, {}),
        ("dora_default", True, {}),
        ("dora_no_small", True, {"PEFT_DORA_NORM_CACHE": "1", "SMALL": "0"}),
        ("dora_eager", True, {"PEFT_DORA_FUSED": "0"}),
        ("dora_nocache", True, {"PEFT_DORA_NORM_CACHE": "0"}),
    ):
        for k in ("PEFT_DORA_FUSED", "PEFT_DORA_NORM_CACHE"):
            os.environ.pop(k, None)
        os.environ.update(env)
        dora._invalidate_fused_cache()
        dora._SMALL_FORWARD_NUMEL = 0 if env.get("SMALL") == "0" else 1 << 20
        model = build(dora_on, mode)
        x = torch.randn(1, 1, 4096, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad(), ctx(mode):
            fn = functools.partial(model.base_model.model[0], x)
            res = loop_us(fn, sync, 20, 7, 200)
            # GPU time per call: CUDA events around 200 calls (host-bound if close to host)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(200):
                fn()
            e.record()
            e.synchronize()
            res["events_us"] = s.elapsed_time(e) / 200 * 1e3
            # host only: time of issuing 200 calls, no sync inside
            t0 = time.perf_counter()
            for _ in range(200):
                fn()
            res["issue_us"] = (time.perf_counter() - t0) / 200 * 1e6
            sync()
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(300):
                fn()
            pr.disable()
            sync()
        sio = io.StringIO()
        pstats.Stats(pr, stream=sio).strip_dirs().sort_stats("tottime").print_stats(25)
        res["cprofile_top"] = sio.getvalue()[-6000:]
        res["tiers"] = dict(dora.tier_counts)
        res["norm_counts"] = dict(dora.norm_counts)
        dora.tier_counts.clear(), dora.norm_counts.clear()
        out[f"{mode}/{name}"] = res
        print(
            f"{mode:8s} {name:14s} loop {res['median']:7.1f} us  issue {res['issue_us']:7.1f} us  "
            f"events {res['events_us']:7.1f} us",
            flush=True,
        )
        del model, fn
        torch.cuda.empty_cache()

# pieces of the DoRA decode path (bf16)
os.environ.pop("PEFT_DORA_FUSED", None)
os.environ.pop("PEFT_DORA_NORM_CACHE", None)
dora._invalidate_fused_cache()

lora = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
result = torch.randn_like(lora)
mag = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 1
norm = torch.rand(4096, device="cuda") + 1
g = (mag / norm).to(torch.bfloat16)
strides = F._output_layout(result, lora, None, mag, norm)
pieces = {
    "torch mul_ (one op)": lambda: result.mul_(1.0),
    "torch addcmul_ (one op)": lambda: result.addcmul_(lora, g),
    "_output_layout": lambda: F._output_layout(result, lora, None, mag, norm),
    "_output_triton raw": lambda: F._output_triton(result, lora, None, mag, norm, 0.5, 1e-6, lora, None, strides),
    "_fused_output": lambda: F._fused_output(result, lora, mag, norm, 0.5, 1e-6, None, strides),
    "torch compose mul_+addcmul_": lambda: result.mul_(g).addcmul_(lora, g),
}
with torch.no_grad():
    for k, fn in pieces.items():
        r = loop_us(fn, sync, 20, 7, 300)
        out[f"piece/{k}"] = r
        print(f"{k:34s} {r['median']:7.2f} us", flush=True)

with open(os.path.join(os.environ.get("OUT", "/tmp"), "decode_host.json"), "w") as f:
    json.dump(out, f, indent=1)
for k, v in out.items():
    if "cprofile_top" in v and ("dora_default" in k or "lora" in k) and "bf16" in k:
        print(k, v["cprofile_top"][:4000])
