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
"""Element-wise DoRA math: the composition, its backward and the norm assembly.

With ``g = m / max(w_norm, eps)`` (the per-row scale), ``s`` the LoRA scaling, ``base = W·x`` and ``lora = B·A·x``:

    out   = (g - 1) * base + g * (s * lora)       stable form: (g - 1) stays explicit, s * lora is rounded first
    inner = s * lora + base                       saved for d_g, because out = g * inner - base
    d_lora = g * s * d_out,  d_base = (g - 1) * d_out,  d_g = sum over rows of inner * d_out
    w_norm = sqrt(max(w_sq + 2s * cross + s^2 * ba_sq, 0))     fp32, NaN-preserving clamp

Every function here has a PyTorch twin (``_*_torch``) that is the CPU path, the fallback and the test oracle.
``g`` may be fp32 while activations are bf16/fp16: ``g - 1`` is formed in ``g``'s precision before it is cast to
the activation dtype, otherwise values such as 1.0015 collapse to exactly 0 in bf16.
"""

from __future__ import annotations

import functools
import importlib.util

import torch


__all__ = [
    "FusedDoRAComposeFunction",
    "fused_dora_compose",
    "fused_dora_compose_autograd",
    "fused_dora_forward_and_inner",
    "fused_norm_assembly",
    "is_triton_available",
]


@functools.lru_cache(maxsize=None)
def is_triton_available() -> bool:
    """True if Triton can be imported (the kernels also need a CUDA tensor to run)."""
    return importlib.util.find_spec("triton") is not None


def kernels_available(t: torch.Tensor) -> bool:
    """True when the Triton kernels can run on ``t``'s device. This build has no Triton kernels yet."""
    return False


def kernels_support(lora: torch.Tensor, base: torch.Tensor, g: torch.Tensor) -> bool:
    """True when the kernels handle this layout; the rest goes to the eager path."""
    return False


def above_backward_crossover(lora: torch.Tensor) -> bool:
    """True when the fused backward beats eager for an activation of this shape."""
    return False


# ---------------------------------------------------------------------------------------------------------------
# PyTorch twins: one definition of each piece of math, shared by every eager path.
# ---------------------------------------------------------------------------------------------------------------


def _scale_factors(g: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, g - 1) in the activation dtype, with g - 1 taken in g's own (usually fp32) precision."""
    return g.to(dtype), (g - 1).to(dtype)


def _compose_torch(
    lora: torch.Tensor, base: torch.Tensor, g: torch.Tensor, scale: float, inplace: bool = False
) -> torch.Tensor:
    """(g - 1) * base + g * (s * lora), in the promoted dtype of lora and base; in place into lora if asked."""
    dtype = torch.promote_types(lora.dtype, base.dtype)
    g_c, gm1 = _scale_factors(g, dtype)
    if inplace and lora.dtype == dtype and lora.shape == torch.broadcast_shapes(lora.shape, base.shape, g.shape):
        # t2 + t1 == t1 + t2 bitwise, so this equals the out-of-place form below.
        return lora.mul_(scale).mul_(g_c).add_(gm1 * base)
    return gm1 * base + g_c * (scale * lora)


def _forward_and_inner_torch(
    lora: torch.Tensor, base: torch.Tensor, g: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = torch.promote_types(lora.dtype, base.dtype)
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
    d_lora = g_c * (scale * d_out) if needs_lora_grad else None
    d_base = gm1 * d_out if needs_base_grad else None
    d_mag = None
    if needs_mag_grad:
        # fp32 accumulation over all broadcast dimensions, whatever the activation dtype.
        prod = inner.float() * d_out.float()
        d_mag = prod.sum_to_size(g.shape).to(g.dtype)
    return d_lora, d_base, d_mag


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
        d_lora, d_base, d_mag = _fused_backward(
            d_out.contiguous(), inner, g, ctx.scale, *ctx.needs_input_grad[:3]
        )
        return d_lora, d_base, d_mag, None


def _fused_backward(d_out, inner, g, scale, needs_lora_grad, needs_base_grad, needs_mag_grad):
    return _backward_torch(d_out, inner, g, scale, needs_lora_grad, needs_base_grad, needs_mag_grad)


# ---------------------------------------------------------------------------------------------------------------
# Public functions (names and signatures as in the reference fork's API).
# ---------------------------------------------------------------------------------------------------------------


def fused_dora_compose(
    lora: torch.Tensor, base: torch.Tensor, mag_norm_scale: torch.Tensor, scale: float, inplace: bool = True
) -> torch.Tensor:
    """DoRA composition ``(mag_norm_scale - 1) * base + mag_norm_scale * (scale * lora)``.

    ``mag_norm_scale`` broadcasts against ``lora`` ([out_features], [1, out_features] or a Conv-style shape). With
    ``inplace=True`` the result is written into ``lora`` when its dtype and shape allow it; no autograd graph is
    recorded for in-place writes, so use :func:`fused_dora_compose_autograd` for training.
    """
    return _compose_torch(lora, base, mag_norm_scale, scale, inplace=inplace)


def fused_dora_forward_and_inner(
    lora: torch.Tensor, base: torch.Tensor, mag_norm_scale: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(out, inner)`` with ``out`` as in :func:`fused_dora_compose` and ``inner = scale * lora + base``."""
    return _forward_and_inner_torch(lora, base, mag_norm_scale, scale)


def fused_norm_assembly(
    w_norm_sq: torch.Tensor, cross_term: torch.Tensor, ba_norm_sq: torch.Tensor, scale: float
) -> tuple[torch.Tensor]:
    """``(sqrt(max(w_norm_sq + 2 * scale * cross_term + scale**2 * ba_norm_sq, 0)),)``, computed in fp32.

    The magnitude division stays with the caller, in PyTorch, so every norm path shares its precision.
    """
    return (_norm_assembly_torch(w_norm_sq, cross_term, ba_norm_sq, scale),)


def fused_dora_compose_autograd(
    lora: torch.Tensor, base: torch.Tensor, mag_norm_scale: torch.Tensor, scale: float
) -> torch.Tensor:
    """Training-time composition through :class:`FusedDoRAComposeFunction` (fused backward)."""
    return FusedDoRAComposeFunction.apply(lora, base, mag_norm_scale, float(scale))
