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
"""Which tier composes a DoRA output: the gates (settings, device, autograd, the layouts the kernels take), the
decision for a Linear's adapted output (:class:`LinearGates`) and for a bare composition (:func:`compose_tier`), and
the counters that make the choice observable (``tier_counts``, a layer's ``last_tier``).

The tiers, in the order a Linear's forward tries them (``DoraLinearLayer.adapted_output``):

==================  ===========================================================================================
``decode``          no autograd, at most ``DECODE_MAX_ROWS`` rows, factors reused: two Triton launches
``small_forward``   no autograd, at most ``SMALL_FORWARD_NUMEL`` outputs, factors reused: three PyTorch ops
``fused_backward``  autograd records: ``lora_B`` and the output in one node (one-node branch), else the one-pass
                    output node, else the composition's node (above the crossover); Triton forward and backward
``fused_forward``   no autograd: the one-pass output kernel, else the composition kernel
``eager``           the PyTorch composition: CPU, no Triton, switched off, torch.compile, layouts the kernels leave
==================  ===========================================================================================
"""

from __future__ import annotations

import collections
from typing import Optional

import torch
from torch import nn

from .dora_launch import HAS_TRITON, INTERPRET
from .dora_settings import current as settings


TIER_DECODE = "decode"
TIER_SMALL_FORWARD = "small_forward"
TIER_FUSED_BACKWARD = "fused_backward"
TIER_FUSED_FORWARD = "fused_forward"
TIER_EAGER = "eager"

TIER_MEANINGS = {
    TIER_FUSED_BACKWARD: "training: Triton kernels forward and backward",
    TIER_FUSED_FORWARD: "inference: one Triton kernel",
    TIER_DECODE: "decode step (1-8 rows): two Triton launches with the reused scale",
    TIER_SMALL_FORWARD: "small outputs without autograd: the LoRA matmuls with s·g folded into B, and one PyTorch op",
    TIER_EAGER: "PyTorch composition (CPU, no Triton, switched off, or a layout the kernels leave alone)",
}

tier_counts: collections.Counter = collections.Counter()
"""How often each tier composed a DoRA output since import (or since ``tier_counts.clear()``)."""

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HALF_DTYPES = (torch.bfloat16, torch.float16)


def wider_result(result_dtype: torch.dtype, lora_dtype: torch.dtype) -> bool:
    """An fp32 ``result`` beside a half-precision LoRA output: a base layer that returns its input's dtype (bitsandbytes
    casts back to the fp32 hidden states of ``prepare_model_for_kbit_training``) under autocast. The output kernels
    read both and write ``result``'s dtype, as PyTorch's promotion would."""
    return result_dtype == torch.float32 and lora_dtype in HALF_DTYPES


def wider_branch(result_dtype: torch.dtype, lora_dtype: torch.dtype) -> bool:
    """A half-precision ``result`` beside an fp32 LoRA output: PEFT's default fp32 adapters beside a bf16 (fp16) base,
    trained or run without autocast (a training loop of its own on a half-precision model). The output kernels read
    both and write the LoRA output's dtype, fp32, as PyTorch's promotion would (the LoRA layer then casts it back to
    the base's dtype, as it does LoRA's own ``result + lora``)."""
    return lora_dtype == torch.float32 and result_dtype in HALF_DTYPES


def mixed_output(result_dtype: torch.dtype, lora_dtype: torch.dtype) -> bool:
    """``result`` and the LoRA output in two dtypes the output kernels take, the output in the wider:
    :func:`wider_result` or :func:`wider_branch`."""
    return wider_result(result_dtype, lora_dtype) or wider_branch(result_dtype, lora_dtype)


DECODE_MAX_ROWS = 8  # rows per decode launch (dora_decode); more rows take the matmul path

# Up to this many output elements without autograd, the small tier (three PyTorch ops with s·g folded into B's
# matmul) instead of B's matmul and the one-pass Triton kernel. One adapted bf16 Linear, rank 16, eval, H100
# (``benchmarks/probe_infer_host.py --layers-only``, µs per forward, LoRA / one-pass kernel / small tier): where the
# host bounds it, 110 / 147 / 123 (512 x 2048 outputs) and 96 / 138 / 122 (4096 x 2048): the kernel's launch costs
# more host time than the small tier's ops. Where the GPU bounds it the kernel's single pass wins: 337 / 290 / 434
# (4096 x 8192) and 1781 / 1708 / 2108 (8192 x 14336), the small tier's ``g·result`` being PyTorch's per-element-cast
# kernel (an fp32 g on half-precision tensors; a half g ran at the kernel's speed, 348 and 1836, but erred in
# proportion to ``result`` where it and the LoRA term cancel: a GPU test against upstream failed).
SMALL_FORWARD_NUMEL = 1 << 23

# An fp32 result beside a half-precision LoRA branch (bitsandbytes under autocast) takes the small tier's former
# composition, ``(result + s·lora)·g (+ (1 − g)·bias)`` in fp32 on the LoRA output, up to this many elements, and the
# one-pass kernel above (where that composition's mixed-dtype add would be the slower op).
SMALL_FORWARD_WIDE_NUMEL = 1 << 20

# The small tier keeps ``s·g·B`` (a copy of B in the branch's dtype) for a B of at most this many elements (rank 64
# beside a 16384-wide output); a larger B is scaled in each forward (its record too), two more small ops (the fp32
# product, the rounding), rather than kept twice.
SCALED_B_KEPT_NUMEL = 1 << 20

# Below this many activation elements the composition's fused autograd node (forward + backward) does not reliably
# beat eager PyTorch on the H200: both are host-bound there, and the Triton launches cost more host time than
# PyTorch's. bf16, median ms per step, fused vs eager (benchmarks/results/bench_kernels.json, "crossover"): wins and
# losses alternate up to 2^24 elements (1024 x 4096: 0.51 vs 0.46; 4096 x 4096: 0.48 vs 0.49); from 2^25 fused wins
# every time (8192 x 4096: 0.42 vs 0.74; 32768 x 4096: 0.96 vs 2.67). The one-pass output has no crossover: it
# replaces about ten eager launches (g, the composition, the residual add) with one, at every size.
BACKWARD_CROSSOVER_NUMEL = 1 << 25


def record(layer: nn.Module, tier: str) -> None:
    """Count ``tier`` in ``tier_counts`` and keep it as ``layer.last_tier`` (a plain attribute: set without
    ``nn.Module.__setattr__``'s parameter/buffer/module bookkeeping, which costs microseconds per decode step).

    Not while torch.compile traces: Dynamo guards on the values a traced function reads, so a counter incremented in
    compiled code invalidates the graph on every call (a recompile per call, then the recompile limit)."""
    if torch.compiler.is_compiling():
        return
    tier_counts[tier] += 1
    object.__setattr__(layer, "last_tier", tier)


# ---------------------------------------------------------------------------------------------------------------
# Gates: settings, device and autograd.
# ---------------------------------------------------------------------------------------------------------------


def records_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd records an op on these tensors: grad mode on and one of them requires grad."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def kernels_available(t: torch.Tensor) -> bool:
    """True when the Triton kernels can run on ``t``'s device: CUDA with Triton, or any device under the interpreter."""
    return HAS_TRITON and (t.is_cuda or INTERPRET)


def kernels_allowed(t: torch.Tensor) -> bool:
    """Whether the fused tiers may run for ``t``: PEFT_DORA_FUSED not 0, Triton and CUDA (or the interpreter).
    Forcing the kernels on where they cannot run is an error, not a silent fallback."""
    fused = settings().fused
    if fused is False:
        return False
    if not kernels_available(t):
        if fused is True:
            raise RuntimeError(
                "PEFT_DORA_FUSED=1 forces the fused DoRA kernels, but they cannot run here: they need Triton and "
                f"CUDA tensors (got {t.device} tensors; Triton importable: {HAS_TRITON}). "
                "Unset PEFT_DORA_FUSED for automatic selection or set it to 0 for the eager path."
            )
        return False
    return True


def fused_backward_allowed(t: torch.Tensor) -> bool:
    """PEFT_DORA_FUSED_BACKWARD: unset = the composition's node above the crossover (the output nodes always)."""
    fused_backward = settings().fused_backward
    return fused_backward is True or (fused_backward is None and t.numel() >= BACKWARD_CROSSOVER_NUMEL)


# ---------------------------------------------------------------------------------------------------------------
# Gates: the layouts the kernels take.
# ---------------------------------------------------------------------------------------------------------------


def row_stride(t: torch.Tensor) -> int | None:
    """Stride between rows when ``t`` reads as non-overlapping [rows, d_out] rows with unit column stride."""
    if t.is_contiguous():  # the common case, without the walk over the strides below
        return t.shape[-1] if t.dim() else None
    if t.dim() <= 1:
        return t.shape[0] if t.dim() == 1 else None
    size, stride = t.shape, t.stride()
    if size[-1] > 1 and stride[-1] != 1:
        return None
    row_stride_ = stride[-2] if size[-2] > 1 else size[-1]
    expected = row_stride_
    for i in range(t.dim() - 2, -1, -1):
        if size[i] > 1 and stride[i] != expected:
            return None
        expected *= size[i]
    return row_stride_ if row_stride_ >= size[-1] else None


def compose_layout(
    lora: torch.Tensor, base: torch.Tensor, g: torch.Tensor, wider_base: bool = False
) -> tuple[int, int] | None:
    """(row stride of lora, row stride of base) when the composition kernels take these tensors, else None.

    ``lora`` and ``base`` must agree in shape, dtype (or, with ``wider_base``, see :func:`mixed_output`) and device
    and read as rows (unit column stride); ``g`` must be a contiguous [d_out] or [1, d_out] vector, i.e. broadcast
    along the last dimension only (a Conv-style [1, C, 1, 1] scales a middle dimension and is left to PyTorch)."""
    if lora.shape != base.shape or lora.dtype not in KERNEL_DTYPES:
        return None
    if lora.dtype != base.dtype and not (wider_base and mixed_output(base.dtype, lora.dtype)):
        return None
    if g.dtype not in KERNEL_DTYPES or lora.device != base.device or g.device != lora.device or lora.dim() == 0:
        return None
    d_out = lora.shape[-1]
    if g.numel() != d_out or g.shape[-1] != d_out or g.dim() > min(2, lora.dim()) or (d_out > 1 and g.stride(-1) != 1):
        return None
    stride_lora, stride_base = row_stride(lora), row_stride(base)
    if stride_lora is None or stride_base is None:
        return None
    return stride_lora, stride_base


def kernels_support(lora: torch.Tensor, base: torch.Tensor, g: torch.Tensor) -> bool:
    """True when the composition kernels take these tensors (:func:`compose_layout`)."""
    return compose_layout(lora, base, g) is not None


def output_layout(result, lora, bias, magnitude, weight_norm) -> tuple[int, int] | None:
    """(row stride of result, row stride of lora) when the one-pass output kernel takes these tensors, else None.

    ``lora`` is written in place, so it must own its storage (a fresh matmul output, not a view), unless ``result`` is
    wider (:func:`wider_result`: the output is a new buffer of ``result``'s dtype; where the branch is the wider,
    :func:`wider_branch`, the output is written into ``lora``'s fp32 buffer); ``magnitude`` is a contiguous
    [d_out] vector, ``weight_norm`` fp32 of the same shape, ``bias`` absent or a frozen [d_out] vector.
    """
    layout = compose_layout(lora, result, magnitude, wider_base=True)
    if layout is None or lora._base is not None or magnitude.dim() != 1 or not norm_operand(weight_norm, magnitude):
        return None
    if bias is not None and not bias_operand(bias, magnitude, result.device):
        return None
    return layout[1], layout[0]


def bias_operand(bias: torch.Tensor, magnitude: torch.Tensor, device: torch.device) -> bool:
    """Whether the one-pass kernels read ``bias`` (subtracted from ``result`` as a constant): a frozen contiguous
    vector shaped like ``magnitude``, in a kernel dtype, on ``device``."""
    return (
        bias.shape == magnitude.shape and bias.dtype in KERNEL_DTYPES and bias.is_contiguous()
        and bias.device == device and not bias.requires_grad
    )  # fmt: skip


def norm_operand(weight_norm: torch.Tensor, magnitude: torch.Tensor) -> bool:
    """Whether the one-pass kernels read ``weight_norm`` beside ``magnitude``: fp32, contiguous, same shape and
    device."""
    return (
        weight_norm.dtype == torch.float32 and weight_norm.shape == magnitude.shape and weight_norm.is_contiguous()
        and weight_norm.device == magnitude.device
    )  # fmt: skip


def branch_node_stride(a, result, weight_b, magnitude, bias) -> int | None:
    """``result``'s row stride where the one-node branch (``dora_fused.FusedDoRALinearFunction``) takes these
    tensors, else None.

    The node computes ``F.linear(a, B)`` as F.linear would: in ``a``'s dtype (autocast's, or B's own without
    autocast), which ``result`` shares, widens or is widened by (:func:`mixed_output`), with shapes that fit
    (F.linear's own errors come from the separate call otherwise); its output is a fresh ``result``-shaped buffer,
    so ``result`` stands in for it in the output's layout rules. One function on the per-forward path: separate
    checks re-read the same attributes (a fifth of DoRA's host time over LoRA's per training forward, CPU
    stand-in). The norm is checked separately (:func:`norm_operand`), once it exists."""
    dtype = a.dtype
    if dtype not in KERNEL_DTYPES or weight_b.dim() != 2 or a.dim() == 0:
        return None
    if result.dtype != dtype and not mixed_output(result.dtype, dtype):
        return None
    if weight_b.dtype != dtype and (
        weight_b.dtype not in KERNEL_DTYPES or not torch.is_autocast_enabled(a.device.type)
    ):
        return None
    d_out, rank = weight_b.shape
    shape = result.shape
    if a.shape[-1] != rank or shape[-1] != d_out or a.shape[:-1] != shape[:-1]:
        return None
    if magnitude.shape != (d_out,) or magnitude.dtype not in KERNEL_DTYPES or (d_out > 1 and magnitude.stride(0) != 1):
        return None
    device = result.device
    if magnitude.device != device or a.device != device:
        return None
    if bias is not None and not bias_operand(bias, magnitude, device):
        return None
    return row_stride(result)


# ---------------------------------------------------------------------------------------------------------------
# Decisions.
# ---------------------------------------------------------------------------------------------------------------


def compose_tier(lora: torch.Tensor, base: torch.Tensor, g: torch.Tensor, gates: Optional["LinearGates"] = None) -> str:
    """The tier of the bare composition ``(g - 1)·base + g·(s·lora)`` (Embedding, Conv, LoRA dropout, and a Linear
    output the one-pass kernel leaves alone); ``gates`` are the forward's own, where it has them."""
    fused = gates.fused if gates is not None else (kernels_allowed(lora) and not torch.compiler.is_compiling())
    # Under torch.compile Inductor fuses the PyTorch composition with the residual add and its backward; the opaque
    # compose op cannot be fused (H200, compiled 4-layer Llama, autocast, r = 16: train step 1.10x LoRA's vs 1.13x).
    if not fused or not kernels_support(lora, base, g):
        return TIER_EAGER
    if gates.grad if gates is not None else records_grad(lora, base, g):
        return TIER_FUSED_BACKWARD if fused_backward_allowed(lora) else TIER_EAGER
    return TIER_FUSED_FORWARD


class LinearGates:
    """The gates of one Linear forward's adapted output, each checked once, before any of its work.

    ``grad``: autograd records the output (grad mode on and the input, result, A, B or m requires grad).
    ``fused``: the Triton tiers may run (settings, Triton and device; raises where PEFT_DORA_FUSED=1 cannot be met;
    off under torch.compile, which traces PyTorch). ``reuses_factors``: no autograd, the scale ``g`` (and the bias
    term) may be kept across forwards (eval mode, or PEFT_DORA_NORM_CACHE=1) and the output is small enough for the
    ``decode`` or ``small_forward`` tier. ``decode``: those factors, the plain LoRA branch, few rows, the decode
    kernels on.
    ``one_node``: a training forward whose plain LoRA branch may go into the output's node.
    """

    __slots__ = ("grad", "fused", "reuses_factors", "decode", "one_node")

    def __init__(self, result, magnitude, inputs: tuple, plain: bool, training: bool):
        env = settings()
        grad_mode = torch.is_grad_enabled()
        self.grad = grad = grad_mode and (
            result.requires_grad or magnitude.requires_grad or any(t.requires_grad for t in inputs)
        )
        self.fused = fused = kernels_allowed(result) and not torch.compiler.is_compiling()
        norm_cache = env.norm_cache
        reuse = (
            fused and not grad and magnitude.dim() == 1
            and norm_cache is not False and (norm_cache is True or not training)
        )  # fmt: skip
        numel = result.numel()
        self.decode = decode = (
            reuse and plain and env.decode_kernels and numel <= DECODE_MAX_ROWS * result.shape[-1]
        )  # fmt: skip
        # larger outputs never read them (the one-pass kernel)
        self.reuses_factors = decode or (reuse and plain and numel <= SMALL_FORWARD_NUMEL)
        self.one_node = grad and fused and plain and env.one_node_branch and env.fused_backward is not False

    def output_tier(self, result, lora, bias, magnitude, weight_norm) -> Optional[tuple[str, tuple[int, int]]]:
        """(tier, strides) of the one-pass output kernel (``dora_fused.fused_dora_output``'s node or bare kernel),
        or None where it does not apply."""
        if not self.fused or (self.grad and settings().fused_backward is False):
            return None
        strides = output_layout(result, lora, bias, magnitude, weight_norm)
        if strides is None:
            return None
        return (TIER_FUSED_BACKWARD if self.grad else TIER_FUSED_FORWARD), strides
