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
"""DoRA on bitsandbytes 4-bit (NF4, FP4) and 8-bit (LLM.int8) base layers, without a dense weight.

Upstream's QDoRA dequantizes the whole weight in every forward, for the norm and (with LoRA dropout) for
``F.linear(dropout(x), W)``, whose backward then keeps the dense ``W`` alive until the backward runs. Here:

* :class:`QuantizedWeight` stands for the weight: its dtype is the dequantized one, and ``rows(start, stop)``
  dequantizes one block of rows at a time straight from the packed storage (``torch.ops.bitsandbytes``), so the norm
  never holds more than a chunk of ``W``; the memos key on the quantized parameter, which a requantization or a
  merge replaces;
* :func:`row_norm` is the factored norm over those chunks: ``‖W‖²_row`` (kept by the caller while the frozen
  quantized storage is unchanged), ``U = W·Aᵀ`` chunk by chunk and the Gram ``A·Aᵀ``;
* with LoRA dropout the base output of the dropped-out input is upstream's ``F.linear(x, W)`` with ``W`` dequantized
  in the forward and again in the backward (``base_output``), never saved between them.

Other quantizers (HQQ, torchao, GPTQ, ...) keep upstream's dequantization (``dequantize_module_weight``).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from . import dora_dist
from .dora_norm import acc_operand, chain_shapes, combine_row_norm, matmul_operand
from .dora_settings import get_dora_norm_threshold_bytes


# A chunk of dequantized rows is at most this many bytes (or the norm's budget, PEFT_DORA_NORM_CHUNK_MB, if smaller):
# the dense weight of an 8B-class MLP projection (117 MB in bf16) is never built whole, and chunks stay large enough
# (4096 rows of 4096 columns) for the GEMM to run at speed.
CHUNK_BYTES = 32 << 20

# LLM.int8's row scale: W = int8 · SCB / 127, with 1/127 as upstream writes it (fp32's 1/127, the value a float
# tensor's product with either literal uses)
_INT8_SCALE = 7.874015718698502e-3


def quantized_kind(weight) -> Optional[str]:
    """``"4bit"`` or ``"8bit"`` for a bitsandbytes quantized parameter, else None (by class name, as upstream does,
    so bitsandbytes is not imported for plain weights)."""
    name = type(weight).__name__
    if name == "Params4bit":
        return "4bit"
    if name == "Int8Params":
        return "8bit"
    return None


def four_bit_sources(param: torch.Tensor) -> tuple:
    """What a bitsandbytes 4-bit weight's rows dequantize from: the packed parameter and its scales, and under double
    quantization the scales' own scales and code."""
    state = param.quant_state
    sources = (param, state.absmax)
    if state.nested:
        sources += (state.state2.absmax, state.state2.code)
    return sources


class QuantizedWeight:
    """A bitsandbytes base layer's weight as the DoRA norm reads it: ``[d_out, d_in]`` of ``dtype`` (the dequantized
    dtype: the 4-bit state's, fp32 for LLM.int8 as upstream dequantizes it), never materialised whole.

    ``sources`` are the quantized parameter and its scales; ``keys`` (with ``versions``) the tensors whose identity and
    versions stand for the values: the sources themselves, or under FSDP2 the rank's shard of the packed weight in
    place of the gathered copy (a new object and address in every forward). A norm kept for them is stale once any
    is replaced or written.
    """

    __slots__ = ("param", "kind", "shape", "dtype", "device", "sources", "keys", "versions")

    def __init__(self, layer: nn.Module, param: torch.Tensor, kind: str):
        with torch._C.DisableTorchFunctionSubclass():  # Params4bit's Python __torch_function__: a call per read
            device = param.device
        self.param, self.kind, self.device = param, kind, device
        if kind == "4bit":
            state = param.quant_state
            if state is None:
                raise RuntimeError(
                    "DoRA on a bitsandbytes 4-bit layer: its weight has no quant_state (not quantized yet?); move the "
                    "model to the GPU (or load it with a BitsAndBytesConfig) before the forward"
                )
            self.shape = torch.Size(state.shape)
            # bitsandbytes' CPU inference on AVX512-BF16 repacks the weight in place (``packing_format_for_cpu``);
            # its dtype then says bf16, the dtype it had before is the one the rows dequantize into
            self.dtype = state.original_dtype if _cpu_packed(state) else state.dtype
            self.sources = four_bit_sources(param)
        else:
            scb = _int8_scales(layer, param)
            self.shape, self.dtype = param.shape, torch.float32
            self.sources = (param, scb)
        if len(self.shape) != 2:
            raise ValueError(f"DoRA on a quantized layer: expected a 2-D weight, got shape {tuple(self.shape)}")
        self.keys, self.versions = self.sources, ()
        shard = dora_dist.module_shard(layer, "weight")
        if shard is not None:
            self.keys = (shard[0], *self.sources[1:])
            self.versions = dora_dist.shard_versions(shard[1], param)

    def row_step(self) -> int:
        """Rows per chunk must be a multiple of this: 4-bit chunks start on a quantization block."""
        if self.kind != "4bit":
            return 1
        block = self.param.quant_state.blocksize
        return block // math.gcd(self.shape[1], block)

    def chunk_rows(self, budget: Optional[int] = None) -> int:
        """Rows per chunk: at most ``min(CHUNK_BYTES, budget)`` bytes of dequantized rows, a multiple of
        :meth:`row_step`."""
        budget = min(CHUNK_BYTES, get_dora_norm_threshold_bytes() if budget is None else budget)
        row_bytes = max(1, self.shape[1]) * 2  # the GEMM reads half-precision rows (see `rows`)
        step = self.row_step()
        rows = max(step, (budget // row_bytes) // step * step)
        return min(rows, self.shape[0]) if self.shape[0] else 1

    def rows(self, start: int, stop: int, storage: Optional[tuple] = None) -> tuple:
        """``(values, scale)`` of rows ``start:stop``: ``W[start:stop] = values · scale[:, None]`` (``scale`` None:
        ``values`` are the rows). 4-bit: the rows dequantized into :attr:`dtype` (``storage``: :meth:`storage`, taken
        once per pass over the rows); 8-bit: the int8 values as bf16 (exact: |v| ≤ 127) or fp32 off CUDA, and their
        fp32 row scales SCB / 127."""
        if self.kind == "4bit":
            block, quant_type = self.param.quant_state.blocksize, self.param.quant_state.quant_type
            d_in = self.shape[1]
            e0, e1 = start * d_in, stop * d_in
            packed, absmax = self.storage() if storage is None else storage
            values = torch.ops.bitsandbytes.dequantize_4bit.default(
                packed[e0 // 2 : (e1 + 1) // 2], absmax[e0 // block : -(-e1 // block)], block, quant_type,
                [stop - start, d_in], self.dtype,
            )  # fmt: skip
            return values, None
        values = self.param.data[start:stop]
        half = torch.bfloat16 if values.is_cuda else torch.float32
        return values.to(half), self.sources[1][start:stop].float() * _INT8_SCALE

    def storage(self) -> Optional[tuple]:
        """4-bit: ``(packed, scales)``, the packed codes as flat bytes in bitsandbytes' standard order and the blocks'
        fp32 scales, nested ones dequantized; None for 8-bit. Computed afresh in every call, never kept on this object:
        a norm CUDA graph (``dora_graph``) runs its computation once before capturing it and must capture every step
        from the layer's own tensors, or its replays read a buffer freed with the ``QuantizedWeight`` of the forward
        that captured it."""
        if self.kind != "4bit":
            return None
        state = self.param.quant_state
        if _cpu_packed(state):
            return _standard_storage(self.param, state)
        absmax = state.absmax
        if state.nested:
            import bitsandbytes as bnb

            absmax = bnb.functional.dequantize_blockwise(state.absmax, state.state2) + state.offset
        return self.param.data.reshape(-1).view(torch.uint8), absmax.float()  # FSDP's quant_storage: another dtype

    def dequantize(self) -> torch.Tensor:
        """The whole dequantized weight, as upstream's ``dequantize_bnb_weight`` computes it (a transient of the
        dropout path's base GEMM, see :func:`base_output`; never kept, never taken by the norm)."""
        if self.kind == "4bit":
            if _cpu_packed(self.param.quant_state):
                return self.rows(0, self.shape[0])[0]
            import bitsandbytes as bnb

            return bnb.functional.dequantize_4bit(self.param.data, self.param.quant_state)
        return self.param.data.float() * self.sources[1].view(-1, 1).float() * _INT8_SCALE


def _cpu_packed(state) -> bool:
    """Whether bitsandbytes repacked this 4-bit weight for its AVX512-BF16 CPU kernel (done in place by
    ``Linear4bit.forward`` in inference on such a CPU): other byte order, bf16 scales laid out ``[blocks, d_out]``."""
    return bool(getattr(state, "packing_format_for_cpu", False))


def _standard_storage(param: torch.Tensor, state) -> tuple:
    """``(packed, scales)`` of a CPU-repacked 4-bit weight in the standard order, from bitsandbytes' own inverse of
    the repacking applied to a copy of the state (the layer's weight and state stay as they are). The scales are the
    bf16 ones its kernel computes with, not requantized."""
    import copy

    try:
        from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse as inverse
    except ImportError as err:  # the pinned bitsandbytes has it
        raise RuntimeError(
            "DoRA on a bitsandbytes 4-bit layer repacked for CPU inference (packing_format_for_cpu): this "
            f"bitsandbytes has no inverse of that packing to read the weight with ({err}); use the pinned "
            "bitsandbytes or run the model on a GPU"
        ) from err
    view = copy.copy(state)
    view.original_nested = False  # keep the bf16 scales as they are (the inverse would quantize them again)
    codes, _ = inverse(param.data, view)
    return codes.reshape(-1).view(torch.uint8), state.absmax.T.reshape(-1).float()


def int8_scales(layer: nn.Module, param: torch.Tensor) -> Optional[torch.Tensor]:
    """LLM.int8's per-row scales: on the parameter until the first forward, on the layer's state after; None before
    the weight is quantized."""
    scb = getattr(param, "SCB", None)
    if scb is None:
        scb = getattr(getattr(layer, "state", None), "SCB", None)
    return scb


def _int8_scales(layer: nn.Module, param: torch.Tensor) -> torch.Tensor:
    """:func:`int8_scales`, which the norm cannot do without."""
    scb = int8_scales(layer, param)
    if scb is None:
        raise RuntimeError(
            "DoRA on a bitsandbytes 8-bit layer: no SCB row scales on the weight or the layer's state (weights not "
            "quantized yet?); move the model to the GPU (or load it with a BitsAndBytesConfig) before the forward"
        )
    return scb


def quantized_weight(layer: nn.Module) -> Optional[QuantizedWeight]:
    """The :class:`QuantizedWeight` of a bitsandbytes base layer, else None."""
    weight = getattr(layer, "weight", None)
    kind = quantized_kind(weight)
    return None if kind is None else QuantizedWeight(layer, weight, kind)


@torch.no_grad()
def row_sq_norm(weight: QuantizedWeight) -> torch.Tensor:
    """``‖W‖²`` per row in fp32, one chunk of dequantized rows at a time."""
    d_out = weight.shape[0]
    out = torch.empty(d_out, dtype=torch.float32, device=weight.device)
    step, storage = weight.chunk_rows(), weight.storage()
    for start in range(0, d_out, step):
        stop = min(d_out, start + step)
        values, scale = weight.rows(start, stop, storage)
        sq = torch.linalg.vector_norm(values, dim=1, dtype=torch.float32).square()
        out[start:stop] = sq if scale is None else sq * scale.square()
    return out


@torch.no_grad()
def row_norm(
    weight: QuantizedWeight, lora_A: torch.Tensor, lora_B: torch.Tensor, scale: float, w_sq=None
) -> torch.Tensor:
    """``‖W + s·B·A‖`` per row in fp32, detached: the factored norm with ``U = W·Aᵀ`` taken chunk by chunk of
    dequantized rows (the chunk's GEMM on the tensor cores with A split into bf16 hi and lo parts on CUDA, as for
    unquantized half weights). ``w_sq``: ``‖W‖²_row`` if known."""
    d_out, d_in, r = chain_shapes(weight.shape, lora_A, lora_B)
    scale = float(scale)
    acc = torch.promote_types(lora_A.dtype, torch.float32)
    with torch.autocast(device_type=weight.device.type, enabled=False):
        if w_sq is None:
            w_sq = row_sq_norm(weight)
        if scale == 0.0 or d_out == 0:
            return w_sq.sqrt()
        a_t = lora_A.to(weight.device, acc).T
        u = torch.empty(d_out, r, dtype=acc, device=weight.device)
        step, operand, storage = weight.chunk_rows(), None, weight.storage()
        for start in range(0, d_out, step):
            stop = min(d_out, start + step)
            values, row_scale = weight.rows(start, stop, storage)
            if operand is None:  # Aᵀ as every chunk's GEMM takes it, made once; split as in dora_norm's factored norm
                split = torch.finfo(lora_A.dtype).bits > torch.finfo(values.dtype).bits
                operand = acc_operand(values, a_t, acc, split)
            part = matmul_operand(values, operand, r, acc, out=u[start:stop])
            if row_scale is not None:
                part.mul_(row_scale[:, None])
        return combine_row_norm(w_sq.to(acc), u, a_t.T @ a_t, lora_B.to(weight.device, acc), scale)


def base_output(weight: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
    """``x·Wᵀ`` (no bias) as upstream's dropout path computes it, ``F.linear(x, W.to(x.dtype))`` with the dequantized
    ``W``, but without keeping ``W``: it is dequantized again in the backward (as bitsandbytes' own matmul does) instead
    of being saved from the forward to the backward."""
    return _DequantizedLinear.apply(x, weight)


class _DequantizedLinear(torch.autograd.Function):
    """``F.linear(x, W.to(x.dtype))`` for a frozen quantized ``W``, which it dequantizes in the forward and again in the
    backward (for ``d_x = d_y·W``); nothing is saved. Under autocast the matmuls run in autocast's dtype, as
    ``F.linear`` would."""

    @staticmethod
    def forward(ctx, x, weight: QuantizedWeight):
        ctx.weight, ctx.x_dtype = weight, x.dtype
        autocast = torch.is_autocast_enabled(x.device.type)
        ctx.dtype = torch.get_autocast_dtype(x.device.type) if autocast else x.dtype
        return torch.nn.functional.linear(x, weight.dequantize().to(x.dtype))

    @staticmethod
    def backward(ctx, d_y):
        if not ctx.needs_input_grad[0]:
            return None, None
        dtype = ctx.dtype
        d_x = torch.matmul(d_y.to(dtype), ctx.weight.dequantize().to(dtype))
        return d_x.to(ctx.x_dtype), None
