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
"""DoRA decode: the LoRA branch and the adapted output of a few tokens in two Triton launches.

A decode step with a KV cache feeds each projection one token per sequence; the GPU finishes each op long before
the host has issued the next, so the step costs what the host spends issuing it. For a DoRA Linear in inference the
host issued ``F.linear(x, A)``, ``F.linear(a, B)`` and two in-place composition ops with the reused scale
(the ``small_forward`` tier): on the H200 machine each cuBLAS call cost ~17 µs of host time and each
elementwise op ~6 µs. Here, for at most :data:`MAX_TOKENS` rows,

* :func:`_decode_a_kernel`: ``a = x·Aᵀ`` in the compute dtype (autocast's, or the tensors' own), each product of
  compute-dtype values accumulated in fp32 and ``a`` rounded to the compute dtype, as ``F.linear`` does;
* :func:`_decode_out_kernel`: ``lora = a·Bᵀ`` the same way, then ``y = g·(result + s·lora) + (1 − g)·bias`` from the
  reused factors, in fp32, rounded once.

The two GEMVs are broadcast products reduced in registers (no ``tl.dot``: it needs 16 rows): at one to eight rows
they are bound by reading ``A`` and ``B``, which each program streams once per launch.
"""

from __future__ import annotations

from typing import Optional

import torch

from .dora_dispatch import DECODE_MAX_ROWS as MAX_TOKENS
from .dora_dispatch import mixed_output, row_stride
from .dora_launch import HAS_TRITON
from .dora_launch import cdiv as _cdiv
from .dora_launch import next_pow2 as _next_pow2


_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INT32 = 2**31

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .dora_launch import Launcher

    @triton.jit
    def _rows_dot(
        x_ptr, stride_x, tokens, token_mask, w_ptr, stride_w, rows, row_mask, n_k, dtype_ptr, BLOCK_K: tl.constexpr
    ):
        """acc[t, j] = Σ_k x[t, k]·W[j, k] over ``n_k`` columns (unit column stride), both factors rounded to
        ``dtype_ptr``'s element type (the compute dtype) and the products summed in fp32: one GEMV step of F.linear
        for a few rows, as a broadcast product reduced in registers."""
        acc = tl.zeros((tokens.shape[0], rows.shape[0]), dtype=tl.float32)
        for k0 in range(0, n_k, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < n_k
            x = tl.load(
                x_ptr + tokens[:, None] * stride_x + ks[None, :], mask=token_mask[:, None] & k_mask[None, :], other=0.0
            )
            w = tl.load(
                w_ptr + rows[:, None] * stride_w + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0
            )
            x = x.to(dtype_ptr.dtype.element_ty).to(tl.float32)
            w = w.to(dtype_ptr.dtype.element_ty).to(tl.float32)
            acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
        return acc

    @Launcher
    @triton.jit
    def _decode_a_kernel(
        x_ptr, w_ptr, a_ptr, n_tokens, d_in, rank, stride_x, stride_w,
        BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """a[t, j] = Σ_k x[t, k]·A[j, k] for BLOCK_R rows j of A; inputs rounded to a's dtype, fp32 sums."""
        pid = tl.program_id(0).to(tl.int64)
        rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
        tokens = tl.arange(0, BLOCK_T)
        row_mask, token_mask = rows < rank, tokens < n_tokens
        acc = _rows_dot(x_ptr, stride_x, tokens, token_mask, w_ptr, stride_w, rows, row_mask, d_in, a_ptr, BLOCK_K)
        out = a_ptr + tokens[:, None] * rank + rows[None, :]
        tl.store(out, acc.to(a_ptr.dtype.element_ty), mask=token_mask[:, None] & row_mask[None, :])

    @Launcher
    @triton.jit
    def _decode_out_kernel(
        a_ptr, w_ptr, result_ptr, f_ptr, out_ptr, n_tokens, rank, d_out, stride_w, stride_result, stride_out, scale,
        HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    ):  # fmt: skip
        """lora = a·Bᵀ for BLOCK_N output columns (rounded to a's dtype), then out = g·(result + s·lora) + f₁ with
        g = f[0] and f₁ = f[1] = (1 − g)·bias, in fp32 and rounded once."""
        pid = tl.program_id(0).to(tl.int64)
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        tokens = tl.arange(0, BLOCK_T)
        col_mask, token_mask = cols < d_out, tokens < n_tokens
        acc = _rows_dot(a_ptr, rank, tokens, token_mask, w_ptr, stride_w, cols, col_mask, rank, a_ptr, BLOCK_R)
        lora = acc.to(a_ptr.dtype.element_ty).to(tl.float32)
        mask = token_mask[:, None] & col_mask[None, :]
        result = tl.load(result_ptr + tokens[:, None] * stride_result + cols[None, :], mask=mask, other=0.0).to(
            tl.float32
        )
        g = tl.load(f_ptr + cols, mask=col_mask, other=0.0)[None, :]
        out = g * (result + scale * lora)
        if HAS_BIAS:
            out += tl.load(f_ptr + d_out + cols, mask=col_mask, other=0.0)[None, :]
        tl.store(out_ptr + tokens[:, None] * stride_out + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype ``F.linear`` computes in for ``x``: autocast's where it is on for ``x``'s device, else ``x``'s."""
    device_type = x.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype


def decode_layout(x, result, weight_a, weight_b) -> Optional[tuple[int, int, torch.dtype]]:
    """(x's row stride, result's row stride, compute dtype) where :func:`decode_output` computes what
    ``F.linear(F.linear(x, A), B)`` and the composition would, else None (the matmul path then runs, with its own
    errors for what F.linear rejects): 1 to :data:`MAX_TOKENS` rows; float tensors on one device; without autocast
    x, A and B in one dtype; ``result`` in the compute dtype (or fp32 beside a half one, or half beside an fp32 one,
    ``dora_dispatch.mixed_output``: the output then is fp32); A and B with unit column stride and fewer than 2³¹
    elements; x and result as rows of matching shapes."""
    d_out = result.shape[-1] if result.dim() else 0
    if d_out == 0 or result.numel() > MAX_TOKENS * d_out or result.numel() == 0:
        return None
    dtype = compute_dtype(x)
    if dtype not in _FLOAT_DTYPES or (result.dtype != dtype and not mixed_output(result.dtype, dtype)):
        return None
    if weight_a.dim() != 2 or weight_b.dim() != 2 or weight_a.stride(1) != 1 or weight_b.stride(1) != 1:
        return None
    rank, d_in = weight_a.shape
    if weight_b.shape != (d_out, rank) or x.shape[-1] != d_in or x.shape[:-1] != result.shape[:-1] or rank == 0:
        return None
    if weight_a.numel() >= _INT32 or weight_b.numel() >= _INT32:
        return None  # the kernels' int32 offsets
    if dtype != x.dtype or dtype != weight_a.dtype or dtype != weight_b.dtype:
        if not torch.is_autocast_enabled(x.device.type):
            return None
        if x.dtype not in _FLOAT_DTYPES or weight_a.dtype not in _FLOAT_DTYPES or weight_b.dtype not in _FLOAT_DTYPES:
            return None
    device = result.device
    if x.device != device or weight_a.device != device or weight_b.device != device:
        return None
    stride_x, stride_result = row_stride(x), row_stride(result)
    if stride_x is None or stride_result is None or max(stride_x, stride_result) * MAX_TOKENS >= _INT32:
        return None
    return stride_x, stride_result, dtype


def plan_key(x: torch.Tensor, result: torch.Tensor) -> tuple:
    """What a :class:`DecodePlan` is valid for besides the factors (W, A, B, m, bias, s, whose reused ``factors``
    tensor it holds): the rows' shapes, strides, dtypes and 16-byte alignment, the compute dtype, the device and, on
    CUDA, the current stream (the plan's ``a`` buffer is written and read in stream order)."""
    stream = torch._C._cuda_getCurrentRawStream(result.get_device()) if result.is_cuda else None
    return (
        x.shape, x.stride(), x.dtype, x.data_ptr() & 15, result.shape, result.stride(), result.dtype,
        result.data_ptr() & 15, compute_dtype(x), result.device, stream,
    )  # fmt: skip


class DecodePlan:
    """The two launches of :func:`decode_output` for one signature: grids, block sizes and integer arguments fixed,
    the ``[rows, r]`` buffer for ``a`` allocated once, and (after the first call) Triton's compiled kernels called
    directly (the token ``Launcher.launch`` returns, then ``Launcher.repeat``), so a repeated decode step skips the
    layout checks, the launch signatures and one allocation. A layer keeps one (``dora_cache.LayerReuse.decode``),
    valid while :func:`plan_key` of its inputs (which includes the stream: the buffer is reused in stream order) and
    its reused factors tensor (``factors``, by identity) hold."""

    __slots__ = ("key", "factors", "contiguous", "out_dtype", "weight_a", "weight_b", "a", "ints_a", "ints_out",
                 "grid_a", "grid_out", "meta_a", "meta_out", "token_a", "token_out")  # fmt: skip

    def __init__(self, key, x, result, weight_a, weight_b, factors, scale: float, layout, has_bias: bool) -> None:
        stride_x, stride_result, dtype = layout
        self.key, self.factors, self.weight_a, self.weight_b = key, factors, weight_a, weight_b
        rank, d_in = weight_a.shape
        d_out = weight_b.shape[0]
        tokens = result.numel() // d_out
        self.a = torch.empty((tokens, rank), dtype=dtype, device=result.device)
        # the output is written as contiguous rows: `empty_like` (the cheaper allocation) where `result` has them;
        # in the wider of the compute dtype and result's (PyTorch's promotion), None where that is result's own
        self.contiguous = result.is_contiguous()
        out_dtype = torch.promote_types(dtype, result.dtype)
        self.out_dtype = None if out_dtype == result.dtype else out_dtype
        block_t = _next_pow2(tokens)
        block_r = 4 if rank <= 128 else 8
        block_k = max(32, min(1024, 4096 // (block_t * block_r)))
        self.grid_a = (_cdiv(rank, block_r),)
        self.meta_a = {"BLOCK_T": block_t, "BLOCK_R": block_r, "BLOCK_K": block_k}
        self.ints_a = (tokens, d_in, rank, stride_x, weight_a.stride(0))
        block_n = 32
        self.grid_out = (_cdiv(d_out, block_n),)
        block_rank = max(16, min(128, 4096 // (block_t * block_n)))
        self.meta_out = {"HAS_BIAS": has_bias, "BLOCK_T": block_t, "BLOCK_N": block_n, "BLOCK_R": block_rank}
        self.ints_out = (tokens, rank, d_out, weight_b.stride(0), stride_result, d_out, float(scale))
        self.token_a = self.token_out = None

    def run(self, x: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
        """The decode output for rows that match the plan's key; a new tensor shaped like ``result``."""
        a = self.a
        # the output takes `result`'s dtype (the compute dtype, or a wider fp32), or the compute dtype's fp32 beside a
        # half result (decode_layout)
        if self.out_dtype is None:
            out = (
                torch.empty_like(result)
                if self.contiguous
                else torch.empty(result.shape, dtype=result.dtype, device=a.device)
            )
        else:
            out = torch.empty(result.shape, dtype=self.out_dtype, device=a.device)
        args_a = (x, self.weight_a, a, *self.ints_a)
        args_out = (a, self.weight_b, result, self.factors, out, *self.ints_out)
        if self.token_a is None:  # first launch: compile or find the kernels, keep them for direct calls
            self.token_a = _decode_a_kernel.launch(self.grid_a, args_a, self.meta_a)
            self.token_out = _decode_out_kernel.launch(self.grid_out, args_out, self.meta_out)
        else:
            _decode_a_kernel.repeat(self.token_a, self.grid_a, args_a, self.meta_a)
            _decode_out_kernel.repeat(self.token_out, self.grid_out, args_out, self.meta_out)
        return out


def decode_output(x, result, weight_a, weight_b, factors, scale: float, layout, has_bias: bool) -> torch.Tensor:
    """``g·(result + s·(x·Aᵀ)·Bᵀ) + (1 − g)·bias`` for the rows of ``x``, a new tensor shaped like ``result``.

    ``layout``: :func:`decode_layout` of these tensors (not None); ``factors``: fp32 ``[1 or 2, d_out]`` contiguous,
    ``g`` and, with ``has_bias``, ``(1 − g)·bias``."""
    return DecodePlan(None, x, result, weight_a, weight_b, factors, scale, layout, has_bias).run(x, result)


def decode_output_torch(x, result, weight_a, weight_b, factors, scale: float, has_bias: bool) -> torch.Tensor:
    """The same in PyTorch (the kernels' twin in tests): F.linear's two matmuls in the compute dtype, then the
    composition in fp32, rounded once."""
    dtype = compute_dtype(x)
    with torch.autocast(x.device.type, enabled=False):
        a = torch.nn.functional.linear(x.to(dtype), weight_a.to(dtype))
        lora = torch.nn.functional.linear(a, weight_b.to(dtype))
    out = factors[0] * (result.float() + scale * lora.float())
    if has_bias:
        out = out + factors[1]
    return out.to(torch.promote_types(dtype, result.dtype))
