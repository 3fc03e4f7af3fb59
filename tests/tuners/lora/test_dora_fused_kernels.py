"""The fused DoRA kernels on CPU: the layout rules here, every kernel against its twin under the Triton interpreter
(dora_kernel_cases.py, in a child process), and the torch.compile op through opcheck."""

from pathlib import Path

import pytest
import torch
from dora_testing import run_under_interpreter

from peft.tuners.lora import dora_dispatch as dispatch
from peft.tuners.lora import dora_fused as F


pytest.importorskip("triton", reason="the fused kernels need Triton (pip install triton)")

HERE = Path(__file__).resolve().parent


def test_kernels_against_twins_under_interpreter():
    run_under_interpreter(HERE / "dora_kernel_cases.py")


def test_model_parity_with_upstream_under_interpreter():
    """test_dora_parity's comparisons with upstream PEFT again, with the fused tiers (the one-pass output kernel)
    interpreted: on CPU without the interpreter they run the eager tier."""
    run_under_interpreter(HERE / "test_dora_parity.py", "-k", "upstream or zero_tokens or activation_dtype")


@pytest.mark.parametrize(
    "lora_shape, g_shape, ok",
    [
        ((7, 123), (123,), True),
        ((2, 7, 123), (1, 123), True),
        ((123,), (123,), True),
        ((123,), (1, 123), False),  # the twin would broadcast the output to [1, 123]
        ((2, 4, 3, 3), (1, 4, 1, 1), False),  # Conv-style: g scales a middle dimension
        ((7, 123), (7, 123), False),
        ((7, 123), (61,), False),
    ],
)
def test_kernels_support_broadcast_rule(lora_shape, g_shape, ok):
    lora, base = torch.randn(lora_shape), torch.randn(lora_shape)
    assert dispatch.kernels_support(lora, base, torch.rand(g_shape)) is ok


def test_kernels_support_layout_rules():
    x, g = torch.randn(6, 8), torch.rand(8)
    assert not dispatch.kernels_support(x.t().contiguous().t(), x, g)  # column-major
    assert not dispatch.kernels_support(x, x.half(), g)  # mixed activation dtypes
    assert not dispatch.kernels_support(x.double(), x.double(), g)  # fp64 stays in PyTorch
    assert not dispatch.kernels_support(x, x, torch.rand(16)[::2])  # strided g
    assert not dispatch.kernels_support(x[:, None, :].expand(6, 3, 8), torch.randn(6, 3, 8), g)  # overlapping rows
    assert dispatch.kernels_support(torch.randn(6, 20)[:, 4:12], x, g)  # a column slice reads as rows


def _branch(tokens=5, rank=3, d_out=11, dtype=torch.bfloat16):
    a = torch.randn(2, tokens, rank, dtype=dtype)
    result = torch.randn(2, tokens, d_out, dtype=dtype)
    return a, result, torch.randn(d_out, rank, dtype=dtype), torch.rand(d_out)


def test_branch_node_stride_accepts_rows_and_returns_results_row_stride():
    a, result, b, m = _branch()
    assert dispatch.branch_node_stride(a, result, b, m, None) == 11
    wide = torch.randn(2, 5, 16, dtype=torch.bfloat16)[..., :11]  # rows of a wider buffer
    assert dispatch.branch_node_stride(a, wide, b, m, None) == 16
    assert dispatch.branch_node_stride(a, result, b, m, torch.rand(11, dtype=torch.bfloat16)) == 11
    with torch.autocast("cpu", dtype=torch.bfloat16):  # fp32 B computed in autocast's dtype
        assert dispatch.branch_node_stride(a, result, b.float(), m, None) == 11


@pytest.mark.parametrize(
    "case",
    [
        "b_dtype_without_autocast", "result_dtype", "a_int", "rank", "d_out", "tokens", "magnitude_shape",
        "magnitude_stride", "magnitude_dtype", "bias_grad", "bias_shape", "result_columns", "a_scalar",
    ],
)  # fmt: skip
def test_branch_node_stride_rejects_what_the_node_cannot_compute(case):
    """Each case goes to the separate nodes (None), where F.linear raises its own errors or PyTorch composes."""
    a, result, b, m = _branch()
    bias = None
    if case == "b_dtype_without_autocast":
        b = b.float()  # F.linear would raise: the node must not compute it in a's dtype
    elif case == "result_dtype":
        result = result.half()  # neither a's dtype nor a wider fp32 result (dispatch.wider_result)
    elif case == "a_int":
        a = a.to(torch.int32)
    elif case == "rank":
        b = torch.randn(11, 4, dtype=torch.bfloat16)
    elif case == "d_out":
        result = torch.randn(2, 5, 12, dtype=torch.bfloat16)
    elif case == "tokens":
        result = torch.randn(2, 6, 11, dtype=torch.bfloat16)
    elif case == "magnitude_shape":
        m = torch.rand(1, 11)
    elif case == "magnitude_stride":
        m = torch.rand(22)[::2]
    elif case == "magnitude_dtype":
        m = torch.rand(11).to(torch.float64)
    elif case == "bias_grad":
        bias = torch.rand(11, dtype=torch.bfloat16, requires_grad=True)
    elif case == "bias_shape":
        bias = torch.rand(12, dtype=torch.bfloat16)
    elif case == "result_columns":
        result = torch.randn(2, 11, 5, dtype=torch.bfloat16).transpose(1, 2)  # unit column stride missing
    elif case == "a_scalar":
        a = torch.tensor(1.0, dtype=torch.bfloat16)
    assert dispatch.branch_node_stride(a, result, b, m, bias) is None


def test_branch_node_takes_a_wider_fp32_result_or_branch():
    """bitsandbytes under autocast: an fp32 result (the fp32 hidden states) beside the bf16 branch; PEFT's default
    fp32 adapters beside a bf16 base without autocast: a bf16 result beside the fp32 branch. The node writes an fp32
    output either way (PyTorch's promotion); two half dtypes it leaves alone."""
    a, result, b, m = _branch()
    assert dispatch.branch_node_stride(a, result.float(), b, m, None) == result.shape[-1]
    assert dispatch.branch_node_stride(a.float(), result, b.float(), m, None) == result.shape[-1]
    assert dispatch.branch_node_stride(a.half(), result, b.half(), m, None) is None
    assert dispatch.mixed_output(torch.bfloat16, torch.float32) and dispatch.mixed_output(torch.float32, torch.float16)
    assert not dispatch.mixed_output(torch.bfloat16, torch.float16)


def test_norm_operand_rules():
    m = torch.rand(11)
    assert dispatch.norm_operand(torch.rand(11), m)
    assert not dispatch.norm_operand(torch.rand(11, dtype=torch.float64), m)
    assert not dispatch.norm_operand(torch.rand(12), m)
    assert not dispatch.norm_operand(torch.rand(22)[::2], m)


def test_kernels_need_cuda_outside_the_interpreter():
    assert F.kernels_available(torch.empty(1)) is (F.HAS_TRITON and dispatch.INTERPRET)


def test_launch_policy_is_bucketed():
    assert F._policy(1000, 4096) == F._policy(1024, 4095)
    block_m, block_n, _ = F._policy(1, 14336)
    assert block_m == 1 and block_n <= 1024
    for rows, cols in ((1, 1), (7, 5), (33000, 14336)):
        block_m, block_n, warps = F._policy(rows, cols)
        assert block_m * block_n <= 4096 and warps in (1, 2, 4, 8)


@pytest.mark.parametrize("g_shape", [(7,), (1, 7)])
@pytest.mark.parametrize("g_grad", [True, False])
def test_custom_op_opcheck(g_shape, g_grad):
    lora = torch.randn(4, 7, requires_grad=True)
    base = torch.randn(4, 7, requires_grad=True)
    g = (1 + 0.1 * torch.rand(g_shape)).requires_grad_(g_grad)
    torch.library.opcheck(torch.ops.peft.fused_dora_compose.default, (lora, base, g, 0.5))


def test_compiled_autograd_entry_point_has_no_graph_break():
    def f(lora, base, g):
        return F.fused_dora_compose_autograd(lora, base, g, 0.5)

    lora, base = torch.randn(4, 7, requires_grad=True), torch.randn(4, 7)
    g = (1 + 0.1 * torch.rand(7)).requires_grad_()
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(lora, base, g)
    out.sum().backward()
    ref_leaves = [t.detach().clone().requires_grad_() for t in (lora, g)]
    F.compose_torch(ref_leaves[0], base, ref_leaves[1], 0.5).sum().backward()
    torch.testing.assert_close(lora.grad, ref_leaves[0].grad)
    torch.testing.assert_close(g.grad, ref_leaves[1].grad)


def test_broadcasts_to_is_torch_broadcast_shapes_without_its_host_cost():
    """``compose_torch`` composes in place only where base and g broadcast to the LoRA output's own shape; the cheap
    check must agree with ``torch.broadcast_shapes`` everywhere, failures to broadcast included."""
    import itertools

    shapes = [()] + [s for n in (1, 2, 3) for s in itertools.product((1, 2, 3), repeat=n)]
    for target, a, b in itertools.product(shapes, shapes, ((), (1,), (3,), (2, 1))):
        try:
            expected = torch.broadcast_shapes(target, a, b) == torch.Size(target)
        except RuntimeError:
            expected = False
        assert F.broadcasts_to(torch.Size(target), torch.Size(a), torch.Size(b)) == expected, (target, a, b)
