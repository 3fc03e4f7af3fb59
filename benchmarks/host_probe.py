"""Where the host time of one fused compose call goes (tiny tensors, so the GPU idles): a torch op, Triton's own
launcher, our checks. Usage on the GPU machine: python benchmarks/host_probe.py"""

import torch
import triton
from bench_kernels import host_us

import peft.tuners.lora.dora_fused as F


def main():
    print(F.__file__, "torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())
    lora = torch.randn(1, 64, device="cuda", dtype=torch.bfloat16)
    base = torch.randn_like(lora)
    g = 1 + 0.05 * torch.randn(64, device="cuda")
    out = torch.empty_like(lora)
    args = (lora, base, g, out, out, 1, 64, 64, 64, 64, 64, 0.5)
    options = dict(WRITE_INNER=False, BLOCK_M=1, BLOCK_N=64, num_warps=4, enable_fp_fusion=False)
    cases = {
        "torch.empty_like": lambda: torch.empty_like(lora),
        "lora.add(base) (one torch op)": lambda: lora.add(base),
        "_layout": lambda: F._layout(lora, base, g),
        "_policy": lambda: F._policy(1, 64),
        "raw kernel[grid] launch": lambda: F._compose_kernel[(1,)](*args, **options),
        "fused_dora_compose inplace=False": lambda: F.fused_dora_compose(lora, base, g, 0.5, inplace=False),
        "fused_dora_compose inplace=True": lambda: F.fused_dora_compose(lora, base, g, 0.5, inplace=True),
        "_compose_torch": lambda: F._compose_torch(lora, base, g, 0.5),
    }
    for name, fn in cases.items():
        print(f"{name:40s} {host_us(fn)['median_us']:7.2f} us")


if __name__ == "__main__":
    main()
