# Copyright 2026-present the peft-dora-fast authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""Element-wise DoRA math: the composition, its backward and the norm assembly, as Triton kernels with PyTorch twins,
the autograd nodes of the training tiers, the ``torch.compile`` op, and the public functions.

With ``g = m / max(w_norm, eps)`` (the per-row scale), ``s`` the LoRA scaling, ``base = W·x`` and ``lora = B·A·x``:

    out   = (g - 1) * base + g * (s * lora)       stable form: (g - 1) stays explicit, s * lora is rounded first
    inner = s * lora + base                       saved for d_g, because out = g * inner - base
    d_lora = g * s * d_out,  d_base = (g - 1) * d_out,  d_g = sum over rows of inner * d_out
    w_norm = sqrt(max(w_sq + 2s * cross + s^2 * ba_sq, 0))     fp32, NaN-preserving clamp

Every function here has a PyTorch twin (``_*_torch``) that is the CPU path, the fallback and the test oracle.
``g`` may be fp32 while activations are bf16/fp16: ``g - 1`` is formed in ``g``'s precision before it is cast to
the activation dtype, otherwise values such as 1.0015 collapse to exactly 0 in bf16. The Triton kernels go further
and keep ``g``, ``g - 1`` and every product in fp32, rounding once at the store.

The kernels view an activation as [rows, d_out] with unit column stride and one row stride, so any leading shape
and column slices (``x[..., a:b]``) run without copies. Offsets are int64 throughout; the grid is one-dimensional
(row blocks × column blocks), which has no per-axis size limit that a long sequence could hit.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .dora_batch import end_pass
from .dora_cache import output_saves_itself
from .dora_dispatch import KERNEL_DTYPES, compose_layout, kernels_available, output_layout, records_grad, row_stride
from .dora_launch import HAS_TRITON
from .dora_launch import cdiv as _cdiv
from .dora_launch import next_pow2 as _next_pow2


__all__ = [
    "FusedDoRAComposeFunction",
    "FusedDoRALinearFunction",
    "FusedDoRAOutputFunction",
    "fused_dora_compose",
    "fused_dora_compose_autograd",
    "fused_dora_forward_and_inner",
    "fused_dora_output",
    "fused_norm_assembly",
    "is_triton_available",
]

_CONTIGUOUS = torch.contiguous_format  # fresh buffers get contiguous rows whatever the template's strides

# ---------------------------------------------------------------------------------------------------------------
# Triton kernels.
# ---------------------------------------------------------------------------------------------------------------

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .dora_launch import Launcher

    @triton.jit
    def _tile(pid, n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """Rows, columns and mask of tile ``pid``; column blocks vary fastest so neighbours sweep one row band."""
        n_col_blocks = tl.cdiv(n_cols, BLOCK_N)
        rows = (pid // n_col_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = (pid % n_col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < n_cols
        mask = (rows[:, None] < n_rows) & col_mask[None, :]
        return rows, cols, col_mask, mask

    @triton.jit
    def _at(ptr, rows, cols, row_stride):
        # rows is int64 (derived from the widened program id), so this never wraps past 2^31 elements.
        return ptr + rows[:, None] * row_stride + cols[None, :]

    @Launcher
    @triton.jit
    def _compose_kernel(
        lora_ptr, base_ptr, g_ptr, out_ptr, inner_ptr,
        n_rows, n_cols, stride_lora, stride_base, stride_out, stride_inner, scale,
        WRITE_INNER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        """out = (g - 1)·base + g·(s·lora); with WRITE_INNER also inner = s·lora + base. out may alias lora."""
        pid = tl.program_id(0).to(tl.int64)
        rows, cols, col_mask, mask = _tile(pid, n_rows, n_cols, BLOCK_M, BLOCK_N)
        g = tl.load(g_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        lora = tl.load(_at(lora_ptr, rows, cols, stride_lora), mask=mask, other=0.0).to(tl.float32)
        base = tl.load(_at(base_ptr, rows, cols, stride_base), mask=mask, other=0.0).to(tl.float32)
        scaled = scale * lora
        out = (g - 1.0) * base + g * scaled
        tl.store(_at(out_ptr, rows, cols, stride_out), out.to(out_ptr.dtype.element_ty), mask=mask)
        if WRITE_INNER:
            inner = (scaled + base).to(inner_ptr.dtype.element_ty)
            tl.store(_at(inner_ptr, rows, cols, stride_inner), inner, mask=mask)

    @triton.jit
    def _magnitude_scale(mag_ptr, norm_ptr, cols, col_mask, eps):
        """g = m / max(w_norm, eps) for these columns in fp32, rounded as PyTorch's division; a NaN norm stays NaN."""
        mag = tl.load(mag_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        norm = tl.load(norm_ptr + cols, mask=col_mask, other=1.0).to(tl.float32)
        return tl.div_rn(mag, tl.where(norm < eps, eps, norm))

    @triton.jit
    def _finish_column_sum(total, mag_ptr, norm_ptr, cols, col_mask, eps, DIVIDE: tl.constexpr):
        """d_m from the column sums (see ``_column_sum_kernel``): DIVIDE 0 as they are (d_g), 1 divided by
        max(w_norm, eps), 2 (sums of (y - bias)·d_out) divided by m, 0 where m is 0."""
        if DIVIDE == 1:
            norm = tl.load(norm_ptr + cols, mask=col_mask, other=1.0).to(tl.float32)
            total = tl.div_rn(total, tl.where(norm < eps, eps, norm))
        elif DIVIDE == 2:
            mag = tl.load(mag_ptr + cols, mask=col_mask, other=1.0).to(tl.float32)
            total = tl.where(mag == 0.0, 0.0, tl.div_rn(total, tl.where(mag == 0.0, 1.0, mag)))
        return total

    @Launcher
    @triton.jit
    def _output_kernel(
        result_ptr, lora_ptr, bias_ptr, mag_ptr, norm_ptr, out_ptr, inner_ptr, base_ptr,
        n_rows, n_cols, stride_result, stride_lora, stride_out, stride_inner, stride_base, scale, eps,
        HAS_BIAS: tl.constexpr, WRITE_INNER: tl.constexpr, SEPARATE_BASE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        """The adapted layer output in one pass: out = result + ((g - 1)·base + g·(s·lora)) with base = result - bias
        (SEPARATE_BASE: base read from ``base_ptr``, the LoRA-dropout path's W·dropout(x)) and
        g = m / max(w_norm, eps), all in fp32 and rounded once at the store; with WRITE_INNER also
        inner = s·lora + base. out may alias result or lora (each element is read before it is written)."""
        pid = tl.program_id(0).to(tl.int64)
        rows, cols, col_mask, mask = _tile(pid, n_rows, n_cols, BLOCK_M, BLOCK_N)
        g = _magnitude_scale(mag_ptr, norm_ptr, cols, col_mask, eps)[None, :]
        result = tl.load(_at(result_ptr, rows, cols, stride_result), mask=mask, other=0.0).to(tl.float32)
        lora = tl.load(_at(lora_ptr, rows, cols, stride_lora), mask=mask, other=0.0).to(tl.float32)
        base = result
        if SEPARATE_BASE:
            base = tl.load(_at(base_ptr, rows, cols, stride_base), mask=mask, other=0.0).to(tl.float32)
        elif HAS_BIAS:
            base = result - tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        scaled = scale * lora
        out = result + ((g - 1.0) * base + g * scaled)
        tl.store(_at(out_ptr, rows, cols, stride_out), out.to(out_ptr.dtype.element_ty), mask=mask)
        if WRITE_INNER:
            inner = (scaled + base).to(inner_ptr.dtype.element_ty)
            tl.store(_at(inner_ptr, rows, cols, stride_inner), inner, mask=mask)

    @Launcher
    @triton.jit
    def _backward_kernel(
        d_out_ptr, inner_ptr, g_ptr, norm_ptr, bias_ptr, d_lora_ptr, d_base_ptr, partial_ptr, gs_ptr,
        n_rows, n_cols, rows_per_program, stride_d_out, stride_inner, stride_d_lora, stride_d_base, scale, eps,
        NEED_LORA: tl.constexpr, NEED_BASE: tl.constexpr, NEED_MAG: tl.constexpr, ONE_PASS: tl.constexpr,
        FROM_OUTPUT: tl.constexpr, HAS_BIAS: tl.constexpr, WRITE_GS: tl.constexpr, SEPARATE_BASE: tl.constexpr,
        DIVIDE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        """d_lora = g·(s·d_out), d_base = (g - 1)·d_out, and stage one of d_g: this program's column sums of
        inner·d_out over its ``rows_per_program`` rows, written to row ``pid // n_col_blocks`` of ``partial``.
        ONE_PASS gives the gradients of the one-pass output: ``g_ptr`` holds m and g = m / max(w_norm, eps) is formed
        here, and d_base is that of ``result``, g·d_out (result enters once directly and once through base).
        FROM_OUTPUT: ``inner_ptr`` holds the output y = bias + g·inner, and the sums are of (y - bias)·d_out (the
        column sum then divides by m). SEPARATE_BASE (with ONE_PASS): the output's base was an input of its own (the
        LoRA-dropout path), so d_base = (g - 1)·d_out is that input's gradient (``result``'s is d_out). WRITE_GS: the
        programs of the first band also store g·s per column to ``gs_ptr`` (fp32), for a caller that applies the LoRA
        branch's scale to B instead of to d_out. DIVIDE >= 0: one band covers every row, so this program's column sums
        are the whole sums: it finishes them as the column sum would with that DIVIDE and writes d_m (d_g) to
        ``partial_ptr`` in its dtype, with no second launch; -1: stage one only. A fixed tile order and a fixed
        in-register tree make the sums bitwise repeatable (no atomics)."""
        pid = tl.program_id(0).to(tl.int64)
        n_col_blocks = tl.cdiv(n_cols, BLOCK_N)
        band = pid // n_col_blocks
        cols = (pid % n_col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < n_cols
        if ONE_PASS:
            g_cols = _magnitude_scale(g_ptr, norm_ptr, cols, col_mask, eps)
        else:
            g_cols = tl.load(g_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        if WRITE_GS:
            if band == 0:
                tl.store(gs_ptr + cols, g_cols * scale, mask=col_mask)
        g = g_cols[None, :]
        if HAS_BIAS:
            bias = tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        row_start = band * rows_per_program
        for step in range(0, rows_per_program, BLOCK_M):
            rows = row_start + step + tl.arange(0, BLOCK_M)
            mask = (rows[:, None] < n_rows) & col_mask[None, :]
            d_out = tl.load(_at(d_out_ptr, rows, cols, stride_d_out), mask=mask, other=0.0).to(tl.float32)
            if NEED_LORA:
                d_lora = g * (scale * d_out)
                tl.store(_at(d_lora_ptr, rows, cols, stride_d_lora), d_lora.to(d_lora_ptr.dtype.element_ty), mask=mask)
            if NEED_BASE:
                if ONE_PASS and not SEPARATE_BASE:
                    d_base = g * d_out
                else:
                    d_base = (g - 1.0) * d_out
                tl.store(_at(d_base_ptr, rows, cols, stride_d_base), d_base.to(d_base_ptr.dtype.element_ty), mask=mask)
            if NEED_MAG:
                inner = tl.load(_at(inner_ptr, rows, cols, stride_inner), mask=mask, other=0.0).to(tl.float32)
                if FROM_OUTPUT and HAS_BIAS:
                    inner = tl.where(mask, inner - bias, 0.0)
                acc += inner * d_out
        if NEED_MAG:
            total = tl.sum(acc, axis=0)
            if DIVIDE < 0:
                tl.store(partial_ptr + band * n_cols + cols, total, mask=col_mask)
            else:
                total = _finish_column_sum(total, g_ptr, norm_ptr, cols, col_mask, eps, DIVIDE)
                tl.store(partial_ptr + cols, total.to(partial_ptr.dtype.element_ty), mask=col_mask)

    @Launcher
    @triton.jit
    def _column_sum_kernel(
        partial_ptr, out_ptr, norm_ptr, n_parts, n_cols, eps,
        DIVIDE: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        """Stage two of d_g: out[c] = sum_p partial[p, c], in a fixed order, cast to the output's dtype.
        DIVIDE 1: the sum is d_g and out is d_m = d_g / max(w_norm, eps) (g = m / max(w_norm, eps), w_norm constant;
        ``norm_ptr`` holds w_norm). DIVIDE 2: the sum is g·d_g (sums of (y - bias)·d_out) and d_m = sum / m, 0 where
        m is 0 (``norm_ptr`` holds m; the caller saves the output only when m has no zero)."""
        pid = tl.program_id(0).to(tl.int64)
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < n_cols
        acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
        for start in range(0, n_parts, BLOCK_P):
            parts = start + tl.arange(0, BLOCK_P).to(tl.int64)
            mask = (parts[:, None] < n_parts) & col_mask[None, :]
            acc += tl.load(_at(partial_ptr, parts, cols, n_cols), mask=mask, other=0.0)
        total = _finish_column_sum(tl.sum(acc, axis=0), norm_ptr, norm_ptr, cols, col_mask, eps, DIVIDE)
        tl.store(out_ptr + cols, total.to(out_ptr.dtype.element_ty), mask=col_mask)

    @Launcher
    @triton.jit
    def _norm_kernel(w_sq_ptr, cross_ptr, ba_sq_ptr, out_ptr, n, two_s, s2, BLOCK: tl.constexpr):
        """sqrt(max(w_sq + 2s·cross + s²·ba_sq, 0)) in fp32; launched without FMA contraction so each product is
        rounded as in PyTorch's separate ops, and with a correctly rounded sqrt (tl.sqrt is approximate)."""
        pid = tl.program_id(0).to(tl.int64)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        total = tl.load(w_sq_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        total = total + two_s * tl.load(cross_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        total = total + s2 * tl.load(ba_sq_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        total = tl.where(total < 0.0, 0.0, total)  # NaN < 0 is false: NaN survives, as with torch.clamp_min
        tl.store(out_ptr + offs, tl.sqrt_rn(total).to(out_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------------------------
# Launch policy and launchers (which tensors the kernels take: dora_dispatch).
# ---------------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _elementwise_policy(rows_bucket: int, cols_bucket: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for the compose and backward tiles.

    4096-element tiles (8 KB per bf16 operand) with 4 warps give every thread 16-byte accesses and enough tiles in
    flight to cover HBM latency; BLOCK_N up to 512 keeps rows contiguous without leaving short rows mostly masked.
    Keys are powers of two, so changing sequence lengths reuse the same few compiled variants.
    """
    block_n = min(cols_bucket, 512)
    block_m = max(1, min(4096 // block_n, rows_bucket))
    return block_m, block_n, 4


def _policy(n_rows: int, n_cols: int) -> tuple[int, int, int]:
    return _elementwise_policy(_next_pow2(min(n_rows, 4096)), _next_pow2(n_cols))


# The backward's d_m partial sums: about this many programs, at most this many row bands, so that the [bands, d_out]
# fp32 partial buffer is small (at most 64 rows) and the column sum that reduces it has one step per program.
# H200, 4096 rows, backward + column sum (probe bwd_policy.py, in git history; results/bwd_policy.json): d_out 1024 /
# 4096 / 14336 took 54 / 120 / 150 µs with 4096 programs (8 rows each at d_out 4096: a partial buffer a quarter the size
# of d_out's read, and a column sum walking 512 bands in 16 programs), 10.7 / 40 / 126 µs with these.
_BACKWARD_PROGRAMS = 1024

# Up to this many gradient elements the one-node branch's backward (``FusedDoRALinearFunction``) has its kernel write
# the LoRA output's gradient g·s·d_y instead of applying g·s to B's rows and to d_B: the step is host-bound there
# (small ranks, few tokens), and the extra [tokens, d_out] write and read (48 MB in bf16 at this size, ~10 µs on an
# H200) cost less than the two ops and three allocations they replace. Above it the gradient is never written.
SCALED_BRANCH_GRAD_NUMEL = 1 << 23
_BACKWARD_MAX_BANDS = 64


@functools.lru_cache(maxsize=64)
def _backward_rows_per_program(n_rows_bucket: int, n_col_blocks: int, block_m: int) -> int:
    """Rows one backward program walks: about ``_BACKWARD_PROGRAMS`` programs in all, at most
    ``_BACKWARD_MAX_BANDS`` row bands."""
    bands = max(1, min(_BACKWARD_MAX_BANDS, _BACKWARD_PROGRAMS // n_col_blocks))
    rows = max(block_m, -(-n_rows_bucket // bands))
    return -(-rows // block_m) * block_m


# Up to this many gradient elements the backward walks every row in one band of narrow column blocks and finishes
# d_m itself: no partial buffer and no column-sum launch. Back-to-back calls (bench_kernels.py --bands, H200,
# results/bwd_bands.json, bf16): 25-36 µs per call against 41-46 for the two-stage sum from 128 x 1024 up to
# 2048 x 4096 and 512 x 14336 elements; above 2^23 the one band is slower on the GPU (1024 x 14336: 58 against 43 µs).
SINGLE_BAND_NUMEL = 1 << 23
_SINGLE_BAND_PROGRAMS = 128
_SINGLE_BAND_MIN_BLOCK_N = 32


@functools.lru_cache(maxsize=64)
def _single_band_policy(rows_bucket: int, cols_bucket: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the one-band backward: column blocks of ``_SINGLE_BAND_MIN_BLOCK_N`` to 512
    columns, about ``_SINGLE_BAND_PROGRAMS`` of them, in 4096-element tiles."""
    block_n = max(_SINGLE_BAND_MIN_BLOCK_N, min(512, cols_bucket // _SINGLE_BAND_PROGRAMS))
    return max(1, min(4096 // block_n, rows_bucket)), block_n, 4


@functools.lru_cache(maxsize=64)
def _column_sum_policy(bands_bucket: int) -> tuple[int, int]:
    """(BLOCK_P, BLOCK_N) of the column sum: up to 64 bands per step in 4096-element tiles, so that each program
    has few steps and narrow outputs still spread over many programs."""
    block_p = min(64, bands_bucket)
    return block_p, max(32, min(1024, 4096 // block_p))


def _compose_triton(lora, base, g, scale, out, inner=None, strides=None):
    stride_lora, stride_base = strides or (row_stride(lora), row_stride(base))
    n_cols = lora.shape[-1]
    n_rows = lora.numel() // n_cols
    block_m, block_n, warps = _policy(n_rows, n_cols)
    grid = (_cdiv(n_rows, block_m) * _cdiv(n_cols, block_n),)
    _compose_kernel[grid](
        lora, base, g, out, out if inner is None else inner,
        n_rows, n_cols, stride_lora, stride_base, stride_lora if out is lora else n_cols, n_cols, float(scale),
        WRITE_INNER=inner is not None, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, enable_fp_fusion=False,
    )  # fmt: skip
    return out


def _backward_triton(
    d_out, inner, g, scale, needs_lora_grad, needs_base_grad, needs_mag_grad, strides=None, norm=None, eps=0.0,
    bias=None, from_output=False, gs_out=None, separate_base=False,
):  # fmt: skip
    """Gradients of the composition. With ``norm`` given, ``g`` is the magnitude m (g = m / max(norm, eps) is formed
    in the kernel), the base gradient is that of ``result`` in the one-pass output (g·d_out; with ``separate_base``
    that of the output's own base input, (g - 1)·d_out) and the magnitude gradient is d_m rather than d_g; with
    ``from_output`` too, ``inner`` is the output y and d_m comes from (y - bias)·d_out. ``gs_out`` (fp32 [d_out])
    receives g·s."""
    stride_d_out, stride_inner = strides or (row_stride(d_out), row_stride(inner if needs_mag_grad else d_out))
    n_cols = d_out.shape[-1]
    n_rows = d_out.numel() // n_cols
    # `empty_like` rather than `empty(shape, dtype=, device=)`: a third of the host time (keyword parsing)
    d_lora = torch.empty_like(d_out, memory_format=_CONTIGUOUS) if needs_lora_grad else None
    d_base = torch.empty_like(d_out, memory_format=_CONTIGUOUS) if needs_base_grad else None
    d_mag = torch.empty_like(g, memory_format=_CONTIGUOUS) if needs_mag_grad else None
    from_mag = norm is not None
    from_output = from_mag and from_output and needs_mag_grad
    divide = 2 if from_output else int(from_mag)
    # one band only where it saves the column sum (a frozen m has none to save); no tokens: the column sum writes 0
    single = needs_mag_grad and 0 < n_rows and n_rows * n_cols <= SINGLE_BAND_NUMEL
    if single:  # one band: the kernel finishes d_m
        block_m, block_n, warps = _single_band_policy(_next_pow2(n_rows), _next_pow2(n_cols))
        rows_per_program = max(block_m, _cdiv(n_rows, block_m) * block_m)
        bands = 1
    else:
        block_m, block_n, warps = _policy(n_rows, n_cols)
        rows_per_program = _backward_rows_per_program(_next_pow2(n_rows), _cdiv(n_cols, block_n), block_m)
        bands = _cdiv(n_rows, rows_per_program)
    if not needs_mag_grad:
        partial = d_out
    elif single:
        partial = d_mag
    else:
        partial = torch.empty((bands, n_cols), dtype=torch.float32, device=d_out.device)
    _backward_kernel[(bands * _cdiv(n_cols, block_n),)](
        d_out, inner if needs_mag_grad else d_out, g, norm if from_mag else g, g if bias is None else bias,
        d_lora if needs_lora_grad else d_out, d_base if needs_base_grad else d_out, partial,
        d_out if gs_out is None else gs_out,
        n_rows, n_cols, rows_per_program, stride_d_out, stride_inner, n_cols, n_cols, float(scale), float(eps),
        NEED_LORA=needs_lora_grad, NEED_BASE=needs_base_grad, NEED_MAG=needs_mag_grad, ONE_PASS=from_mag,
        FROM_OUTPUT=from_output, HAS_BIAS=from_output and bias is not None, WRITE_GS=gs_out is not None,
        SEPARATE_BASE=separate_base, DIVIDE=divide if single else -1, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=warps, enable_fp_fusion=False,
    )  # fmt: skip
    if needs_mag_grad and not single:
        block_p, block_n_sum = _column_sum_policy(_next_pow2(bands))
        _column_sum_kernel[(_cdiv(n_cols, block_n_sum),)](
            partial, d_mag, g if from_output else (norm if from_mag else partial), bands, n_cols, float(eps),
            DIVIDE=divide, BLOCK_P=block_p, BLOCK_N=block_n_sum,
        )  # fmt: skip
    return d_lora, d_base, d_mag


def _output_triton(result, lora, bias, magnitude, norm, scale, eps, out, inner=None, strides=None, base=None):
    """``base``: the output's base as a contiguous tensor of its own (else ``result - bias``)."""
    stride_result, stride_lora = strides
    n_cols = lora.shape[-1]
    n_rows = lora.numel() // n_cols
    block_m, block_n, warps = _policy(n_rows, n_cols)
    grid = (_cdiv(n_rows, block_m) * _cdiv(n_cols, block_n),)
    stride_out = stride_lora if out is lora else (stride_result if out is result else n_cols)
    _output_kernel[grid](
        result, lora, magnitude if bias is None else bias, magnitude, norm, out, out if inner is None else inner,
        result if base is None else base,
        n_rows, n_cols, stride_result, stride_lora, stride_out, n_cols, n_cols, float(scale), float(eps),
        HAS_BIAS=bias is not None, WRITE_INNER=inner is not None, SEPARATE_BASE=base is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, enable_fp_fusion=False,
    )  # fmt: skip
    return out


def _norm_assembly_triton(w_norm_sq, cross_term, ba_norm_sq, scale):
    out = torch.empty_like(w_norm_sq, memory_format=torch.contiguous_format)
    n = w_norm_sq.numel()
    # The norm is d_out elements: launch latency, not block size, decides its time, so one fixed block serves all.
    two_s, s2 = 2.0 * float(scale), float(scale) * float(scale)
    _norm_kernel[(_cdiv(n, 256),)](
        w_norm_sq, cross_term, ba_norm_sq, out, n, two_s, s2, BLOCK=256, enable_fp_fusion=False
    )
    return out


# ---------------------------------------------------------------------------------------------------------------
# PyTorch twins: one definition of each piece of math, shared by every eager path.
# ---------------------------------------------------------------------------------------------------------------


def broadcasts_to(shape, *others) -> bool:
    """Whether every shape of ``others`` broadcasts to ``shape`` itself, so that in-place ops on a tensor of ``shape``
    can take them: ``shape == torch.broadcast_shapes(shape, *others)``, which costs some 50 µs of host time per call
    in eager mode (it runs through torch's reference implementation and its symbolic-shape checks)."""
    n = len(shape)
    for other in others:
        if len(other) > n:
            return False
        for size, o in zip(reversed(shape), reversed(other)):
            if o != size and o != 1:
                return False
    return True


def _scale_factors(g: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, g - 1) in the activation dtype, with g - 1 taken in g's own (usually fp32) precision."""
    return g.to(dtype), (g - 1).to(dtype)


def compose_torch(
    lora: torch.Tensor, base: torch.Tensor, g: torch.Tensor, scale: float, inplace: bool = False
) -> torch.Tensor:
    """(g - 1) * base + g * (s * lora), in the promoted dtype of lora and base; in place into lora if asked. With fp16
    activations the branch is ``(g·s)·lora``, ``g·s`` formed in g's precision: ``s·lora`` may leave fp16's range where
    ``g·(s·lora)`` does not (g divides by ``‖W + s·B·A‖``), and no wider temporary is made for autograd to keep."""
    dtype = torch.promote_types(lora.dtype, base.dtype)
    if dtype == torch.float16:
        gs, gm1 = (g * scale).to(dtype), (g - 1).to(dtype)  # g·s and g - 1 in g's precision
        if inplace and lora.dtype == dtype and broadcasts_to(lora.shape, base.shape, g.shape):
            return lora.mul_(gs).add_(gm1 * base)
        return gm1 * base + gs * lora
    g_c, gm1 = _scale_factors(g, dtype)
    if inplace and lora.dtype == dtype and broadcasts_to(lora.shape, base.shape, g.shape):
        # t2 + t1 == t1 + t2 bitwise, so this equals the out-of-place form below.
        return lora.mul_(scale).mul_(g_c).add_(gm1 * base)
    return gm1 * base + g_c * (scale * lora)


def inner_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype ``inner = s·lora + base`` is kept in for the magnitude's gradient: fp32 for fp16 activations, whose
    range ``s·lora`` can leave while the output stays in it (see :func:`compose_torch`); else theirs."""
    return torch.float32 if dtype == torch.float16 else dtype


def _forward_and_inner_torch(
    lora: torch.Tensor, base: torch.Tensor, g: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = torch.promote_types(lora.dtype, base.dtype)
    if dtype == torch.float16:  # the output as compose_torch's, bitwise; inner in fp32
        return compose_torch(lora, base, g, scale), scale * lora.float() + base.float()
    g_c, gm1 = _scale_factors(g, dtype)
    scaled = scale * lora
    out = gm1 * base + g_c * scaled
    inner = scaled + base
    return out, inner


def _backward_torch(
    d_out: torch.Tensor,
    inner: torch.Tensor | None,
    g: torch.Tensor,
    scale: float,
    needs_lora_grad: bool,
    needs_base_grad: bool,
    needs_mag_grad: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    g_c, gm1 = _scale_factors(g, d_out.dtype)
    d_lora = None
    if needs_lora_grad:  # fp16 in fp32 and rounded once (s·d_out may leave fp16's range where g·s·d_out does not)
        wide = d_out.dtype == torch.float16
        d_lora = (g * (scale * d_out.float())).to(d_out.dtype) if wide else g_c * (scale * d_out)
    d_base = gm1 * d_out if needs_base_grad else None
    d_mag = None
    if needs_mag_grad:
        # fp32 accumulation over all broadcast dimensions, whatever the activation dtype.
        prod = inner.float() * d_out.float()
        d_mag = prod.sum_to_size(g.shape).to(g.dtype)
    return d_lora, d_base, d_mag


def _output_torch(
    result: torch.Tensor,
    lora: torch.Tensor,
    bias: torch.Tensor | None,
    magnitude: torch.Tensor,
    weight_norm: torch.Tensor,
    scale: float,
    eps: float,
) -> torch.Tensor:
    """The eager one-pass output: ``result + ((g - 1)·base + g·(s·lora))`` with ``base = result - bias``; bitwise the
    eager tier's ``result + compose(lora, base, g)``."""
    g = magnitude / weight_norm.clamp_min(eps)
    base = result if bias is None else result - bias
    return result + compose_torch(lora, base, g, scale)


def _output_backward_torch(
    d_out, inner, magnitude, weight_norm, scale, eps, needs_result, needs_lora, needs_mag, bias=None,
    from_output=False, separate_base=False,
):  # fmt: skip
    """Gradients of the one-pass output for layouts the kernel leaves alone, in the kernel's precision (fp32 products
    rounded once): d_result = g·d_out, d_lora = g·(s·d_out), d_m = sum(inner·d_out) / max(w_norm, eps); with
    ``from_output``, ``inner`` is the output y and d_m = sum((y - bias)·d_out) / m (0 where m is 0). With
    ``separate_base`` the first gradient is that of the output's own base input, (g - 1)·d_out."""
    acc = torch.promote_types(d_out.dtype, torch.float32)
    denom = weight_norm.to(acc).clamp_min(eps)
    g = magnitude.to(acc) / denom
    d = d_out.to(acc)
    d_result = ((g - 1 if separate_base else g) * d).to(d_out.dtype) if needs_result else None
    d_lora = (g * (scale * d)).to(d_out.dtype) if needs_lora else None
    d_mag = None
    if needs_mag and from_output:
        values = inner.to(acc) if bias is None else inner.to(acc) - bias.to(acc)
        mag = magnitude.to(acc)
        total = (values * d).sum_to_size(magnitude.shape)
        d_mag = torch.where(mag == 0, 0.0, total / torch.where(mag == 0, 1.0, mag)).to(magnitude.dtype)
    elif needs_mag:
        d_mag = ((inner.to(acc) * d).sum_to_size(magnitude.shape) / denom).to(magnitude.dtype)
    return d_result, d_lora, d_mag


def _norm_assembly_torch(
    w_norm_sq: torch.Tensor, cross_term: torch.Tensor, ba_norm_sq: torch.Tensor, scale: float
) -> torch.Tensor:
    # Scalars are formed in fp64 and applied as fp32 tensors' multipliers; clamp_min keeps NaN, unlike max with 0.
    two_s, s2 = 2.0 * float(scale), float(scale) * float(scale)
    acc = torch.promote_types(w_norm_sq.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
    total = w_norm_sq.to(acc) + two_s * cross_term.to(acc)
    total = total + s2 * ba_norm_sq.to(acc)
    return total.clamp_min(0).sqrt().to(w_norm_sq.dtype)


# ---------------------------------------------------------------------------------------------------------------
# Autograd: the training-time composition with a hand-written backward.
# ---------------------------------------------------------------------------------------------------------------


class FusedDoRAComposeFunction(torch.autograd.Function):
    """out = (g - 1) * base + g * (s * lora) with a fused backward.

    Saves ``inner = s * lora + base`` (one activation-sized tensor) only when ``g`` needs a gradient; with a frozen
    magnitude nothing activation-sized is saved.
    """

    @staticmethod
    def forward(ctx, lora, base, mag_norm_scale, scale):
        needs_mag = mag_norm_scale.requires_grad
        if needs_mag:
            out, inner = fused_dora_forward_and_inner(lora, base, mag_norm_scale, scale)
            ctx.save_for_backward(inner, mag_norm_scale)
        else:
            out = fused_dora_compose(lora, base, mag_norm_scale, scale, inplace=False)
            ctx.save_for_backward(None, mag_norm_scale)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, d_out):
        inner, g = ctx.saved_tensors
        d_lora, d_base, d_mag = _fused_backward(d_out, inner, g, ctx.scale, *ctx.needs_input_grad[:3])
        return d_lora, d_base, d_mag, None


# the norm a training node keeps: a layer's norm graph hands out its output buffer, whose version moves on when a
# replay rewrites it from changed weights (dora_graph.note_write)
_NORM = "weight norm (recomputed by another forward of this layer from weights edited in place since this forward)"


def _check_version(t: torch.Tensor, version: int, what: str) -> None:
    """Autograd's check for a saved input, for the inputs a node keeps as attributes."""
    if t._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"the DoRA {what} {tuple(t.shape)} is at version {t._version}; expected version {version} instead (it "
            "was changed in place between the forward and this backward)"
        )


class FusedDoRAOutputFunction(torch.autograd.Function):
    """The whole DoRA tail of a Linear in one autograd node: ``y = result + ((g - 1)·base + g·(s·lora))`` with
    ``base = result - bias`` and ``g = m / max(w_norm, eps)`` formed in the kernel (the norm is a constant).

    ``y`` is written into ``lora``'s buffer (marked dirty), so the output costs no allocation (into a new buffer
    where ``result`` is wider, see ``dora_dispatch.wider_result``; autograd casts ``d_lora`` back). For ``d_m`` the
    backward needs ``inner = s·lora + base``: it is read back from ``y`` itself (``(y - bias) / g``, see
    :func:`_output_saves_itself`), or, where m has an exact zero, saved in a buffer of its own. The backward is one
    pass for ``d_result = g·d_y``, ``d_lora = g·s·d_y`` and the partial sums of ``d_m``, plus a small deterministic
    column sum.

    Only ``y`` (or ``inner``) goes through ``save_for_backward``; m, the norm and the bias are inputs that the node
    keeps as attributes: under gradient checkpointing every saved tensor costs a Python pack hook in each forward
    and an unpack hook in backward, and these three are never recomputed. m's version counter is checked in
    backward as autograd would check a saved input.
    """

    @staticmethod
    def forward(ctx, result, lora, magnitude, weight_norm, bias, scale, eps, strides, known=None):
        """``strides``: ``dora_dispatch.output_layout`` of these tensors, which the caller has checked is not None."""
        needs_mag = ctx.needs_input_grad[2]
        from_output = needs_mag and output_saves_itself(magnitude, known)
        out = _output_buffer(result, lora)
        inner = None
        if needs_mag and not from_output:
            inner = torch.empty_like(out, dtype=inner_dtype(out.dtype), memory_format=_CONTIGUOUS)
        if lora.numel() > 0:
            _output_triton(result, lora, bias, magnitude, weight_norm, scale, eps, out, inner, strides)
        if out is lora:
            ctx.mark_dirty(lora)
        ctx.save_for_backward(out if from_output else inner)
        ctx.magnitude, ctx.weight_norm, ctx.bias = magnitude, weight_norm, bias
        ctx.versions = (magnitude._version, weight_norm._version)
        ctx.scale, ctx.eps, ctx.from_output = scale, eps, from_output
        return out

    @staticmethod
    def backward(ctx, d_y):
        (inner,) = ctx.saved_tensors
        magnitude, weight_norm, bias = ctx.magnitude, ctx.weight_norm, ctx.bias
        _check_version(magnitude, ctx.versions[0], "magnitude")
        _check_version(weight_norm, ctx.versions[1], _NORM)
        needs_result, needs_lora, needs_mag = ctx.needs_input_grad[:3]
        if not (needs_result or needs_lora or needs_mag):
            return None, None, None, None, None, None, None, None, None
        layout = compose_layout(d_y, inner if needs_mag else d_y, magnitude) if kernels_available(d_y) else None
        needs = (needs_result, needs_lora, needs_mag)
        if layout is not None and d_y.numel() > 0:
            d_lora, d_result, d_mag = _backward_triton(
                d_y, inner, magnitude, ctx.scale, needs_lora, needs_result, needs_mag, layout, weight_norm, ctx.eps,
                bias, ctx.from_output,
            )  # fmt: skip
        else:
            d_result, d_lora, d_mag = _output_backward_torch(
                d_y, inner, magnitude, weight_norm, ctx.scale, ctx.eps, *needs, bias, ctx.from_output
            )
        return d_result, d_lora, d_mag, None, None, None, None, None, None


class FusedDoRALinearFunction(torch.autograd.Function):
    """A DoRA Linear's ``lora_B`` matmul and output in one autograd node: ``lora = a·Bᵀ`` (cuBLAS, in ``a``'s dtype)
    and ``y = result + ((g - 1)·(result - bias) + g·(s·lora))`` written into ``lora``'s buffer, where ``a = x·Aᵀ`` is
    the ``lora_A`` output (an ordinary autograd matmul).

    Owning the ``lora_B`` matmul changes what training moves and keeps, not the math:

    * the backward applies g·s to B (``[d_out, r]``) instead of to the incoming gradient: ``d_a = d_y·(g·s·B)``,
      ``d_B = (g·s)·(d_yᵀ·a)``, so the ``[tokens, d_out]`` gradient of the LoRA output is never written or read
      (it is rounded once less, too); up to ``SCALED_BRANCH_GRAD_NUMEL`` elements, where the step is host-bound,
      the kernel writes that gradient instead and B and d_B are used as they are;
    * B's compute-dtype copy is made in the forward and the backward instead of being saved (under autocast,
      PyTorch's matmul saves it, and its cast cache holds every adapter's copy until the autocast region ends);
    * the saved tensors are ``a`` and ``y`` (or ``inner``), as for separate nodes.

    Where ``result`` is fp32 and ``a`` half precision (``dora_dispatch.wider_result``), ``y`` is a new fp32 buffer.

    ``dtype`` is ``a``'s dtype, which the caller checks is what ``F.linear(a, B)`` would compute in (autocast's, or
    B's own) and ``result``'s. B and m are kept as attributes, their version counters checked in backward as autograd
    would for saved inputs.

    With LoRA dropout (upstream's semantics) ``a`` is the branch of the dropped-out input and ``base = W·dropout(x)``
    (bias-free, contiguous, ``result``'s shape, as ``DoraLinearLayer._dropout_node`` checks) is an input of its own:
    ``y = result + ((g - 1)·base + g·(s·lora))``, ``d_result = d_y``, ``d_base = (g - 1)·d_y``. ``inner`` cannot be
    read back from ``y`` then and is saved where m needs a gradient.
    """

    @staticmethod
    def forward(ctx, result, a, weight_b, magnitude, base, consts):
        """``consts``: ``(weight_norm, bias, scale, eps, stride, known)``, what takes no gradient here, in one
        argument (``Function.apply`` costs host time per argument); ``stride`` is
        ``dora_dispatch.branch_node_stride`` of these tensors, which the caller has checked is not None, ``known``
        the layer's zero-test memo. ``base``: the dropout path's ``W·dropout(x)``, else None."""
        weight_norm, bias, scale, eps, stride, known = consts
        # `.to` of a tensor already in the dtype returns it but costs a dispatch: asked only where the dtypes differ
        lora = F.linear(a, weight_b if weight_b.dtype == a.dtype else weight_b.to(a.dtype))
        needs_mag = ctx.needs_input_grad[3]
        from_output = needs_mag and base is None and output_saves_itself(magnitude, known)
        out = _output_buffer(result, lora)
        inner = None
        if needs_mag and not from_output:
            inner = torch.empty_like(out, dtype=inner_dtype(out.dtype), memory_format=_CONTIGUOUS)
        if lora.numel() > 0:
            strides = (stride, lora.shape[-1])  # F.linear's output is contiguous
            _output_triton(result, lora, bias, magnitude, weight_norm, scale, eps, out, inner, strides, base)
        ctx.separate_base = base is not None
        ctx.save_for_backward(a, out if from_output else inner)
        ctx.weights = (weight_b, magnitude, weight_norm, bias)
        ctx.versions = (weight_b._version, magnitude._version, weight_norm._version)
        ctx.scale, ctx.eps, ctx.from_output = scale, eps, from_output
        return out

    @staticmethod
    def backward(ctx, d_y):
        end_pass()  # the norms a device's batch computed in this forward pass are not handed out after it
        a, saved = ctx.saved_tensors
        weight_b, magnitude, weight_norm, bias = ctx.weights
        versions = ctx.versions
        if weight_b._version != versions[0] or magnitude._version != versions[1] or weight_norm._version != versions[2]:
            _check_version(weight_b, versions[0], "lora_B")
            _check_version(magnitude, versions[1], "magnitude")
            _check_version(weight_norm, versions[2], _NORM)
        needs_result, needs_a, needs_b, needs_mag, needs_base = ctx.needs_input_grad[:5]
        separate = ctx.separate_base
        # the gradient the kernel (or its twin) writes beside d_lora: result's, g·d_y, or with the dropout path's own
        # base input that base's, (g - 1)·d_y (result's is then d_y itself)
        needs_first = needs_base if separate else needs_result
        needs_branch = needs_a or needs_b
        d_out = d_y.shape[-1]
        layout = None
        if d_y.numel() > 0 and kernels_available(d_y):
            # autograd hands over a gradient of y's shape and dtype; y and inner are our own contiguous buffers, and
            # m's layout was checked in forward (its version since): only the gradient's strides are open
            layout = (
                (d_out, d_out) if d_y.is_contiguous() else compose_layout(d_y, saved if needs_mag else d_y, magnitude)
            )
        gs = None  # g·s as a column [d_out, 1]: scales B's rows before d_a and d_B's rows after
        if layout is not None:
            # few rows: the kernel writes d_lora = g·s·d_y itself, a [tokens, d_out] buffer written and read, in place
            # of the g·s column, B's scaled copy and d_B's scaled copy (three buffers and two multiplies of host time)
            scaled = needs_branch and d_y.numel() <= SCALED_BRANCH_GRAD_NUMEL
            if needs_branch and not scaled:
                gs = torch.empty((d_out, 1), dtype=torch.float32, device=d_y.device)
            d_lora, d_result, d_mag = _backward_triton(
                d_y, saved, magnitude, ctx.scale, scaled, needs_first, needs_mag, layout, weight_norm, ctx.eps, bias,
                ctx.from_output, gs_out=gs, separate_base=separate,
            )  # fmt: skip
            if not scaled:
                d_lora = d_y
        else:  # a layout the kernel leaves alone (e.g. a broadcast gradient), or zero tokens: d_lora = g·s·d_y
            d_result, d_lora, d_mag = _output_backward_torch(
                d_y, saved, magnitude, weight_norm, ctx.scale, ctx.eps, needs_first, needs_branch, needs_mag, bias,
                ctx.from_output, separate_base=separate,
            )  # fmt: skip
        d_base = None
        if separate:
            d_base, d_result = d_result, (d_y if needs_result else None)
        d_a = d_b = None
        if needs_branch:
            d_lora = d_lora.reshape(-1, d_out)
            if d_lora.dtype != a.dtype:  # a wider result (fp32 y): the branch's gradient in its own dtype, as autocast
                d_lora = d_lora.to(a.dtype)
        if needs_a:
            if gs is None:
                b_c = weight_b if weight_b.dtype == a.dtype else weight_b.to(a.dtype)
            else:
                b_c = torch.mul(weight_b, gs, out=torch.empty_like(weight_b, dtype=a.dtype))
            d_a = torch.mm(d_lora, b_c).view(a.shape)
        if needs_b:
            d_b = torch.mm(d_lora.t(), a.reshape(-1, a.shape[-1]))
            if gs is None:
                d_b = d_b if d_b.dtype == weight_b.dtype else d_b.to(weight_b.dtype)
            elif weight_b.dtype == torch.float32:
                d_b = torch.mul(d_b, gs)  # promoted to fp32 by gs
            else:
                d_b = torch.mul(d_b, gs, out=torch.empty_like(weight_b))
        return d_result, d_a, d_b, d_mag, d_base, None


def _node_apply(function):
    """``function.apply`` for an autograd Function without ``setup_context``, by autograd's own C++ entry point where
    no torch.func transform is active: what ``Function.apply`` does there (unwrap dead functorch wrappers, then the
    C++ ``apply``) without its Python wrapper's generic argument handling, about 10 µs of host time per call on a
    CPU stand-in (``benchmarks/host_eager.py``), paid by every training forward and its checkpoint recompute. Under
    a transform, or where this PyTorch lacks either internal, ``function.apply`` itself."""
    raw = getattr(torch._C._FunctionBase, "__dict__", {}).get("apply")
    functorch = getattr(torch._C, "_functorch", None)
    unwrap = getattr(functorch, "unwrap_if_dead", None)
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    if raw is None or unwrap is None or active is None or "setup_context" in function.__dict__:
        return function.apply
    direct, apply = raw.__get__(None, function), function.apply

    def node(result, a, weight_b, magnitude, base, consts):
        if active():
            return apply(result, a, weight_b, magnitude, base, consts)
        return direct(
            unwrap(result), unwrap(a), unwrap(weight_b), unwrap(magnitude), None if base is None else unwrap(base),
            consts,
        )  # fmt: skip

    return node


linear_node = _node_apply(FusedDoRALinearFunction)
"""``FusedDoRALinearFunction.apply(result, a, weight_b, magnitude, base, consts)`` (see :func:`_node_apply`)."""


# Devices where ``W·dropout(x)`` of a bf16 input takes :class:`DroppedHalfBase` (``torch.mm`` with an fp32 output is
# CUDA's only; tests add "cpu" to run the same path on :func:`_wide_mm`'s fp32 twin).
HALF_BASE_DEVICES = ("cuda",)

# ``torch.mm(..., out_dtype=torch.float32)`` of bf16 operands (``aten::mm.dtype``), which older PyTorch lacks: there the
# fp32 copy of W stays
WIDE_MM = "dtype" in torch.ops.aten.mm.overloads()


def _wide_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a·b`` of two bf16 matrices, accumulated and returned in fp32: one bf16 GEMM with an fp32 output on CUDA;
    elsewhere the same products (exact in fp32) of fp32 copies."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def undo_dropout_scale(dropped: torch.Tensor, keep: float, dtype: torch.dtype) -> torch.Tensor:
    """``mask·x`` in ``dtype`` from ``dropped = dropout(x.float())`` (``nn.Dropout``: ``x·mask/keep`` in fp32) of an
    input ``x`` of that dtype: ``dropped·keep`` is ``x`` within a few fp32 ulps, which rounds back to ``x`` itself
    (far from a bf16 rounding boundary), or 0 where the mask dropped it. No gradient: :class:`DroppedHalfBase` gives
    ``dropped`` its gradient."""
    return torch.mul(dropped.detach(), keep, out=torch.empty_like(dropped, dtype=dtype, memory_format=_CONTIGUOUS))


class DroppedHalfBase(torch.autograd.Function):
    """``base = W·dropout(x)`` for LoRA dropout under upstream's semantics where ``x`` is a bf16 input cast to PEFT's
    default fp32 adapters and W is bf16 (a bf16 model trained without autocast): upstream copies W to fp32 and runs
    an fp32 GEMM in the forward and another in the backward, for every adapted Linear in every step. Here the
    dropped-out input is taken back to bf16 exactly (``masked = mask·x``, :func:`undo_dropout_scale`), and
    ``base = (W·masked)/keep`` is one bf16 GEMM with fp32 accumulation and output: the same products, exact in fp32,
    summed in fp32, without the copy of W. The backward gives ``dropped`` ``d_base·W`` (``1/keep`` and ``keep``
    cancel), one bf16 GEMM of the rounded ``d_base`` with an fp32 output: the input's gradient, which reaches the
    bf16 layer input and is rounded there anyway. W takes no gradient here (the caller checks it is frozen)."""

    @staticmethod
    def forward(ctx, dropped, masked, weight, scale):
        out = _wide_mm(masked.reshape(-1, masked.shape[-1]), weight.t())
        out.mul_(scale)
        ctx.save_for_backward(weight)
        ctx.shape = dropped.shape
        return out.view(*masked.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, d_base):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        (weight,) = ctx.saved_tensors
        d = d_base.reshape(-1, d_base.shape[-1]).to(weight.dtype)
        return _wide_mm(d, weight).view(ctx.shape), None, None, None


def dropped_half_base(dropped, masked, weight, keep: float) -> torch.Tensor:
    """``W·dropped`` by :class:`DroppedHalfBase`, ``masked`` from :func:`undo_dropout_scale` (``weight`` may be a
    slice of W's rows)."""
    return DroppedHalfBase.apply(dropped, masked, weight, 1.0 / keep)


def _fused_backward(d_out, inner, g, scale, needs_lora_grad, needs_base_grad, needs_mag_grad):
    needs = (needs_lora_grad, needs_base_grad, needs_mag_grad)
    if not any(needs):
        return None, None, None
    # Zero tokens launch nothing: the twin returns empty gradients and a zero d_g.
    layout = compose_layout(d_out, inner if needs_mag_grad else d_out, g) if kernels_available(d_out) else None
    if layout is not None and d_out.numel() > 0:
        return _backward_triton(d_out, inner, g, scale, *needs, strides=layout)
    return _backward_torch(d_out, inner, g, scale, *needs)


# ---------------------------------------------------------------------------------------------------------------
# torch.compile boundary: the composition as one opaque op, registered once at import.
# ---------------------------------------------------------------------------------------------------------------


@torch.library.custom_op("peft::fused_dora_compose", mutates_args=())
def _compose_op(lora: torch.Tensor, base: torch.Tensor, mag_norm_scale: torch.Tensor, scale: float) -> torch.Tensor:
    return fused_dora_compose(lora, base, mag_norm_scale, scale, inplace=False).contiguous()


@_compose_op.register_fake
def _compose_op_fake(lora, base, mag_norm_scale, scale):
    shape = torch.broadcast_shapes(lora.shape, base.shape, mag_norm_scale.shape)
    return lora.new_empty(shape, dtype=torch.promote_types(lora.dtype, base.dtype))


def _compose_op_setup_context(ctx, inputs, output):
    lora, base, mag_norm_scale, scale = inputs
    ctx.scale = scale
    ctx.save_for_backward(lora, base, mag_norm_scale)


def _compose_op_backward(ctx, d_out):
    # Plain PyTorch: AOTAutograd traces this with fake tensors and Inductor fuses it into one kernel.
    lora, base, g = ctx.saved_tensors
    needs_lora, needs_base, needs_mag = ctx.needs_input_grad[:3]
    inner = _forward_and_inner_torch(lora, base, g, ctx.scale)[1] if needs_mag else None
    d_lora, d_base, d_mag = _backward_torch(d_out, inner, g, ctx.scale, needs_lora, needs_base, needs_mag)
    return d_lora, d_base, d_mag, None


_compose_op.register_autograd(_compose_op_backward, setup_context=_compose_op_setup_context)


# ---------------------------------------------------------------------------------------------------------------
# Public functions (names and signatures as in the reference fork's API).
# ---------------------------------------------------------------------------------------------------------------


def is_triton_available() -> bool:
    """True if Triton can be imported (the kernels also need a CUDA tensor to run)."""
    return HAS_TRITON


def fused_dora_compose(
    lora: torch.Tensor, base: torch.Tensor, mag_norm_scale: torch.Tensor, scale: float, inplace: bool = True
) -> torch.Tensor:
    """DoRA composition ``(mag_norm_scale - 1) * base + mag_norm_scale * (scale * lora)``.

    ``mag_norm_scale`` broadcasts against ``lora`` ([out_features], [1, out_features] or a Conv-style shape). With
    ``inplace=True`` the result is written into ``lora`` when its dtype and shape allow it; no autograd graph is
    recorded for in-place writes, so use :func:`fused_dora_compose_autograd` for training. Under ``torch.compile``
    the result is always a new tensor (the ``peft::fused_dora_compose`` op).
    """
    if torch.compiler.is_compiling():
        return torch.ops.peft.fused_dora_compose(lora, base, mag_norm_scale, float(scale))
    layout = compose_layout(lora, base, mag_norm_scale) if kernels_available(lora) else None
    if layout is None:
        return compose_torch(lora, base, mag_norm_scale, scale, inplace=inplace)
    out = lora if inplace else torch.empty(lora.shape, dtype=lora.dtype, device=lora.device)
    if lora.numel() == 0:
        return out
    return _compose_triton(lora, base, mag_norm_scale, scale, out, strides=layout)


def fused_dora_output(
    result: torch.Tensor,
    lora: torch.Tensor,
    magnitude: torch.Tensor,
    weight_norm: torch.Tensor,
    scale: float,
    eps: float,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The adapted output ``result + ((g - 1)·(result - bias) + g·(s·lora))``, ``g = m / max(weight_norm, eps)``,
    written once into ``lora``'s buffer (which it consumes). Records one autograd node when grad mode is on and an
    input needs a gradient; otherwise runs the bare kernel. Falls back to PyTorch where :func:`output_supported`
    is False."""
    strides = None
    if kernels_available(lora) and not torch.compiler.is_compiling():
        strides = output_layout(result, lora, bias, magnitude, weight_norm)
    if strides is None:
        return _output_torch(result, lora, bias, magnitude, weight_norm, scale, eps)
    return run_fused_output(result, lora, magnitude, weight_norm, scale, eps, bias, strides)


def output_supported(result, lora, bias, magnitude, weight_norm) -> bool:
    """True when :func:`fused_dora_output` runs the kernels on these tensors (CUDA or the interpreter, supported
    dtypes and layout); otherwise it takes the eager path."""
    return kernels_available(lora) and output_layout(result, lora, bias, magnitude, weight_norm) is not None


def run_fused_output(result, lora, magnitude, weight_norm, scale, eps, bias, strides, known=None) -> torch.Tensor:
    """:func:`fused_dora_output` on tensors whose ``dora_dispatch.output_layout`` (``strides``) the caller has
    taken."""
    scale, eps = float(scale), float(eps)
    if records_grad(result, lora, magnitude):
        return FusedDoRAOutputFunction.apply(result, lora, magnitude, weight_norm, bias, scale, eps, strides, known)
    out = _output_buffer(result, lora)
    if lora.numel() > 0:
        _output_triton(result, lora, bias, magnitude, weight_norm, scale, eps, out, None, strides)
    return out


def _output_buffer(result: torch.Tensor, lora: torch.Tensor) -> torch.Tensor:
    """Where the one-pass output goes: ``lora``'s own buffer (also where it is the wider, fp32 beside a half
    ``result``: ``dora_dispatch.wider_branch``), or a new one of ``result``'s dtype where that is wider
    (``dora_dispatch.wider_result``)."""
    if lora.dtype == result.dtype or lora.dtype == torch.float32:
        return lora
    return torch.empty_like(result, memory_format=_CONTIGUOUS)


def fused_dora_forward_and_inner(
    lora: torch.Tensor, base: torch.Tensor, mag_norm_scale: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(out, inner)`` with ``out`` as in :func:`fused_dora_compose` and ``inner = scale * lora + base``
    (fp32 for fp16 activations: :func:`inner_dtype`)."""
    layout = compose_layout(lora, base, mag_norm_scale) if kernels_available(lora) else None
    if layout is None or torch.compiler.is_compiling():
        return _forward_and_inner_torch(lora, base, mag_norm_scale, scale)
    out = torch.empty(lora.shape, dtype=lora.dtype, device=lora.device)
    inner = torch.empty(lora.shape, dtype=inner_dtype(lora.dtype), device=lora.device)
    if lora.numel() == 0:
        return out, inner
    _compose_triton(lora, base, mag_norm_scale, scale, out, inner, strides=layout)
    return out, inner


def fused_norm_assembly(
    w_norm_sq: torch.Tensor, cross_term: torch.Tensor, ba_norm_sq: torch.Tensor, scale: float
) -> tuple[torch.Tensor]:
    """``(sqrt(max(w_norm_sq + 2 * scale * cross_term + scale**2 * ba_norm_sq, 0)),)``, computed in fp32.

    The magnitude division stays with the caller, in PyTorch, so every norm path shares its precision.
    """
    fused = (
        not torch.compiler.is_compiling()
        and kernels_available(w_norm_sq)
        and w_norm_sq.dtype in KERNEL_DTYPES
        and all(
            t.shape == w_norm_sq.shape and t.device == w_norm_sq.device and t.dtype in KERNEL_DTYPES
            and t.is_contiguous()
            for t in (w_norm_sq, cross_term, ba_norm_sq)
        )
    )  # fmt: skip
    if not fused:
        return (_norm_assembly_torch(w_norm_sq, cross_term, ba_norm_sq, scale),)
    if w_norm_sq.numel() == 0:
        return (torch.empty_like(w_norm_sq),)
    return (_norm_assembly_triton(w_norm_sq, cross_term, ba_norm_sq, scale),)


def fused_dora_compose_autograd(
    lora: torch.Tensor, base: torch.Tensor, mag_norm_scale: torch.Tensor, scale: float
) -> torch.Tensor:
    """Training-time composition through :class:`FusedDoRAComposeFunction` (fused backward); under
    ``torch.compile`` through the ``peft::fused_dora_compose`` op, so the graph does not break."""
    if torch.compiler.is_compiling():
        return torch.ops.peft.fused_dora_compose(lora, base, mag_norm_scale, float(scale))
    return FusedDoRAComposeFunction.apply(lora, base, mag_norm_scale, float(scale))
