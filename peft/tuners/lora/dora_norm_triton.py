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
"""The DoRA weight row norm in one pass over ``W``, with ``B·A`` formed tile by tile on tensor cores:

    norm[i] = sqrt(max(sum_k (W[i, k] + s * (B @ A)[i, k])^2, 0))      fp32 [d_out]

Each program of the first kernel owns ``BLOCK_M`` rows and a contiguous range of columns (a "split"). For every
[BLOCK_M, BLOCK_K] tile it forms ``P = B[rows, :] @ A[:, cols]`` in registers, adds ``W`` and accumulates squares,
then stores its rows' partial sums to ``partial[split, rows]``. The second kernel adds the splits in a fixed order and
takes the root. No atomics, so the result is bitwise repeatable; ``B·A`` never exists in memory.

Dot precision: two adapters of the same half dtype multiply natively (products are exact, fp32 accumulation).
Otherwise both load as fp32 and multiply in TF32 when ``W`` is bf16/fp16 (the autocast case: the TF32 error is far
below ``W``'s own rounding) and in 3xTF32 when ``W`` is fp32. Offsets are int64 throughout: ``W`` may exceed 2^31
elements, and any strides work (a transposed view is read in place).
"""

from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import torch

from .dora_launch import HAS_TRITON, INTERPRET, device_switch
from .dora_launch import cdiv as _cdiv
from .dora_launch import next_pow2 as _next_pow2


__all__ = ["row_norm_supported", "split_norm_supported", "split_row_norm", "triton_row_norm"]

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_HALF_DTYPES = (torch.bfloat16, torch.float16)

# ---------------------------------------------------------------------------------------------------------------
# Triton kernels.
# ---------------------------------------------------------------------------------------------------------------

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .dora_launch import Launcher

    @triton.jit
    def _root(total):
        total = tl.where(total < 0.0, 0.0, total)  # NaN < 0 is false: NaN survives, as with torch.clamp_min
        return tl.sqrt_rn(total)  # correctly rounded, as torch.sqrt (tl.sqrt is approximate)

    @triton.jit
    def _b_tile(b_ptr, rows, ks, n_rows, rank, stride_bm, stride_br):
        mask = (rows[:, None] < n_rows) & (ks[None, :] < rank)
        return tl.load(b_ptr + rows[:, None] * stride_bm + ks[None, :] * stride_br, mask=mask, other=0.0)

    @triton.jit
    def _ba_dot(b, a_ptr, ks, cols, col_mask, rank, stride_ar, stride_ak, p,
                NATIVE: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
        """p += b @ A[ks, cols]: native for a same-dtype half pair, split into bf16 pairs with SPLIT, else fp32
        operands at ``PRECISION``."""
        mask = (ks[:, None] < rank) & col_mask[None, :]
        a = tl.load(a_ptr + ks[:, None] * stride_ar + cols[None, :] * stride_ak, mask=mask, other=0.0)
        if NATIVE:
            return tl.dot(b, a, p)
        if SPLIT:
            # fp32 operands as bf16 hi + lo pairs: hi·hi + hi·lo + lo·hi on the bf16 tensor cores (products exact,
            # fp32 accumulation) keeps ~16 bits of each operand, where one TF32 pass keeps 11 and misses 1e-5.
            b32, a32 = b.to(tl.float32), a.to(tl.float32)
            b_hi, a_hi = b32.to(tl.bfloat16), a32.to(tl.bfloat16)
            b_lo, a_lo = (b32 - b_hi.to(tl.float32)).to(tl.bfloat16), (a32 - a_hi.to(tl.float32)).to(tl.bfloat16)
            p = tl.dot(b_lo, a_hi, p)
            p = tl.dot(b_hi, a_lo, p)
            return tl.dot(b_hi, a_hi, p)
        return tl.dot(b.to(tl.float32), a.to(tl.float32), p, input_precision=PRECISION)

    @Launcher
    @triton.jit
    def _row_norm_partial_kernel(
        w_ptr, a_ptr, b_ptr, partial_ptr,
        n_rows, n_cols, rank, n_row_blocks, cols_per_split, scale, inv_scale,
        stride_wm, stride_wk, stride_ar, stride_ak, stride_bm, stride_br,
        NATIVE: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr, B_RESIDENT: tl.constexpr,
        FINISH: tl.constexpr, FOLD: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    ):  # fmt: skip
        """partial[split, rows] = sum over the split's columns of (W + s·B·A)²; with FINISH (one split) the root.

        Row blocks vary fastest, so programs in flight together share the split's A tiles in L2. With B_RESIDENT
        (rank <= BLOCK_R) the program's B rows are loaded once instead of once per column tile. With FOLD the tile
        starts from ``W/s`` as the dots' accumulator and the sums are scaled by ``s²`` at the end: ``s·(B·A)`` as a
        product of its own, added to ``W``, took the kernel from 34 to 53 µs on a Llama-8B gate projection (H200,
        ``benchmarks/probe_norm_kernel.py --variants --toggles``); Triton adds a tile to a dot's result in its
        accumulator, not a scaled one.
        """
        pid = tl.program_id(0).to(tl.int64)
        split = pid // n_row_blocks
        rows = (pid % n_row_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
        col_start = split * cols_per_split
        col_end = tl.minimum(col_start + cols_per_split, n_cols)
        r_offs = tl.arange(0, BLOCK_R).to(tl.int64)
        if B_RESIDENT:
            b_res = _b_tile(b_ptr, rows, r_offs, n_rows, rank, stride_bm, stride_br)
        acc = tl.zeros([BLOCK_M], dtype=tl.float32)
        for c in range(col_start, col_end, BLOCK_K):
            cols = c + tl.arange(0, BLOCK_K)
            col_mask = cols < n_cols
            w_mask = (rows[:, None] < n_rows) & col_mask[None, :]
            w = tl.load(w_ptr + rows[:, None] * stride_wm + cols[None, :] * stride_wk, mask=w_mask, other=0.0)
            if FOLD:
                p = w.to(tl.float32) * inv_scale
            else:
                p = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
            if B_RESIDENT:
                p = _ba_dot(
                    b_res, a_ptr, r_offs, cols, col_mask, rank, stride_ar, stride_ak, p, NATIVE, SPLIT, PRECISION
                )
            else:
                for r0 in range(0, rank, BLOCK_R):
                    ks = r0 + r_offs
                    b = _b_tile(b_ptr, rows, ks, n_rows, rank, stride_bm, stride_br)
                    p = _ba_dot(b, a_ptr, ks, cols, col_mask, rank, stride_ar, stride_ak, p, NATIVE, SPLIT, PRECISION)
            v = p if FOLD else w.to(tl.float32) + scale * p
            # Padded columns hold 0 unless B is non-finite (Inf·0): keep them out of the row sums.
            v = tl.where(col_mask[None, :], v, 0.0)
            # A [BLOCK_M] accumulator rather than a [BLOCK_M, BLOCK_K] one: ~30 fewer registers a thread on sm_90.
            acc += tl.sum(v * v, axis=1)
        if FOLD:
            acc = acc * (scale * scale)
        if FINISH:
            acc = _root(acc)
        tl.store(partial_ptr + split * n_rows + rows, acc, mask=rows < n_rows)

    @Launcher
    @triton.jit
    def _row_norm_finish_kernel(partial_ptr, out_ptr, n_rows, n_splits, BLOCK: tl.constexpr):
        """out[i] = sqrt(max(sum over splits of partial[:, i], 0)), the splits added one by one in order."""
        pid = tl.program_id(0).to(tl.int64)
        rows = pid * BLOCK + tl.arange(0, BLOCK)
        mask = rows < n_rows
        ptrs = partial_ptr + rows
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for _ in range(0, n_splits):
            total += tl.load(ptrs, mask=mask, other=0.0)
            ptrs += n_rows  # a pointer step, so split * n_rows is never formed in int32
        tl.store(out_ptr + rows, _root(total), mask=mask)

    @Launcher
    @triton.jit
    def _hi_lo_kernel(
        a_ptr, h_ptr, rank, n_cols, stride_ar, stride_ak, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
        HI_AGAIN: tl.constexpr,
    ):  # fmt: skip
        """h[k, j] = hi(A[j, k]) and h[k, rank + j] = lo(A[j, k]) for A [rank, n_cols] (any float dtype, any strides)
        into h [n_cols, 2·rank] (half, contiguous): hi is A rounded to h's dtype, lo the rounded remainder. With
        HI_AGAIN h is [n_cols, 3·rank] and h[k, 2·rank + j] = hi(A[j, k]) once more (the [hi | lo | hi] factor of
        a three-product split GEMM)."""
        pid = tl.program_id(0).to(tl.int64)
        n_r_blocks = tl.cdiv(rank, BLOCK_R)
        rows = (pid % n_r_blocks) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = (pid // n_r_blocks) * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = (rows[:, None] < rank) & (cols[None, :] < n_cols)
        a = tl.load(a_ptr + rows[:, None] * stride_ar + cols[None, :] * stride_ak, mask=mask, other=0.0)
        a = a.to(tl.float32)
        hi = a.to(h_ptr.dtype.element_ty)
        lo = (a - hi.to(tl.float32)).to(h_ptr.dtype.element_ty)  # a - hi is exact in fp32
        dst = h_ptr + cols[None, :] * ((3 if HI_AGAIN else 2) * rank) + rows[:, None]
        tl.store(dst, hi, mask=mask)
        tl.store(dst + rank, lo, mask=mask)
        if HI_AGAIN:
            tl.store(dst + 2 * rank, hi, mask=mask)

    @Launcher
    @triton.jit
    def _gram_split_kernel(g_ptr, out_ptr, rank, PAIRS: tl.constexpr, BLOCK: tl.constexpr):
        """The Gram G = A·Aᵀ, written as [hi(G); hi(G); lo(G)] [3·rank, rank] in out's half dtype, from the fp32
        product [rank, rank] of a half A with itself, or with PAIRS from the [2·rank, 2·rank] product of [hi | lo]
        with itself (G is the sum of its four [rank, rank] blocks)."""
        pid = tl.program_id(0).to(tl.int64)
        n_blocks = tl.cdiv(rank, BLOCK)
        rows = (pid // n_blocks) * BLOCK + tl.arange(0, BLOCK)
        cols = (pid % n_blocks) * BLOCK + tl.arange(0, BLOCK)
        mask = (rows[:, None] < rank) & (cols[None, :] < rank)
        at = g_ptr + rows[:, None] * ((2 if PAIRS else 1) * rank) + cols[None, :]
        g = tl.load(at, mask=mask, other=0.0)
        if PAIRS:
            g += tl.load(at + rank, mask=mask, other=0.0)
            g += tl.load(at + 2 * rank * rank, mask=mask, other=0.0)
            g += tl.load(at + 2 * rank * rank + rank, mask=mask, other=0.0)
        hi = g.to(out_ptr.dtype.element_ty)
        lo = (g - hi.to(tl.float32)).to(out_ptr.dtype.element_ty)
        dst = out_ptr + rows[:, None] * rank + cols[None, :]
        tl.store(dst, hi, mask=mask)
        tl.store(dst + rank * rank, hi, mask=mask)
        tl.store(dst + 2 * rank * rank, lo, mask=mask)

    @Launcher
    @triton.jit
    def _norm_epilogue_kernel(
        u_ptr, bg_ptr, b_ptr, w_sq_ptr, out_ptr, n_rows, rank, stride_bm, stride_br, two_s, s2,
        PAIRS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        """out[i] = sqrt(max(w_sq[i] + sum_c B[i, c]·(2s·U[i, c] + s²·(B·G)[i, c]), 0)).

        U = W·Aᵀ [n_rows, rank] fp32, or with PAIRS [n_rows, 2·rank] holding W·hi(A)ᵀ and W·lo(A)ᵀ side by side
        (U[i, c] + U[i, rank + c]); B·G [n_rows, rank] fp32; both contiguous. A program owns BLOCK_M rows and walks
        the rank."""
        pid = tl.program_id(0).to(tl.int64)
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < n_rows
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for c0 in range(0, rank, BLOCK_N):
            cols = c0 + tl.arange(0, BLOCK_N)
            mask = row_mask[:, None] & (cols[None, :] < rank)
            u_at = u_ptr + rows[:, None] * ((2 if PAIRS else 1) * rank) + cols[None, :]
            u = tl.load(u_at, mask=mask, other=0.0)
            if PAIRS:
                u += tl.load(u_at + rank, mask=mask, other=0.0)
            bg = tl.load(bg_ptr + rows[:, None] * rank + cols[None, :], mask=mask, other=0.0)
            b = tl.load(b_ptr + rows[:, None] * stride_bm + cols[None, :] * stride_br, mask=mask, other=0.0)
            acc += b.to(tl.float32) * (two_s * u + s2 * bg)
        total = tl.sum(acc, axis=1) + tl.load(w_sq_ptr + rows, mask=row_mask, other=0.0)
        tl.store(out_ptr + rows, _root(total), mask=row_mask)


# ---------------------------------------------------------------------------------------------------------------
# Support checks, launch policy and launcher.
# ---------------------------------------------------------------------------------------------------------------

# H200 SM count, used when there is no CUDA device to ask (the interpreter).
_DEFAULT_SM_COUNT = 132


class _Policy(NamedTuple):
    block_m: int
    block_k: int
    num_warps: int
    num_stages: int
    programs_per_sm: int  # splits are added until row blocks x splits reach about this many programs per SM
    min_tiles_per_split: int  # ... keeping at least this many column tiles in each


# B resident (rank <= 64, all that auto gives the kernel): the fastest of a grid of tiles, warps, stages and splits
# on the H200 summed over a Llama-8B layer's projections at r = 16, 32 and 64, bf16 and fp32 adapters, W read cold
# (``benchmarks/probe_norm_kernel.py``, ``results/profile/probe_norm_kernel_*.json``): 165-200 µs against 208-272
# for the 64 x 64 tiles, 3 stages and two programs per SM it replaced (r = 16). Many short splits keep enough loads in
# flight for a memory-bound pass; the finish pass adds them in order.
_RESIDENT = _Policy(block_m=64, block_k=128, num_warps=4, num_stages=2, programs_per_sm=8, min_tiles_per_split=1)
# Looping over the rank (PEFT_DORA_NORM_KERNEL=1 above rank 64): 64 x 64 tiles, 3 stages; warps from ptxas' register
# counts for sm_90 (4 warps need 253-255 registers a thread and spill with 3xTF32, 8 need 120-222 and do not).
_RANK_LOOP = _Policy(block_m=64, block_k=64, num_warps=8, num_stages=3, programs_per_sm=2, min_tiles_per_split=4)
_FINISH_BLOCK = 256


class _Config(NamedTuple):
    block_m: int
    block_k: int
    block_r: int
    cols_per_split: int
    num_warps: int
    num_stages: int


def _unsupported(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor) -> str | None:
    """Why the kernels cannot take these tensors (None when they can); shape reasons start with 'shapes'."""
    if not HAS_TRITON:
        return "Triton is not installed"
    if torch.compiler.is_compiling():
        return "called under torch.compile"
    if weight.dim() != 2 or lora_A.dim() != 2 or lora_B.dim() != 2:
        return f"shapes: W, A and B must be 2-D, got {weight.dim()}-D, {lora_A.dim()}-D and {lora_B.dim()}-D"
    (d_out, d_in), r = weight.shape, lora_A.shape[0]
    if lora_A.shape != (r, d_in) or lora_B.shape != (d_out, r):
        return (
            f"shapes do not chain: W {tuple(weight.shape)}, A {tuple(lora_A.shape)}, B {tuple(lora_B.shape)} "
            f"(expected A [r, {d_in}] and B [{d_out}, r])"
        )
    if r < 1 or d_out < 1:
        return f"shapes: rank and d_out must be >= 1, got r={r}, d_out={d_out}"
    if weight.device != lora_A.device or weight.device != lora_B.device:
        return f"tensors on different devices: {weight.device}, {lora_A.device}, {lora_B.device}"
    if not (weight.is_cuda or (INTERPRET and weight.device.type != "meta")):
        return f"device {weight.device} (the kernels need CUDA, or TRITON_INTERPRET=1)"
    if any(t.dtype not in _KERNEL_DTYPES for t in (weight, lora_A, lora_B)):
        return f"dtypes {weight.dtype}, {lora_A.dtype}, {lora_B.dtype} (fp32, bf16 and fp16 only)"
    return None


def row_norm_supported(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor) -> bool:
    """True when :func:`triton_row_norm` can run on these tensors; otherwise callers use the PyTorch norm."""
    return _unsupported(weight, lora_A, lora_B) is None


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int | None) -> int:
    if device_index is None:
        return _DEFAULT_SM_COUNT
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=64)
def _launch_config(n_rows: int, n_cols: int, rank_bucket: int, sm_count: int) -> _Config:
    """Blocks and the column split for a [n_rows, n_cols] weight, from ``_RESIDENT`` or ``_RANK_LOOP``.

    BLOCK_R is the rank rounded up to a power of two in [16, 64] (tl.dot needs every dim >= 16; masking pads with
    zeros), so all ranks share three variants. The split width is a runtime argument, not a compiled constant, so
    the exact sizes cost nothing but a cache entry per layer shape.
    """
    block_r = min(64, max(16, rank_bucket))
    return _policy_config(_RESIDENT if rank_bucket <= block_r else _RANK_LOOP, n_rows, n_cols, block_r, sm_count)


def _policy_config(policy: _Policy, n_rows: int, n_cols: int, block_r: int, sm_count: int) -> _Config:
    """``policy``'s blocks, and splits added until row blocks x splits reach about ``policy.programs_per_sm`` per SM,
    keeping at least ``policy.min_tiles_per_split`` column tiles in each."""
    n_col_tiles = -(-n_cols // policy.block_k)
    row_blocks = -(-n_rows // policy.block_m)
    max_splits = max(1, n_col_tiles // policy.min_tiles_per_split)
    n_splits = min(max_splits, -(-policy.programs_per_sm * sm_count // row_blocks))
    tiles_per_split = -(-n_col_tiles // n_splits)
    cols = tiles_per_split * policy.block_k
    return _Config(policy.block_m, policy.block_k, block_r, cols, policy.num_warps, policy.num_stages)


def _dot_mode(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor) -> tuple[bool, bool, str]:
    """(NATIVE, SPLIT, PRECISION) for the B·A tiles."""
    if lora_A.dtype == lora_B.dtype and lora_A.dtype in _HALF_DTYPES:
        # The interpreter multiplies bf16 tiles as their raw uint16 storage, so there the pair is upcast instead:
        # bf16 x bf16 products are exact in fp32, so "ieee" fp32 dots compute the same sums as the native ones.
        if INTERPRET and lora_A.dtype == torch.bfloat16:
            return False, False, "ieee"
        return True, False, "ieee"  # PRECISION is unused on the native path; one fixed value avoids extra variants
    if weight.dtype == torch.float32:
        return False, False, "tf32x3"
    # Half W with fp32 (or mixed) adapters, PEFT's autocast default. One TF32 pass measured 1.1-1.3e-5 relative
    # error on the H200 for ||s·B·A|| = 0.1·||W|| (target 1e-5) and ran slowly in fp32 registers; bf16 hi/lo
    # pairs (three bf16 products) keep ~16 bits. The interpreter multiplies bf16 tiles wrongly: fp32 "ieee" there.
    if INTERPRET:
        return False, False, "ieee"
    return False, True, "ieee"


# ``W/s`` and its square stay far inside fp32's range for a half W (|W| <= 65504) at these scales; outside them (and
# for s = 0) the kernel adds ``s·(B·A)`` to ``W`` as a product of its own.
_FOLD_SCALES = (2.0**-16, 2.0**16)


def _folds(weight: torch.Tensor, scale: float) -> bool:
    """Whether the kernel starts its tiles from ``W/s`` (FOLD): a half W and ``_FOLD_SCALES[0] <= |s| <= [1]``."""
    return weight.dtype in _HALF_DTYPES and _FOLD_SCALES[0] <= abs(float(scale)) <= _FOLD_SCALES[1]


def _row_norm_triton(weight, lora_A, lora_B, scale, config: _Config):
    d_out, d_in = weight.shape
    rank = lora_A.shape[0]
    out = torch.empty(d_out, dtype=torch.float32, device=weight.device)
    row_blocks = _cdiv(d_out, config.block_m)
    n_splits = _cdiv(d_in, config.cols_per_split)
    # One split: the first kernel takes the root and writes the output directly (one launch instead of two).
    partial = out if n_splits == 1 else torch.empty((n_splits, d_out), dtype=torch.float32, device=weight.device)
    native, split, precision = _dot_mode(weight, lora_A, lora_B)
    fold = _folds(weight, scale)
    with device_switch(weight) or contextlib.nullcontext():
        _row_norm_partial_kernel[(row_blocks * n_splits,)](
            weight, lora_A, lora_B, partial,
            d_out, d_in, rank, row_blocks, config.cols_per_split, float(scale), 1.0 / scale if fold else 1.0,
            weight.stride(0), weight.stride(1), lora_A.stride(0), lora_A.stride(1),
            lora_B.stride(0), lora_B.stride(1),
            NATIVE=native, SPLIT=split, PRECISION=precision, B_RESIDENT=rank <= config.block_r, FINISH=n_splits == 1,
            FOLD=fold,
            BLOCK_M=config.block_m, BLOCK_K=config.block_k, BLOCK_R=config.block_r,
            num_warps=config.num_warps, num_stages=config.num_stages, enable_fp_fusion=False,
        )  # fmt: skip
        if n_splits > 1:
            grid = (_cdiv(d_out, _FINISH_BLOCK),)
            _row_norm_finish_kernel[grid](partial, out, d_out, n_splits, BLOCK=_FINISH_BLOCK, enable_fp_fusion=False)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Public functions.
# ---------------------------------------------------------------------------------------------------------------


def triton_row_norm(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scale: float) -> torch.Tensor:
    """``||W + scale·B·A||`` per row of ``W`` as a new contiguous fp32 [d_out] tensor, without forming ``B·A``.

    Args:
        weight: ``W``, [d_out, d_in], fp32, bf16 or fp16, any strides (a transposed view is read in place).
        lora_A: ``A``, [r, d_in], fp32, bf16 or fp16, any strides.
        lora_B: ``B``, [d_out, r], fp32, bf16 or fp16, any strides.
        scale: the LoRA scaling ``s``.

    Raises ValueError when the shapes do not chain and RuntimeError for anything else :func:`row_norm_supported`
    rejects. Autograd and autocast play no part: the result is detached and no torch matmul runs.
    """
    reason = _unsupported(weight, lora_A, lora_B)
    if reason is not None:
        raise (ValueError if reason.startswith("shapes") else RuntimeError)(f"triton_row_norm: {reason}")
    return row_norm_checked(weight, lora_A, lora_B, scale)


def row_norm_checked(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`triton_row_norm` for callers that have just seen :func:`row_norm_supported` return True (the checks
    cost host time on every DoRA forward, so the hot path runs them once)."""
    d_out, d_in = weight.shape
    if d_in == 0:
        return torch.zeros(d_out, dtype=torch.float32, device=weight.device)
    sm_count = _sm_count(weight.device.index if weight.is_cuda else None)
    config = _launch_config(d_out, d_in, _next_pow2(lora_A.shape[0]), sm_count)
    return _row_norm_triton(weight, lora_A, lora_B, scale, config)


# ---------------------------------------------------------------------------------------------------------------
# The norm through cuBLAS: fp32 adapters on a half weight (PEFT's autocast default) with a hi/lo split of A, or half
# adapters of the weight's dtype at ranks where the one-pass kernel's products are slower than cuBLAS GEMMs; one
# epilogue kernel.
# ---------------------------------------------------------------------------------------------------------------

_SPLIT_BLOCK_R, _SPLIT_BLOCK_K = 32, 64
_GRAM_BLOCK = 32
_EPILOGUE_BLOCK_M = 16
_SPLIT_MAX_RANK = 16384


def split_norm_supported(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor) -> bool:
    """True when :func:`split_row_norm` can take these tensors: a bf16/fp16 ``W`` with fp32 ``A`` or ``A`` of
    ``W``'s dtype (``B`` fp32, bf16 or fp16), all 2-D and chained, non-empty, on one CUDA device (or the
    interpreter), rank at most ``_SPLIT_MAX_RANK`` (the Gram split kernel forms block offsets of 2·r² in int32)."""
    if weight.dtype not in _HALF_DTYPES or lora_A.dtype not in (torch.float32, weight.dtype):
        return False
    if lora_B.dtype not in _KERNEL_DTYPES:
        return False
    if _unsupported(weight, lora_A, lora_B) is not None or lora_A.shape[0] > _SPLIT_MAX_RANK:
        return False
    return weight.shape[1] > 0


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of two half matrices with fp32 output: one cuBLAS GEMM on the tensor cores (fp32 accumulation);
    upcast operands elsewhere (the interpreter's CPU tensors), where the products are the same exact ones."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def _split_t(t: torch.Tensor, dtype: torch.dtype, hi_again: bool = False) -> torch.Tensor:
    """``t`` [r, n] as ``[hi(t)ᵀ | lo(t)ᵀ]`` [n, 2r] in ``dtype`` (one launch; hi + lo keeps ~16 mantissa bits), or
    with ``hi_again`` as ``[hi(t)ᵀ | lo(t)ᵀ | hi(t)ᵀ]`` [n, 3r]."""
    r, n = t.shape
    h = torch.empty((n, (3 if hi_again else 2) * r), dtype=dtype, device=t.device)
    grid = (_cdiv(r, _SPLIT_BLOCK_R) * _cdiv(n, _SPLIT_BLOCK_K),)
    _hi_lo_kernel[grid](
        t, h, r, n, t.stride(0), t.stride(1), BLOCK_R=_SPLIT_BLOCK_R, BLOCK_K=_SPLIT_BLOCK_K, HI_AGAIN=hi_again
    )
    return h


def split_row_norm(
    weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scale: float, w_sq: torch.Tensor, cols: int
) -> torch.Tensor:
    """``||W + s·B·A||`` per row, fp32 [d_out], for callers that have seen :func:`split_norm_supported` return True.

    ``W·Aᵀ`` and the Gram ``G = A·Aᵀ`` run as half-precision GEMMs on the tensor cores with fp32 output (two launches
    for a chunk of ``cols`` columns), an fp32 ``A`` split into a hi and a lo half part (one more launch) and a half
    ``A`` as it is (its products are exact in fp32, as in the one-pass kernel). ``B·G`` is a third GEMM, of
    ``[hi(B) | lo(B) | hi(B)]`` and ``[hi(G); hi(G); lo(G)]`` in bf16 (hi·hi + lo·hi + hi·lo, fp32 accumulation; bf16
    rather than an fp16 W's dtype, as G grows with d_in and fp16's range is small), and one row-wise kernel forms
    ``sqrt(max(w_sq + rowsum(B ⊙ (2s·U + s²·B·G)), 0))``. ``w_sq`` is ``||W||²_row`` (fp32 [d_out]). Rounding A to
    bf16 alone measured up to 1.1e-5 relative error in the norm (‖s·B·A‖ = 0.1‖W‖, H200), above the 1e-5 contract;
    the split keeps it near 1e-7. ``B·G`` through cuBLAS took less than half the time of the same product in 3xTF32
    inside a Triton epilogue on the H200 (a [14336, 384] B: the B and Gram splits, the GEMM and the epilogue about
    77 µs, the previous epilogue 188 µs; probe split_norm_candidates.py, in git history).
    """
    d_out, d_in = weight.shape
    r = lora_A.shape[0]
    dtype = weight.dtype
    u = gram2 = None
    with device_switch(weight) or contextlib.nullcontext():
        paired = lora_A.dtype != dtype  # fp32 A: [hi | lo] pairs in U and in the Gram's product
        for c in range(0, d_in, cols):
            w_c, a_c = (weight, lora_A) if cols >= d_in else (weight[:, c : c + cols], lora_A[:, c : c + cols])
            h = _split_t(a_c, dtype) if paired else a_c.T
            u_c, g_c = _mm_fp32(w_c, h), _mm_fp32(h.T, h)
            u, gram2 = (u_c, g_c) if u is None else (u.add_(u_c), gram2.add_(g_c))
        # bf16 whatever W's dtype: G grows with d_in and could overflow fp16's range
        g3 = torch.empty((3 * r, r), dtype=torch.bfloat16, device=weight.device)
        blocks = _cdiv(r, _GRAM_BLOCK)
        _gram_split_kernel[(blocks * blocks,)](gram2, g3, r, PAIRS=paired, BLOCK=_GRAM_BLOCK)
        bg = _mm_fp32(_split_t(lora_B.T, torch.bfloat16, hi_again=True), g3)
        out = torch.empty(d_out, dtype=torch.float32, device=weight.device)
        _norm_epilogue_kernel[(_cdiv(d_out, _EPILOGUE_BLOCK_M),)](
            u, bg, lora_B, w_sq, out, d_out, r, lora_B.stride(0), lora_B.stride(1), 2.0 * scale, scale * scale,
            PAIRS=paired, BLOCK_M=_EPILOGUE_BLOCK_M, BLOCK_N=min(128, max(16, _next_pow2(r))), enable_fp_fusion=False,
        )  # fmt: skip
    return out
