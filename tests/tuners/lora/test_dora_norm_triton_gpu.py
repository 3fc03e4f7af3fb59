"""The one-pass Triton row norm on a CUDA GPU against an fp64 dense reference: realistic adapters at model shapes
(TF32, 3xTF32 and native bf16 dots), adversarial adapters, a weight past 2^31 elements, odd shapes and strides,
and agreement with PyTorch's factored norm. Every test prints its max relative error.

Run on the GPU machine with ``pytest -m gpu -rP tests/tuners/lora/test_dora_norm_triton_gpu.py`` (``-rP`` or ``-s``
shows the printed errors).
"""

import pytest
import torch

from peft.tuners.lora import dora
from peft.tuners.lora import dora_norm_triton as N


pytestmark = pytest.mark.gpu

SHAPES = [(4096, 4096, 768), (14336, 4096, 384), (4096, 14336, 384), (28672, 4096, 64), (4096, 28672, 768)]
MODES = {
    "w_bf16-ab_fp32": (torch.bfloat16, torch.float32),  # autocast: TF32 dots
    "w_bf16-ab_bf16": (torch.bfloat16, torch.bfloat16),  # native bf16 dots
    "w_fp32-ab_fp32": (torch.float32, torch.float32),  # 3xTF32 dots
}
SCALE = 2.0
ROW_CHUNK = 4096  # rows per fp64 reference chunk: 4096 x 28672 fp64 is under 1 GB


@pytest.fixture(autouse=True)
def _free_memory():
    yield
    torch.cuda.empty_cache()


def _w_row_norm(weight):
    return torch.cat(
        [torch.linalg.vector_norm(weight[c : c + ROW_CHUNK].double(), dim=1) for c in range(0, len(weight), ROW_CHUNK)]
    )


def _ba_row_norm(lora_A, lora_B):
    """||B·A|| per row without forming B·A: sqrt(diag(B (A Aᵀ) Bᵀ)), in fp64."""
    a, b = lora_A.double(), lora_B.double()
    return ((b @ (a @ a.T)) * b).sum(1).clamp_min(0).sqrt()


def _adapter(d_out, d_in, r, w_dtype, ab_dtype, ratio, seed=0, weight=None):
    """W ~ N(0, 0.02²), A ~ N(0, 1/d_in), and B rescaled per row so that ||s·B·A|| = ratio·||W|| on every row."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    if weight is None:
        weight = (torch.randn(d_out, d_in, device="cuda", generator=gen) * 0.02).to(w_dtype)
    lora_A = torch.randn(r, d_in, device="cuda", generator=gen, dtype=torch.float64) / d_in**0.5
    lora_B = torch.randn(d_out, r, device="cuda", generator=gen, dtype=torch.float64)
    lora_B *= (ratio * _w_row_norm(weight) / (SCALE * _ba_row_norm(lora_A, lora_B)))[:, None]
    return weight, lora_A.to(ab_dtype), lora_B.to(ab_dtype)


def _reference(weight, lora_A, lora_B, scale, rows=None):
    """fp64 dense ||W + s·B·A|| of ``rows`` (default: all), a row chunk at a time."""
    rows = torch.arange(weight.shape[0], device=weight.device) if rows is None else rows
    a = lora_A.double()
    parts = []
    for c in range(0, rows.numel(), ROW_CHUNK):
        i = rows[c : c + ROW_CHUNK]
        parts.append(torch.linalg.vector_norm(weight[i].double() + scale * (lora_B[i].double() @ a), dim=1))
    return torch.cat(parts)


def _max_rel(got, want):
    return ((got.double() - want).abs() / want).max().item()


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("d_out, d_in, r", SHAPES)
def test_realistic_adapters_match_fp64(d_out, d_in, r, mode):
    weight, lora_A, lora_B = _adapter(d_out, d_in, r, *MODES[mode], ratio=0.1)
    got = N.triton_row_norm(weight, lora_A, lora_B, SCALE)
    assert got.dtype == torch.float32 and got.shape == (d_out,) and got.is_contiguous()
    err = _max_rel(got, _reference(weight, lora_A, lora_B, SCALE))
    print(f"realistic {mode} {d_out}x{d_in} r={r}: max rel err {err:.3e}")
    assert err <= 1e-5


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("d_out, d_in, r", SHAPES)
def test_adversarial_adapters(d_out, d_in, r, mode):
    # ||s·B·A|| ~ 10·||W||: the TF32 rounding of A and B is no longer small next to W; only reported, loosely bounded.
    weight, lora_A, lora_B = _adapter(d_out, d_in, r, *MODES[mode], ratio=10.0, seed=1)
    err = _max_rel(N.triton_row_norm(weight, lora_A, lora_B, SCALE), _reference(weight, lora_A, lora_B, SCALE))
    print(f"adversarial {mode} {d_out}x{d_in} r={r}: max rel err {err:.3e}")
    assert err <= 1e-3


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_weight_past_2_31_elements(layout):
    d_out, d_in, r = 65536, 32776, 16
    assert d_out * d_in > 2**31
    gen = torch.Generator(device="cuda").manual_seed(2)
    shape = (d_out, d_in) if layout == "contiguous" else (d_in, d_out)
    weight = torch.empty(shape, dtype=torch.bfloat16, device="cuda").normal_(0.0, 0.02, generator=gen)
    weight = weight if layout == "contiguous" else weight.t()  # column stride d_out: k·stride passes 2^31 too
    weight, lora_A, lora_B = _adapter(d_out, d_in, r, None, torch.float32, ratio=0.1, seed=3, weight=weight)
    got = N.triton_row_norm(weight, lora_A, lora_B, SCALE)
    # The first and last rows (the last ones lie wholly past element 2^31) and a random sample in between.
    sample = torch.randperm(d_out, generator=torch.Generator().manual_seed(0))[:192]
    rows = torch.cat([torch.arange(64), sample, torch.arange(-64, 0)])
    rows = rows.remainder(d_out).unique().cuda()
    err = _max_rel(got[rows], _reference(weight, lora_A, lora_B, SCALE, rows))
    print(f"past 2^31 {layout} {d_out}x{d_in} r={r}: max rel err {err:.3e} on {rows.numel()} rows")
    assert err <= 1e-5


@pytest.mark.parametrize("transposed", [False, True], ids=["w", "w_t"])
@pytest.mark.parametrize("d_out, d_in, r", [(4096, 4096, 768), (4096, 14336, 384), (14336, 4096, 16)])
def test_matches_factored_row_norm(d_out, d_in, r, transposed, dora_env):
    weight, lora_A, lora_B = _adapter(d_out, d_in, r, torch.bfloat16, torch.float32, ratio=0.1, seed=4)
    if transposed:  # stored [d_in, d_out], as a fan_in_fan_out or embedding weight reaches the norm
        weight = weight.t().contiguous().t()
    got = N.triton_row_norm(weight, lora_A, lora_B, SCALE)
    dora_env("PEFT_DORA_FUSED", "0")  # the PyTorch factored norm, not the kernel it would dispatch to
    want = dora.factored_row_norm(weight, lora_A, lora_B, SCALE)
    ref = _reference(weight, lora_A, lora_B, SCALE)
    err = _max_rel(got, want.double())
    print(
        f"vs factored_row_norm {d_out}x{d_in} r={r} transposed={transposed}: max rel diff {err:.3e} "
        f"(triton vs fp64 {_max_rel(got, ref):.3e}, factored vs fp64 {_max_rel(want, ref):.3e})"
    )
    assert err <= 1e-5


ODD_CASES = [
    # (d_out, d_in, r, W dtype, A dtype, B dtype, layout)
    (1, 5, 1, torch.float32, torch.float32, torch.float32, "contiguous"),
    (123, 3000, 33, torch.bfloat16, torch.float32, torch.float32, "transposed"),
    (4095, 14337, 70, torch.float16, torch.float16, torch.float16, "contiguous"),
    (3000, 123, 768, torch.bfloat16, torch.bfloat16, torch.float32, "transposed"),
    (14336, 4095, 384, torch.float16, torch.float32, torch.float32, "sliced"),
    (5000, 5000, 3, torch.float32, torch.bfloat16, torch.bfloat16, "sliced"),
]


@pytest.mark.parametrize("d_out, d_in, r, w_dtype, a_dtype, b_dtype, layout", ODD_CASES)
def test_odd_shapes_dtypes_and_strides(d_out, d_in, r, w_dtype, a_dtype, b_dtype, layout):
    weight, lora_A, lora_B = _adapter(d_out, d_in, r, w_dtype, torch.float64, ratio=0.1, seed=5)
    lora_A, lora_B = lora_A.to(a_dtype), lora_B.to(b_dtype)
    if layout == "transposed":
        weight, lora_A, lora_B = (t.t().contiguous().t() for t in (weight, lora_A, lora_B))
    elif layout == "sliced":  # every operand a strided window of a larger buffer
        weight = torch.zeros(d_out, 2 * d_in, dtype=w_dtype, device="cuda")[:, ::2].copy_(weight)
        lora_A = torch.zeros(2 * r, d_in, dtype=a_dtype, device="cuda")[1::2].copy_(lora_A)
        lora_B = torch.zeros(d_out, r + 5, dtype=b_dtype, device="cuda")[:, 3 : 3 + r].copy_(lora_B)
    got = N.triton_row_norm(weight, lora_A, lora_B, SCALE)
    err = _max_rel(got, _reference(weight, lora_A, lora_B, SCALE))
    print(f"odd {d_out}x{d_in} r={r} {w_dtype}/{a_dtype}/{b_dtype} {layout}: max rel err {err:.3e}")
    assert err <= 1e-5
    assert torch.equal(got, N.triton_row_norm(weight, lora_A, lora_B, SCALE))  # bitwise repeatable


def test_nan_inf_and_zero_scale():
    weight, lora_A, lora_B = _adapter(4096, 14336, 384, torch.bfloat16, torch.float32, ratio=0.1, seed=6)
    weight[3, 9000], weight[9, 0], weight[4095, 14335] = float("nan"), float("inf"), float("-inf")
    got = N.triton_row_norm(weight, lora_A, lora_B, SCALE)
    assert got[3].isnan() and got[9] == float("inf") and got[4095] == float("inf")
    finite = got.isfinite()
    assert finite.sum() == 4096 - 3
    err = _max_rel(got[finite], _reference(weight, lora_A, lora_B, SCALE)[finite])
    print(f"non-finite rows: max rel err of the others {err:.3e}")
    assert err <= 1e-5
    zero = N.triton_row_norm(weight, lora_A, lora_B, 0.0)
    want = _w_row_norm(weight)
    assert zero[3].isnan() and zero[9] == float("inf")
    assert _max_rel(zero[finite], want[finite]) <= 1e-6
    assert torch.equal(N.triton_row_norm(weight[:, :0], lora_A[:, :0], lora_B, SCALE), torch.zeros_like(got))


# ---------------------------------------------------------------------------------------------------------------
# The split path (fp32 adapters on a half W, PEFT's autocast default): hi/lo splits, three GEMMs, epilogue kernel.
# ---------------------------------------------------------------------------------------------------------------


def _split_norm(weight, lora_A, lora_B, scale=SCALE, cols=None):
    assert N.split_norm_supported(weight, lora_A, lora_B)
    w_sq = dora.row_sq_norm(weight)
    return N.split_row_norm(weight, lora_A, lora_B, scale, w_sq, cols or weight.shape[1])


@pytest.mark.parametrize("d_out, d_in, r", SHAPES)
def test_split_adversarial_adapters(d_out, d_in, r):
    # ||s·B·A|| ~ 10·||W||: only reported, loosely bounded (the Gram's hi/lo products keep ~16 bits of A).
    weight, lora_A, lora_B = _adapter(d_out, d_in, r, torch.bfloat16, torch.float32, ratio=10.0, seed=1)
    err = _max_rel(_split_norm(weight, lora_A, lora_B), _reference(weight, lora_A, lora_B, SCALE))
    print(f"split adversarial {d_out}x{d_in} r={r}: max rel err {err:.3e}")
    assert err <= 1e-4


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_split_weight_past_2_31_elements(layout):
    d_out, d_in, r = 65536, 32776, 16
    gen = torch.Generator(device="cuda").manual_seed(2)
    shape = (d_out, d_in) if layout == "contiguous" else (d_in, d_out)
    weight = torch.empty(shape, dtype=torch.bfloat16, device="cuda").normal_(0.0, 0.02, generator=gen)
    weight = weight if layout == "contiguous" else weight.t()
    weight, lora_A, lora_B = _adapter(d_out, d_in, r, None, torch.float32, ratio=0.1, seed=3, weight=weight)
    got = _split_norm(weight, lora_A, lora_B)
    sample = torch.randperm(d_out, generator=torch.Generator().manual_seed(0))[:192]
    rows = torch.cat([torch.arange(64), sample, torch.arange(-64, 0)]).remainder(d_out).unique().cuda()
    err = _max_rel(got[rows], _reference(weight, lora_A, lora_B, SCALE, rows))
    print(f"split past 2^31 {layout} {d_out}x{d_in} r={r}: max rel err {err:.3e} on {rows.numel()} rows")
    assert err <= 1e-5


SPLIT_ODD_CASES = [
    # (d_out, d_in, r, W dtype, B dtype, layout, columns per chunk)
    (1, 5, 1, torch.bfloat16, torch.float32, "contiguous", None),
    (123, 3000, 33, torch.bfloat16, torch.float32, "transposed", 1000),
    (4095, 14337, 70, torch.float16, torch.float32, "sliced", None),
    (3000, 123, 768, torch.bfloat16, torch.bfloat16, "transposed", 64),
    (14336, 4095, 384, torch.float16, torch.float16, "sliced", 4032),
    (5000, 5000, 3, torch.bfloat16, torch.float32, "sliced", None),
]


@pytest.mark.parametrize("d_out, d_in, r, w_dtype, b_dtype, layout, cols", SPLIT_ODD_CASES)
def test_split_odd_shapes_strides_and_chunks(d_out, d_in, r, w_dtype, b_dtype, layout, cols):
    weight, lora_A, lora_B = _adapter(d_out, d_in, r, w_dtype, torch.float64, ratio=0.1, seed=5)
    lora_A, lora_B = lora_A.float(), lora_B.to(b_dtype)
    if layout == "transposed":
        weight, lora_A, lora_B = (t.t().contiguous().t() for t in (weight, lora_A, lora_B))
    elif layout == "sliced":
        weight = torch.zeros(d_out, 2 * d_in, dtype=w_dtype, device="cuda")[:, ::2].copy_(weight)
        lora_A = torch.zeros(2 * r, d_in, device="cuda")[1::2].copy_(lora_A)
        lora_B = torch.zeros(d_out, r + 5, dtype=b_dtype, device="cuda")[:, 3 : 3 + r].copy_(lora_B)
    got = _split_norm(weight, lora_A, lora_B, cols=cols)
    err = _max_rel(got, _reference(weight, lora_A, lora_B, SCALE))
    print(f"split odd {d_out}x{d_in} r={r} {w_dtype}/{b_dtype} {layout} chunk={cols}: max rel err {err:.3e}")
    assert err <= 1e-5
    assert torch.equal(got, _split_norm(weight, lora_A, lora_B, cols=cols))  # repeatable


def test_split_nan_and_inf_stay_in_their_rows():
    weight, lora_A, lora_B = _adapter(4096, 14336, 384, torch.bfloat16, torch.float32, ratio=0.1, seed=6)
    weight[3, 9000], weight[9, 0] = float("nan"), float("inf")
    lora_B[17, 5] = float("inf")
    got = _split_norm(weight, lora_A, lora_B)
    # An infinite W enters W·Aᵀ as ±Inf products whose sum may be NaN: the row is non-finite either way.
    assert got[3].isnan() and not got[9].isfinite() and not got[17].isfinite()
    finite = got.isfinite()
    assert finite.sum() == 4096 - 3
    err = _max_rel(got[finite], _reference(weight, lora_A, lora_B, SCALE)[finite])
    print(f"split non-finite rows: max rel err of the others {err:.3e}")
    assert err <= 1e-5


@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d_out, d_in, r", [(14336, 4096, 384), (4096, 14336, 128), (4096, 4096, 65)])
def test_split_takes_half_adapters_above_the_kernel_rank(d_out, d_in, r, w_dtype, dora_env):
    """Half adapters of W's dtype above ``_KERNEL_MAX_RANK``: the cuBLAS split norm (A unsplit) by default, within
    1e-5 of fp64 and of the one-pass kernel (PEFT_DORA_NORM_KERNEL=1), which computes the same exact products."""
    weight, lora_A, lora_B = _adapter(d_out, d_in, r, w_dtype, w_dtype, ratio=0.1, seed=8)
    assert not dora.dora_norm._norm_kernel_applies(weight, lora_A, lora_B)
    assert dora.dora_norm._split_norm_applies(weight, lora_A, lora_B)
    got = dora.factored_row_norm(weight, lora_A, lora_B, SCALE)
    want = _reference(weight, lora_A, lora_B, SCALE)
    dora_env("PEFT_DORA_NORM_KERNEL", "1")
    assert dora.dora_norm._norm_kernel_applies(weight, lora_A, lora_B)
    kernel = dora.factored_row_norm(weight, lora_A, lora_B, SCALE)
    err, err_kernel = _max_rel(got, want), _max_rel(kernel, want)
    print(f"half adapters {w_dtype} {d_out}x{d_in} r={r}: split {err:.3e}, one-pass kernel {err_kernel:.3e}")
    assert err <= 1e-5 and _max_rel(got, kernel.double()) <= 1e-5
    dora_env("PEFT_DORA_NORM_KERNEL", None)
    with dora.dora_norm.eager_norms():  # norms launched every time (FSDP2's rows): the kernel up to the eager rank
        eager = dora.factored_row_norm(weight, lora_A, lora_B, SCALE)
        kernel_rank = r <= dora.dora_norm._KERNEL_MAX_RANK_EAGER
        assert dora.dora_norm._norm_kernel_applies(weight, lora_A, lora_B) == kernel_rank
    assert _max_rel(eager, want) <= 1e-5
    assert torch.equal(eager, kernel if kernel_rank else got)


def test_split_is_the_default_for_fp32_adapters_and_matches_the_torch_form(dora_env):
    weight, lora_A, lora_B = _adapter(14336, 4096, 384, torch.bfloat16, torch.float32, ratio=0.1, seed=7)
    assert dora.dora_norm._split_norm_applies(weight, lora_A, lora_B)
    got = dora.factored_row_norm(weight, lora_A, lora_B, SCALE)
    dora_env("PEFT_DORA_NORM_KERNEL", "0")
    assert not dora.dora_norm._split_norm_applies(weight, lora_A, lora_B)
    want = dora.factored_row_norm(weight, lora_A, lora_B, SCALE)
    err = _max_rel(got, want.double())
    print(f"split vs torch form: max rel diff {err:.3e}")
    assert err <= 2e-6
