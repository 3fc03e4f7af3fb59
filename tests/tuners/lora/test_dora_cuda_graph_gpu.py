"""A DoRA model's inference forward captured in a CUDA graph: replays give the eager result for fresh inputs.

Run on the GPU machine with ``pytest -m gpu``.
"""

import pytest
import torch
from torch import nn

from peft import LoraConfig, get_peft_model
from peft.tuners.lora import dora, dora_dispatch


pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("norm_cache", [None, "1"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dora_forward_replays_from_a_cuda_graph(dora_switches, dora_env, monkeypatch, norm_cache, dtype):
    dora_env("PEFT_DORA_NORM_CACHE", norm_cache)
    # a capture takes the kernel, not the decode-size PyTorch path; eager forwards here do too, for bitwise checks
    monkeypatch.setattr(dora_dispatch, "SMALL_FORWARD_NUMEL", 0)
    dora_switches(decode_kernels=False)  # nor the decode launches (their own matmuls)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 384), nn.GELU(), nn.Linear(384, 200)).to("cuda", dtype)
    config = LoraConfig(target_modules=["0", "2"], use_dora=True, init_lora_weights=False, r=16)
    peft_model = get_peft_model(model, config).to(dtype).eval()
    static_x = torch.randn(8, 256, device="cuda", dtype=dtype)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture: Triton compiles, allocator settles
            for _ in range(3):
                peft_model(static_x)
        torch.cuda.current_stream().wait_stream(side)
        dora.tier_counts.clear()
        with torch.cuda.graph(graph):
            static_y = peft_model(static_x)
        assert dora.tier_counts[dora.TIER_FUSED_FORWARD] == 2  # the Triton kernel is what the graph replays
        for _ in range(3):
            x = torch.randn_like(static_x)
            static_x.copy_(x)
            graph.replay()
            torch.cuda.synchronize()
            expected = peft_model(x)
            torch.testing.assert_close(static_y, expected, rtol=0, atol=0)
        # the graph computed its norms afresh: replays follow an in-place update of the factors, as eager does
        peft_model.base_model.model[0].lora_B["default"].weight.mul_(1.5)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(static_y, peft_model(static_x), rtol=0, atol=0)
