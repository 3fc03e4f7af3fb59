"""Kernel-vs-twin cases for the Triton interpreter; `test_dora_fused_kernels.py` runs this file in a child process
with TRITON_INTERPRET=1 (Triton fixes interpretation when a kernel is decorated, i.e. when peft is first imported).

Run directly: TRITON_INTERPRET=1 python -m pytest tests/tuners/lora/dora_kernel_cases.py -q
"""

import pytest
import torch
from dora_testing import assert_close

from peft.tuners.lora import dora_fused as F


if not F.kernels_available(torch.empty(0)):
    raise RuntimeError("dora_kernel_cases.py needs TRITON_INTERPRET=1 set before peft is imported")

TOKENS = (0, 1, 7, 33)
D_OUT = (1, 5, 123, 130)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SCALE = 0.75


def _inputs(tokens, d_out, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed * 1000 + tokens * 131 + d_out)
    lora = torch.randn(tokens, d_out, generator=gen).to(dtype)
    base = torch.randn(tokens, d_out, generator=gen).to(dtype)
    g = 1.0 + 0.01 * torch.randn(d_out, generator=gen)  # fp32 magnitude scale close to 1, as in training
    return lora, base, g


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d_out", D_OUT)
@pytest.mark.parametrize("tokens", TOKENS)
def test_compose_and_forward_inner(tokens, d_out, dtype):
    lora, base, g = _inputs(tokens, d_out, dtype)
    expected = F._compose_torch(lora, base, g, SCALE)
    out = F.fused_dora_compose(lora, base, g, SCALE, inplace=False)
    assert out.dtype == dtype and out.shape == lora.shape
    assert_close(out, expected)
    out_ref, inner_ref = F._forward_and_inner_torch(lora, base, g, SCALE)
    out2, inner = F.fused_dora_forward_and_inner(lora, base, g, SCALE)
    assert_close(out2, out_ref)
    assert_close(inner, inner_ref)
    torch.testing.assert_close(out2, out, rtol=0, atol=0)  # one kernel body: both entry points agree bitwise
    in_place = F.fused_dora_compose(lora, base, g.view(1, -1), SCALE, inplace=True)
    assert in_place.data_ptr() == lora.data_ptr()
    torch.testing.assert_close(in_place, out, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d_out", D_OUT)
@pytest.mark.parametrize("tokens", TOKENS)
def test_backward(tokens, d_out, dtype):
    lora, base, g = _inputs(tokens, d_out, dtype, seed=1)
    d_out_t = torch.randn(tokens, d_out).to(dtype)
    inner = F._forward_and_inner_torch(lora, base, g, SCALE)[1]
    got = F._fused_backward(d_out_t, inner, g, SCALE, True, True, True)
    want = F._backward_torch(d_out_t, inner, g, SCALE, True, True, True)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert_close(a, b, dtype=dtype)
    only_mag = F._fused_backward(d_out_t, inner, g, SCALE, False, False, True)
    assert only_mag[0] is None and only_mag[1] is None
    torch.testing.assert_close(only_mag[2], got[2], rtol=0, atol=0)


@pytest.mark.parametrize("tokens", (1, 300))
def test_d_mag_is_bitwise_repeatable(tokens):
    lora, base, g = _inputs(tokens, 130, torch.bfloat16, seed=2)
    d_out_t = torch.randn(tokens, 130).to(torch.bfloat16)
    runs = [F._fused_backward(d_out_t, base, g, SCALE, False, False, True)[2] for _ in range(3)]
    for r in runs[1:]:
        assert torch.equal(r.view(torch.int32), runs[0].view(torch.int32))


def test_strided_rows_and_3d():
    """A column slice (row stride > d_out) and a [batch, seq, d_out] activation run in the kernel, not the twin."""
    full = torch.randn(2, 9, 200)
    lora, base, g = full[..., 10:133], torch.randn(2, 9, 123), 1 + 0.01 * torch.randn(1, 123)
    assert F.kernels_support(lora, base, g)
    assert_close(F.fused_dora_compose(lora, base, g, SCALE, inplace=False), F._compose_torch(lora, base, g, SCALE))
    expected = F._compose_torch(lora, base, g, SCALE)
    F.fused_dora_compose(lora, base, g, SCALE, inplace=True)
    assert_close(full[..., 10:133], expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", (1, 5, 123, 300))
def test_norm_assembly(n, dtype):
    gen = torch.Generator().manual_seed(n)
    w_sq = torch.rand(n, generator=gen).to(dtype)
    cross = torch.randn(n, generator=gen).to(dtype)
    ba_sq = torch.rand(n, generator=gen).to(dtype)
    cross[0] = -10.0  # negative total: clamped to 0
    if n > 2:
        cross[1], ba_sq[2] = float("nan"), float("inf")
    (got,) = F.fused_norm_assembly(w_sq, cross, ba_sq, 0.5)
    want = F._norm_assembly_torch(w_sq, cross, ba_sq, 0.5)
    assert got.dtype == dtype
    assert_close(got, want, dtype=dtype, equal_nan=True)  # NaN and Inf in the same places


def test_autograd_function_matches_twin_gradients():
    lora, base, g = _inputs(7, 130, torch.float32, seed=3)
    leaves = [t.clone().requires_grad_() for t in (lora, base, g)]
    ref_leaves = [t.clone().requires_grad_() for t in (lora, base, g)]
    F.fused_dora_compose_autograd(*leaves, SCALE).square().sum().backward()
    F._compose_torch(*ref_leaves, SCALE).square().sum().backward()
    for a, b in zip(leaves, ref_leaves):
        assert_close(a.grad, b.grad)
