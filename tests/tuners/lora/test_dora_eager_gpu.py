"""The eager tier on a CUDA GPU: tensor-core norm precision, parity with upstream, memory, ephemeral offload.

Run on the GPU machine with ``pytest -m gpu``.
"""

import pytest
import torch
from dora_testing import to_upstream
from test_dora_norm import dense_norm_fp64, make
from test_dora_parity import build, inputs_for, max_err, run

from peft import LoraConfig, LoraRuntimeConfig, get_peft_model
from peft.tuners.lora import dora


pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("d_out,d_in,r", [(4096, 4096, 384), (1024, 14336, 768), (14336, 4096, 64), (123, 3000, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fused", ["0", None], ids=["torch_norm", "triton_norm"])
def test_cuda_norm_matches_fp64(d_out, d_in, r, dtype, fused, dora_env):
    dora_env("PEFT_DORA_FUSED", fused)
    weight, lora_A, lora_B = make(d_out, d_in, r, dtype, seed=3)
    scale = 0.5
    got = dora.factored_row_norm(weight.cuda(), lora_A.cuda(), lora_B.cuda(), scale).cpu()
    ref = dense_norm_fp64(weight, lora_A, lora_B, scale)
    rel = ((got.double() - ref).abs() / ref).max().item()
    # fp32 W: fp32 matmuls (TF32 stays as the user set it; off by default), or the kernel's 3-pass TF32 products.
    # Half W: tensor-core products with fp32 accumulation (A rounded to the weight dtype, or TF32 in the kernel),
    # ‖s·B·A‖ ≈ 0.1‖W‖.
    print(f"max rel err {rel:.2e} ({'torch' if fused else 'triton'} norm, {dtype})")
    bound = 1e-5 if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32 else 2e-4
    assert rel <= bound, rel


@pytest.mark.parametrize("kind", ["linear", "gpt2_conv1d", "embedding", "conv2d"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_half_precision_at_least_as_accurate_as_upstream(kind, dtype):
    ours = build(kind, bias=True, dropout=0.0).to("cuda", dtype)
    theirs = to_upstream(ours)
    reference = to_upstream(ours).double()
    inputs = tuple(x.cuda() for x in inputs_for(ours, kind, dtype))
    out_o, grads_o = run(ours, inputs)
    out_u, grads_u = run(theirs, inputs)
    out_r, grads_r = run(reference, tuple(x.double() if x.is_floating_point() else x for x in inputs))
    scale = out_r.abs().max().item()
    assert max_err(out_o, out_r) <= 2 * max_err(out_u, out_r) + 1e-2 * scale
    for name in grads_o:
        ref = grads_r[name]
        assert max_err(grads_o[name], ref) <= 2 * max_err(grads_u[name], ref) + 1e-2 * ref.abs().max().item(), name


class _FixedDropout(torch.nn.Module):
    """LoRA dropout whose mask depends on the input's shape only: the same in ours, upstream's and the fp64 model."""

    def forward(self, x):
        gen = torch.Generator().manual_seed(x.numel())
        keep = (torch.rand(x.shape, generator=gen) >= 0.3).to(x.device, x.dtype)
        return x * keep / 0.7


def _fix_dropout(model):
    for module in model.modules():
        if hasattr(module, "lora_dropout"):
            for name in list(module.lora_dropout.keys()):
                module.lora_dropout[name] = _FixedDropout()
    return model


@pytest.mark.parametrize("kind", ["linear", "gpt2_conv1d"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_dropout_training_at_least_as_accurate_as_upstream(kind, dtype):
    """LoRA dropout (upstream's semantics) in training: the output's node with W·dropout(x) as an input of its own
    (``DoraLinearLayer.dropout_output``), against upstream's composition and an fp64 run of the same weights."""
    ours = _fix_dropout(build(kind, bias=True, dropout=0.3).to("cuda", dtype))
    theirs = _fix_dropout(to_upstream(ours))
    reference = _fix_dropout(to_upstream(ours).double())
    inputs = tuple(x.cuda() for x in inputs_for(ours, kind, dtype))
    dora.tier_counts.clear()
    out_o, grads_o = run(ours, inputs)
    assert dora.tier_counts[dora.TIER_FUSED_BACKWARD] > 0 and dora.tier_counts[dora.TIER_EAGER] == 0
    out_u, grads_u = run(theirs, inputs)
    out_r, grads_r = run(reference, tuple(x.double() if x.is_floating_point() else x for x in inputs))
    scale = out_r.abs().max().item()
    assert max_err(out_o, out_r) <= 2 * max_err(out_u, out_r) + 1e-2 * scale
    assert grads_o.keys() == grads_u.keys()
    for name in grads_o:
        ref = grads_r[name]
        assert max_err(grads_o[name], ref) <= 2 * max_err(grads_u[name], ref) + 1e-2 * ref.abs().max().item(), name


def test_norm_transient_memory_within_budget():
    d_out, d_in, r = 4096, 14336, 384
    weight = torch.randn(d_out, d_in, device="cuda", dtype=torch.bfloat16)
    lora_A = torch.randn(r, d_in, device="cuda") * 0.01
    lora_B = torch.randn(d_out, r, device="cuda") * 0.01
    budget = 16 << 20
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    dora.factored_row_norm(weight, lora_A, lora_B, 0.5, chunk_bytes=budget)
    torch.cuda.synchronize()
    transient = torch.cuda.max_memory_allocated() - before
    # U (split: [d_out, 2r] and a chunk's product), B·G, B's hi/lo copies and the row dot: O(d_out·r), rank-dependent
    rank_sized = 6 * d_out * r * 4
    assert transient <= budget + rank_sized, transient / 2**20


def test_dora_layer_peak_memory_below_upstream():
    # One 4096x4096 bf16 layer, r=384: upstream materialises eye(d_in), B·A and W + s·B·A; ours does not.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4096, 4096, bias=False)).to("cuda", torch.bfloat16)
    config = LoraConfig(target_modules=["0"], use_dora=True, r=384, lora_alpha=192, init_lora_weights=False)
    ours = get_peft_model(model, config).to(torch.bfloat16)
    theirs = to_upstream(ours)
    x = torch.randn(2, 512, 4096, device="cuda", dtype=torch.bfloat16)

    def peak(m):
        m.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        m(x).float().sum().backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before

    peak(ours), peak(theirs)  # warm-up
    ours_peak, theirs_peak = peak(ours), peak(theirs)
    dense = 4096 * 4096 * 2  # one bf16 weight-sized temporary
    assert ours_peak + 2 * dense <= theirs_peak, (ours_peak / 2**20, theirs_peak / 2**20)


def test_ephemeral_gpu_offload_computes_on_gpu_and_keeps_magnitude_on_cpu():
    config = LoraConfig(
        target_modules=["0"],
        use_dora=True,
        init_lora_weights=False,
        runtime_config=LoraRuntimeConfig(ephemeral_gpu_offload=True),
    )
    reference = LoraConfig(target_modules=["0"], use_dora=True, init_lora_weights=False)
    torch.manual_seed(1)
    offloaded = get_peft_model(torch.nn.Sequential(torch.nn.Linear(64, 48)).requires_grad_(False), config)
    torch.manual_seed(1)
    plain = get_peft_model(torch.nn.Sequential(torch.nn.Linear(64, 48)).requires_grad_(False), reference)
    mag_o = offloaded.base_model.model[0].lora_magnitude_vector["default"].weight
    mag_p = plain.base_model.model[0].lora_magnitude_vector["default"].weight
    assert mag_o.device.type == "cpu"
    torch.testing.assert_close(mag_o, mag_p, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "d_out,d_in,r", [(4096, 4096, 768), (14336, 4096, 384), (4096, 14336, 384), (14336, 4096, 16), (28672, 4096, 64)]
)
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("path", ["torch", "split", "auto"])
def test_autocast_norm_fp32_adapters_within_1e5(d_out, d_in, r, w_dtype, path, dora_env):
    """PEFT's autocast default (half W, fp32 A and B): W·Aᵀ against A's hi/lo parts keeps the norm within 1e-5 of
    fp64 for realistic adapters (‖s·B·A‖ = 0.1‖W‖); rounding A alone measured up to 1.1e-5. ``torch``: the PyTorch
    form (PEFT_DORA_NORM_KERNEL=0); ``split``: cuBLAS products and one epilogue kernel with a kept ``||W||²``, called
    directly; ``auto``: what the default takes (the one-pass kernel's bf16 hi/lo products up to rank 32, else split)."""
    from test_dora_norm_triton_gpu import SCALE, _adapter, _max_rel, _reference

    if path == "torch":
        dora_env("PEFT_DORA_NORM_KERNEL", "0")
    weight, lora_A, lora_B = _adapter(d_out, d_in, r, w_dtype, torch.float32, ratio=0.1, seed=5)
    kernel = r <= dora.dora_norm._KERNEL_MAX_RANK_MIXED and path != "torch"  # auto's rule ("split" bypasses it)
    assert dora.dora_norm._norm_kernel_applies(weight, lora_A, lora_B) == kernel
    assert dora.dora_norm._split_norm_applies(weight, lora_A, lora_B) == (path != "torch")
    if path == "split":
        w_sq = dora.dora_norm.row_sq_norm(weight)
        got = dora.dora_norm.dora_norm_triton.split_row_norm(weight, lora_A, lora_B, SCALE, w_sq, weight.shape[1])
    else:
        got = dora.factored_row_norm(weight, lora_A, lora_B, SCALE)
    rel = _max_rel(got, _reference(weight, lora_A, lora_B, SCALE))
    print(f"autocast norm ({path}) {w_dtype} {d_out}x{d_in} r={r}: max rel err {rel:.3e}")
    assert rel <= 1e-5, rel
