"""Direct Triton launches on a CUDA GPU: every kernel a DoRA layer launches is launched directly from its second
call on, and direct launches compute bitwise what Triton's own launch path computes."""

import pytest
import torch

from peft import LoraConfig, get_peft_model
from peft.tuners.lora import dora_fused, dora_launch, dora_norm
from peft.tuners.lora import dora_norm_triton as N


pytestmark = pytest.mark.gpu

KERNELS = {
    "output": lambda: dora_fused._output_kernel,
    "backward": lambda: dora_fused._backward_kernel,
    "column_sum": lambda: dora_fused._column_sum_kernel,
    "split": lambda: N._hi_lo_kernel,
    "epilogue": lambda: N._norm_epilogue_kernel,
    "one_pass_norm": lambda: N._row_norm_partial_kernel,
}


def _model(adapter_dtype, seed=0, r=64):
    torch.manual_seed(seed)
    base = torch.nn.Sequential(torch.nn.Linear(1024, 3072, bias=True)).to("cuda", torch.bfloat16)
    config = LoraConfig(r=r, lora_alpha=32, target_modules=["0"], use_dora=True, init_lora_weights=False)
    model = get_peft_model(base, config)
    return model.to(adapter_dtype) if adapter_dtype == torch.bfloat16 else model


def _step(model, x, gy, autocast):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        y = model(x)
    y.backward(gy)
    grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    return y.detach().clone(), grads


@pytest.mark.parametrize("adapters,r", [("fp32_autocast", 64), ("fp32_autocast", 16), ("bf16", 16), ("bf16", 128)])
def test_direct_launches_match_triton_s_launches(adapters, r):
    """fp32 adapters above ``_KERNEL_MAX_RANK_MIXED`` and half ones above ``_KERNEL_MAX_RANK`` take the split norm (its
    split and epilogue kernels around cuBLAS), smaller ranks the one-pass norm kernel."""
    assert dora_launch._direct[0], "the direct path is off on this GPU (Triton's launcher API differs?)"
    autocast = adapters == "fp32_autocast"
    model = _model(torch.float32 if autocast else torch.bfloat16, r=r)
    x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    gy = torch.randn(4096, 3072, device="cuda", dtype=torch.bfloat16)
    for k in KERNELS.values():
        k()._cache.clear()
    first = _step(model, x, gy, autocast)  # every signature new: Triton's path
    used = [name for name, k in KERNELS.items() if k()._cache]
    split = r > (dora_norm._KERNEL_MAX_RANK_MIXED if autocast else dora_norm._KERNEL_MAX_RANK)
    expected = {"output", "backward", "column_sum"} | ({"split", "epilogue"} if split else {"one_pass_norm"})
    assert set(used) == expected, used
    second = _step(model, x, gy, autocast)  # the same signatures: direct
    assert torch.equal(first[0], second[0])
    for a, b in zip(first[1], second[1]):
        assert torch.equal(a, b)


def test_direct_launch_follows_the_current_device_and_stream():
    model = _model(torch.float32)
    x = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.autocast("cuda", dtype=torch.bfloat16), torch.no_grad():
        model.eval()
        want = model(x)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            got = model(x)
        torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(want, got)
