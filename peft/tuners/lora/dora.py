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
"""DoRA for PEFT: the PEFT-facing layers and variants, and the dispatch of the composition to its tiers.

The weight norm lives in ``dora_norm`` (factored, never a dense ``B·A``), the ``PEFT_DORA_*`` switches in
``dora_settings``, the kernels and the composition's contract in ``dora_fused``; the names documented as public
(``factored_row_norm``, ``set_dora_norm_threshold_mb``, ``norm_counts``, ...) are importable from here.
"""

from __future__ import annotations

import collections
from copy import deepcopy
from functools import wraps
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _nn_module

from peft.utils.integrations import dequantize_module_weight, gather_params_ctx
from peft.utils.other import transpose

from . import dora_decode, dora_fused
from .dora_cache import Memo, capturing, memoised, reused, source, watch_merges
from .dora_cache import invalidate_norm_caches as invalidate_norm_caches  # public here, as documented
from .dora_cache import norm_counts as norm_counts  # public here, as documented
from .dora_graph import NormGraph
from .dora_graph import graph_counts as graph_counts  # public here, as documented
from .dora_launch import device_switch
from .dora_norm import (
    _eps_for,
    _magnitude_scale,
    _norm_graph_applies,
    _reuse_mode,
    compiled_weight_norm,
    factored_conv_norm,
    row_sq_norm,
    w_sq_reusable,
)
from .dora_norm import _norm_kernel_applies as _norm_kernel_applies  # tests reach it here
from .dora_norm import _split_norm_applies as _split_norm_applies  # tests and callers reach it here
from .dora_norm import factored_row_norm as factored_row_norm  # public here, as documented
from .dora_settings import _MB, _env
from .dora_settings import _invalidate_fused_cache as _invalidate_fused_cache  # the documented reset
from .dora_settings import get_dora_norm_threshold_bytes as get_dora_norm_threshold_bytes  # public, as documented
from .dora_settings import get_dora_norm_threshold_mb as get_dora_norm_threshold_mb  # public, as documented
from .dora_settings import set_dora_norm_threshold_mb as set_dora_norm_threshold_mb  # public, as documented
from .layer import LoraVariant


ENABLE_DORA_CACHING = False
"""Cache the weight norm in eval mode (see ``peft.helpers.DoraCaching``); no dense ``B·A`` is ever cached."""


def is_triton_available() -> bool:
    """True if Triton is importable."""
    return dora_fused.is_triton_available()


# ---------------------------------------------------------------------------------------------------------------
# Composition dispatch.
# ---------------------------------------------------------------------------------------------------------------

TIER_FUSED_BACKWARD = "fused_backward"
TIER_FUSED_FORWARD = "fused_forward"
TIER_EAGER = "eager"
TIER_SMALL_FORWARD = "small_forward"
TIER_DECODE = "decode"

# Up to this many output elements without autograd (decode: a token per sequence), launches cost more than bytes:
# two in-place PyTorch ops with the reused g (~20 µs of host time on the H200's host) beat one Triton launch (~50 µs).
_SMALL_FORWARD_NUMEL = 1 << 20

tier_counts: collections.Counter = collections.Counter()
"""How often each tier composed a DoRA output since import (or since ``tier_counts.clear()``)."""


def _kernels_allowed(lora: torch.Tensor) -> bool:
    """Whether the fused tiers may run for this tensor: PEFT_DORA_FUSED not 0, Triton and CUDA (or the interpreter).
    Forcing the kernels on where they cannot run is an error, not a silent fallback."""
    env = _env()
    if env.fused is False:
        return False
    if not dora_fused.kernels_available(lora):
        if env.fused is True:
            raise RuntimeError(
                "PEFT_DORA_FUSED=1 forces the fused DoRA kernels, but they cannot run here: they need Triton and "
                f"CUDA tensors (got {lora.device} tensors; Triton importable: {is_triton_available()}). "
                "Unset PEFT_DORA_FUSED for automatic selection or set it to 0 for the eager path."
            )
        return False
    return True


def _select_tier(lora: torch.Tensor, base: torch.Tensor, g: torch.Tensor) -> str:
    if not _kernels_allowed(lora) or not dora_fused.kernels_support(lora, base, g):
        return TIER_EAGER
    if torch.compiler.is_compiling():
        # Inductor fuses the PyTorch composition with the residual add and its backward; the opaque compose op
        # cannot be fused (H200, compiled 4-layer Llama, autocast, r = 16: train step 1.10x LoRA's vs 1.13x)
        return TIER_EAGER
    if dora_fused.records_grad(lora, base, g):
        fused_backward = _env().fused_backward
        if fused_backward is False:
            return TIER_EAGER
        if fused_backward is None and not dora_fused.above_backward_crossover(lora):
            return TIER_EAGER
        return TIER_FUSED_BACKWARD
    return TIER_FUSED_FORWARD


TIER_MEANINGS = {
    TIER_FUSED_BACKWARD: "training: Triton kernels forward and backward",
    TIER_FUSED_FORWARD: "inference: one Triton kernel",
    TIER_DECODE: "decode step (1-8 rows): two Triton launches with the reused scale",
    TIER_SMALL_FORWARD: "few rows without autograd: two PyTorch ops with the reused scale",
    TIER_EAGER: "PyTorch composition (CPU, no Triton, switched off, or a layout the kernels leave alone)",
}


def summary(model: Optional[nn.Module] = None) -> str:
    """What DoRA ran since import (or since ``tier_counts.clear()`` / ``norm_counts.clear()``), as a few lines to
    print: compositions per tier and what each tier is, norms computed and reused, for ``model`` its DoRA modules
    by the tier of their latest forward, and why a CUDA run took the eager tier where that is a setting. Forwards
    inside ``torch.compile`` are not counted (their norms are)."""
    lines = ["DoRA compositions by tier:"]
    for tier, count in sorted(tier_counts.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {tier}: {count}  ({TIER_MEANINGS.get(tier, '')})")
    if not tier_counts:
        lines.append("  none counted (no DoRA forward yet, or only compiled ones)")
    computed, reused_ = norm_counts.get("norm_computed", 0), norm_counts.get("norm_reused", 0)
    lines.append(f"weight norms: {computed} computed, {reused_} reused")
    if model is not None:
        latest = collections.Counter(
            m.last_tier for m in model.modules() if isinstance(m, DoraLinearLayer) and m.last_tier is not None
        )
        lines.append("modules by latest tier: " + (", ".join(f"{t}: {n}" for t, n in sorted(latest.items())) or "none"))
    if tier_counts.get(TIER_EAGER) and torch.cuda.is_available():
        if _env().fused is False:
            lines.append("eager because PEFT_DORA_FUSED=0; unset it for the fused tiers")
        elif not is_triton_available():
            lines.append("eager because Triton is not installed: `pip install triton` gives the fused tiers")
    return "\n".join(lines)


def _record_tier(layer: nn.Module, tier: str) -> None:
    """Count ``tier`` in ``tier_counts`` and keep it as ``layer.last_tier`` (a plain attribute: set without
    ``nn.Module.__setattr__``'s parameter/buffer/module bookkeeping, which costs microseconds per decode step).

    Not while torch.compile traces: Dynamo guards on the values a traced function reads, so a counter incremented in
    compiled code invalidates the graph on every call (a recompile per call, then the recompile limit)."""
    if torch.compiler.is_compiling():
        return
    tier_counts[tier] += 1
    object.__setattr__(layer, "last_tier", tier)


def _compose_with_dispatch(
    lora: torch.Tensor, base: torch.Tensor, g: torch.Tensor, scale: float, layer: nn.Module
) -> torch.Tensor:
    """The DoRA delta ``(g - 1)·base + g·(s·lora)`` by the tier that fits; ``lora`` must be a fresh tensor.

    The tier is counted in ``tier_counts`` and kept as ``layer.last_tier``.
    """
    tier = _select_tier(lora, base, g)
    _record_tier(layer, tier)
    if tier == TIER_FUSED_BACKWARD:
        return dora_fused.fused_dora_compose_autograd(lora, base, g, scale)
    if tier == TIER_FUSED_FORWARD:
        return dora_fused.fused_dora_compose(lora, base, g, scale, inplace=True)
    # Eager: in place only when autograd records nothing, so no saved tensor is overwritten.
    inplace = not dora_fused.records_grad(lora, base, g)
    return dora_fused._compose_torch(lora, base, g, scale, inplace=inplace)


def _output_with_dispatch(
    result: torch.Tensor,
    lora: torch.Tensor,
    bias: Optional[torch.Tensor],
    magnitude: torch.Tensor,
    weight_norm: torch.Tensor,
    scale: float,
    weight_dtype: torch.dtype,
    layer: nn.Module,
) -> Optional[torch.Tensor]:
    """The adapted output ``result + ((g - 1)·(result - bias) + g·(s·lora))`` from the one-pass kernel, which also
    forms ``g`` (fused tiers; ``lora`` must be fresh: its buffer receives the output), or None where that kernel does
    not apply (the caller composes eagerly). Unlike the compose-only kernel the one-pass output has no crossover:
    it replaces about ten eager launches (g, the composition, the residual add) with one, at every size."""
    if torch.compiler.is_compiling() or not _kernels_allowed(lora):
        return None
    strides = dora_fused._output_layout(result, lora, bias, magnitude, weight_norm)
    if strides is None:
        return None
    training = dora_fused.records_grad(result, lora, magnitude)
    if training and _env().fused_backward is False:
        return None
    _record_tier(layer, TIER_FUSED_BACKWARD if training else TIER_FUSED_FORWARD)
    return dora_fused._fused_output(result, lora, magnitude, weight_norm, scale, _eps_for(weight_dtype), bias, strides)


# ---------------------------------------------------------------------------------------------------------------
# Layers: hold the magnitude vector of one adapter and compute its DoRA contribution.
# ---------------------------------------------------------------------------------------------------------------


def cache_decorator(cache_key: str):
    """Cache a layer method's result per adapter while ``ENABLE_DORA_CACHING`` is on and the layer is in eval mode."""

    def cache_value(func):
        @wraps(func)
        def wrapper(self, *args, **kwargs):
            adapter_name = kwargs.get("adapter_name")
            if (not ENABLE_DORA_CACHING) or self.training or (adapter_name is None):
                self._cache_clear()
                return func(self, *args, **kwargs)
            key = f"{cache_key}-{adapter_name}"
            output = self._cache_get(key, None)
            if output is None:
                output = func(self, *args, **kwargs)
                self._cache_store(key, output)
            return output

        return wrapper

    return cache_value


def _forward_weight(base_layer: nn.Module) -> torch.Tensor:
    """The base weight for the forward; plain parameters skip upstream's dequantize probe, whose type-name string
    test Dynamo cannot trace (a graph break per DoRA layer under torch.compile)."""
    if type(base_layer) is nn.Linear:
        # straight from the dict (nn.Module.__getattr__ costs time), and no probe for a quantized weight's `W_q`
        weight = base_layer._parameters.get("weight")
    else:
        weight = getattr(base_layer, "weight", None)
        # an attribute probe that fails costs an exception inside nn.Module.__getattr__, hence not for a plain Linear
        if type(weight) is nn.Parameter and hasattr(base_layer, "W_q"):
            weight = None
    if type(weight) is nn.Parameter:
        return weight
    return dequantize_module_weight(base_layer)


def _plain_linear(module: nn.Module) -> bool:
    """Whether ``module(x)`` is exactly ``F.linear(x, module.weight, module.bias)`` with nothing else to see the call:
    an ``nn.Linear`` (not a subclass or parametrized class), no hooks of its own or global ones, its class's forward
    (not one wrapped on the instance, as accelerate's offload hooks do) and not compiled."""
    return (
        type(module) is nn.Linear
        and not (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks)
        and not (module._backward_pre_hooks or "forward" in module.__dict__ or module._compiled_call_impl is not None)
        and not (_nn_module._global_forward_hooks or _nn_module._global_forward_pre_hooks)
        and not (_nn_module._global_backward_hooks or _nn_module._global_backward_pre_hooks)
    )


def _lora_output(lora_A: nn.Module, lora_B: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``lora_B(lora_A(x))``, as two ``F.linear`` calls where both modules are plain Linears: nn.Module's call
    machinery costs about as much host time as the matmul's dispatch, per module and forward."""
    if _plain_linear(lora_A) and _plain_linear(lora_B):
        params_a, params_b = lora_A._parameters, lora_B._parameters
        weight_a, weight_b = params_a.get("weight"), params_b.get("weight")
        if weight_a is not None and weight_b is not None:
            return F.linear(F.linear(x, weight_a, params_a.get("bias")), weight_b, params_b.get("bias"))
    return lora_B(lora_A(x))




def _plain_branch(lora_A: nn.Module, lora_B: nn.Module) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(A, B) where the LoRA branch is exactly ``F.linear(F.linear(x, A), B)`` with nothing else to see the calls:
    two plain Linears without bias (see :func:`_plain_linear`) holding plain parameters; otherwise None."""
    if not (_plain_linear(lora_A) and _plain_linear(lora_B)):
        return None
    params_a, params_b = lora_A._parameters, lora_B._parameters
    weight_a, weight_b = params_a.get("weight"), params_b.get("weight")
    if type(weight_a) is not nn.Parameter or type(weight_b) is not nn.Parameter:
        return None
    if params_a.get("bias") is not None or params_b.get("bias") is not None:
        return None
    return weight_a, weight_b


class DoraLinearLayer(nn.Module):
    """Magnitude vector and DoRA contribution of one adapter on a Linear (or GPT-2 ``Conv1D``) layer."""

    def __init__(self, fan_in_fan_out):
        super().__init__()
        self.fan_in_fan_out = fan_in_fan_out
        self._dora_cache: dict[str, Any] = {}  # not part of the state_dict
        self.last_tier: Optional[str] = None  # the dispatch tier of the latest forward
        self._norm_memo, self._scale_memo, self._small_memo = Memo(), Memo(), Memo()
        self._small_rows: tuple = ()  # (the small forward's factors, their rows as views)
        self._decode = dora_decode.DecodeSlot()  # the launches of the latest decode step (dora_decode.DecodePlan)
        self._w_sq_memo = Memo(frozen=True)  # ||W||² of a frozen base weight outlives optimizer steps
        self._norm_graph = NormGraph()  # the training norm as a CUDA graph (dora_graph)

    def _cache_store(self, key: str, value: Any) -> None:
        self._dora_cache[key] = value

    def _cache_get(self, key: str, default: Optional[Any]) -> Optional[Any]:
        return self._dora_cache.get(key, default)

    def _cache_clear(self) -> None:
        if self._dora_cache:  # clearing an empty dict is still a mutation to Dynamo (a graph break under checkpoint)
            self._dora_cache.clear()

    def train(self, mode: bool = True):
        if mode:
            self._cache_clear()
        if mode != self.training:  # train()/eval() switches forget reused norms, whatever wrote the weights meanwhile
            for memo in (self._norm_memo, self._w_sq_memo, self._scale_memo, self._small_memo):
                memo.clear()
            self._small_rows = ()
            self._decode.plan = None
        if not mode:
            self._norm_graph.clear()  # inference does not replay it: its memory pool serves other graphs or none
        super().train(mode=mode)
        return self

    @cache_decorator("weight-norm")
    def get_weight_norm(
        self, weight, lora_A, lora_B, scaling, adapter_name: Optional[str] = None, w_sq=None
    ) -> torch.Tensor:
        """Detached fp32 norm of ``weight + scaling·lora_B·lora_A`` per output row (weight as stored by the layer)."""
        return factored_row_norm(transpose(weight, self.fan_in_fan_out), lora_A, lora_B, scaling, w_sq=w_sq)

    def _norm_operands(self, weight, lora_A, lora_B) -> Optional[tuple]:
        """(W, A, B) as ``factored_row_norm`` takes them, or None where the norm is not a single factored row norm."""
        return transpose(weight, self.fan_in_fan_out), lora_A, lora_B

    def _forward_norm(self, weight, lora_A, lora_B, scaling, adapter_name) -> torch.Tensor:
        """The norm for this forward, reused while W, A, B and s provably hold (see ``dora_cache.memoised``); under
        torch.compile one opaque op (``compiled_weight_norm``) where ``ENABLE_DORA_CACHING`` is off."""
        if torch.compiler.is_compiling() and not ENABLE_DORA_CACHING:
            operands = self._norm_operands(weight, lora_A, lora_B)
            if operands is not None:
                return compiled_weight_norm(self, *operands, scaling)
        sources = (weight, source(lora_A), source(lora_B))
        return memoised(
            self._norm_memo,
            _reuse_mode(self, sources),
            "norm",
            sources,
            lambda: self._fresh_norm(weight, lora_A, lora_B, scaling, adapter_name),
            extra=float(scaling),
        )

    def _fresh_norm(self, weight, lora_A, lora_B, scaling, adapter_name) -> torch.Tensor:
        w_sq = None
        w = transpose(weight, self.fan_in_fan_out)
        if not weight.requires_grad and w_sq_reusable(w, lora_A, lora_B):
            # a frozen W keeps its ||W||²_row across optimizer steps (they skip it): only cross and Gram are new
            w_sq = memoised(self._w_sq_memo, "any", "w_sq", (weight,), lambda: row_sq_norm(w))

        def compute() -> torch.Tensor:
            return self.get_weight_norm(weight, lora_A, lora_B, scaling, adapter_name=adapter_name, w_sq=w_sq)

        if self.training and _norm_graph_applies(weight, lora_A, lora_B):
            # training forwards recompute the norm of the same tensors, updated in place: one graph launch each
            tensors = (weight, lora_A, lora_B) if w_sq is None else (weight, lora_A, lora_B, w_sq)
            extra = (float(scaling), _env(), get_dora_norm_threshold_bytes())
            return self._norm_graph.run(tensors, extra, compute)
        return compute()

    def _scale(self, weight_norm: torch.Tensor, weight_dtype: torch.dtype) -> torch.Tensor:
        """g = m / max(w_norm, eps); without autograd (inference, frozen m) reused while m and the norm hold."""
        magnitude = self.weight
        if dora_fused.records_grad(magnitude):
            return _magnitude_scale(magnitude, weight_norm, weight_dtype)
        return memoised(
            self._scale_memo,
            _reuse_mode(self),
            "scale",
            (magnitude, weight_norm),
            lambda: _magnitude_scale(magnitude, weight_norm, weight_dtype),
            extra=weight_dtype,
        )

    def update_layer(self, *, base_layer, lora_A, lora_B, scaling, place_on_cpu=False) -> None:
        """Create the magnitude vector: the row norm of the adapted weight, ``||W + s·B·A||_row``."""
        with gather_params_ctx(base_layer.parameters()):
            if base_layer.__class__.__name__ == "Linear4bit":
                # FSDP rejects dequantizing the live module; 8-bit params cannot be deep-copied.
                base_layer = deepcopy(base_layer)
            weight = dequantize_module_weight(base_layer).to(lora_A.device)
            weight_norm = self.get_weight_norm(weight, lora_A, lora_B, scaling)
        # Same dtype as upstream's magnitude, so checkpoints interchange: the promoted weight/adapter dtype.
        weight_norm = weight_norm.to(torch.promote_types(weight.dtype, lora_A.dtype))
        if place_on_cpu:
            weight_norm = weight_norm.to("cpu")
        self.weight = nn.Parameter(weight_norm, requires_grad=True)

    def _base_chunks(self, x, weight, lora_result, g, scaling) -> torch.Tensor:
        """Dropout path: ``base = W·dropout(x)`` computed and composed in output slices of PEFT_DORA_FWD_CHUNK_MB."""
        weight = transpose(weight, self.fan_in_fan_out).to(x.dtype)
        d_out = weight.shape[0]
        row_bytes = max(1, lora_result.numel() // max(d_out, 1)) * lora_result.element_size()
        step = max(1, (_env().fwd_chunk_mb * _MB) // row_bytes)
        if step >= d_out:
            return _compose_with_dispatch(lora_result, F.linear(x, weight), g, scaling, self)
        parts = [
            _compose_with_dispatch(
                lora_result[..., c : c + step], F.linear(x, weight[c : c + step]), g[c : c + step], scaling, self
            )
            for c in range(0, d_out, step)
        ]
        return torch.cat(parts, dim=-1)

    def forward(self, x, *, lora_A, lora_B, scaling, base_layer, base_result=None, adapter_name="default"):
        """The DoRA delta to add to the base layer's output: ``(g - 1)·base + g·(s·lora)``."""
        weight = _forward_weight(base_layer)
        weight_norm = self._forward_norm(weight, lora_A.weight, lora_B.weight, scaling, adapter_name)
        # The norm is a constant for autograd (DoRA paper, section 4.3); only the magnitude gets a gradient.
        g = self._scale(weight_norm, weight.dtype)
        lora_result = _lora_output(lora_A, lora_B, x)
        if base_result is None:
            return self._base_chunks(x, weight, lora_result, g, scaling)
        bias = base_layer.bias
        if bias is not None:
            base_result = base_result - bias
        return _compose_with_dispatch(lora_result, base_result, g, scaling, self)

    def adapted_output(self, x, result, *, lora_A, lora_B, scaling, base_layer, adapter_name="default"):
        """``result + forward(x, base_result=result)`` (no dropout on ``x``), through the one-pass output kernel where
        it applies: the output is then written once and ``g`` never materialises."""
        weight = _forward_weight(base_layer)
        bias = base_layer._parameters["bias"] if type(base_layer) is nn.Linear else base_layer.bias
        weights = _plain_branch(lora_A, lora_B)
        if weights is None:
            lora_result = _lora_output(lora_A, lora_B, x)
            weights = (lora_A.weight, lora_B.weight)
        else:
            out = self._decode_output(x, result, weight, *weights, bias, scaling, adapter_name)
            if out is not None:
                return out
            a = F.linear(x, weights[0])
            if torch.is_grad_enabled() and _env().one_node_branch:
                out = self._branch_output(a, result, weight, weights, bias, scaling, adapter_name)
                if out is not None:
                    return out
            lora_result = F.linear(a, weights[1])
        out = self._small_output(result, lora_result, weight, *weights, bias, scaling, adapter_name)
        if out is not None:
            return out
        weight_norm = self._forward_norm(weight, *weights, scaling, adapter_name)
        magnitude = self._parameters["weight"]
        out = _output_with_dispatch(result, lora_result, bias, magnitude, weight_norm, scaling, weight.dtype, self)
        if out is not None:
            return out
        g = self._scale(weight_norm, weight.dtype)
        base_result = result if bias is None else result - bias
        return result + _compose_with_dispatch(lora_result, base_result, g, scaling, self)

    def _branch_output(self, a, result, weight, weights, bias, scaling, adapter_name):
        """The training forward (grad mode on) with ``lora_B`` inside the output's autograd node
        (:class:`~.dora_fused.FusedDoRALinearFunction`), or None where it does not apply: nothing to differentiate,
        dtypes or layouts the kernels leave alone, torch.compile, the fused tiers switched off."""
        weight_a, weight_b = weights
        magnitude = self._parameters["weight"]
        if not (a.requires_grad or result.requires_grad or weight_b.requires_grad or magnitude.requires_grad):
            return None
        env = _env()
        if env.fused is False or env.fused_backward is False or not dora_fused.kernels_available(result):
            return None
        if torch.compiler.is_compiling():
            return None
        stride = dora_fused.branch_node_stride(a, result, weight_b, magnitude, bias)
        if stride is None:
            return None
        weight_norm = self._forward_norm(weight, weight_a, weight_b, scaling, adapter_name)
        if not dora_fused.norm_operand(weight_norm, magnitude):
            return None
        _record_tier(self, TIER_FUSED_BACKWARD)
        eps = _eps_for(weight.dtype)
        return dora_fused.FusedDoRALinearFunction.apply(
            result, a, weight_b, magnitude, weight_norm, bias, float(scaling), eps, stride
        )

    def _small_output(self, result, lora, weight, lora_A, lora_B, bias, scaling, adapter_name):
        """The fused forward for few rows (decode), or None where it does not apply.

        Without autograd, with the norm reused across forwards (eval) and at most ``_SMALL_FORWARD_NUMEL`` outputs,
        ``y = g·(result + s·lora) (+ (1 − g)·bias)`` is two (three) in-place PyTorch ops on the fresh LoRA output,
        the first with the scalar s (a third cheaper on the host than two ops with [d_out] factors), each computed
        in fp32 and rounded once, with the [d_out] factors kept from the first such forward.
        """
        if lora.numel() > _SMALL_FORWARD_NUMEL:
            return None
        magnitude = self._parameters["weight"]
        # Autograd recording an op on W, A or B records one on the outputs too, so this check also stands for the
        # factors in `_reuse_mode`: without it, factors are reused across forwards in eval mode or with NORM_CACHE=1.
        if torch.is_grad_enabled() and (result.requires_grad or lora.requires_grad or magnitude.requires_grad):
            return None
        if lora.shape != result.shape or lora.dtype != result.dtype or lora._base is not None:
            return None
        rows = self._small_factors(result, weight, lora_A, lora_B, bias, scaling, adapter_name)
        if rows is None:
            return None
        out = torch.add(result, lora, alpha=float(scaling), out=lora).mul_(rows[1])
        if bias is not None:
            out.add_(rows[2])
        _record_tier(self, TIER_SMALL_FORWARD)
        return out

    def _decode_output(self, x, result, weight, lora_A, lora_B, bias, scaling, adapter_name):
        """``F.linear(F.linear(x, A), B)`` and the small forward's composition in two Triton launches
        (``dora_decode``), for at most ``dora_decode.MAX_TOKENS`` rows without autograd, or None where they do not
        apply. Same conditions and reused factors as :meth:`_small_output`, whose four launches they replace."""
        if result.numel() > dora_decode.MAX_TOKENS * result.shape[-1] or not _env().decode_kernels:
            return None
        magnitude = self._parameters["weight"]
        if torch.is_grad_enabled() and (
            x.requires_grad or result.requires_grad or lora_A.requires_grad or lora_B.requires_grad
            or magnitude.requires_grad
        ):  # fmt: skip
            return None
        rows = self._small_factors(result, weight, lora_A, lora_B, bias, scaling, adapter_name)
        if rows is None:
            return None
        # the plan of the previous decode step holds while its factors (W, A, B, m, bias, s) and its inputs' layout do
        key, plan = dora_decode.plan_key(x, result), self._decode.plan
        if plan is None or plan.factors is not rows[0] or plan.key != key:
            layout = dora_decode.decode_layout(x, result, lora_A, lora_B)
            if layout is None:
                return None
            plan = dora_decode.DecodePlan(key, x, result, lora_A, lora_B, rows[0], scaling, layout, bias is not None)
            self._decode.plan = plan
        out = plan.run(x, result)
        _record_tier(self, TIER_DECODE)
        return out

    def _small_factors(self, result, weight, lora_A, lora_B, bias, scaling, adapter_name):
        """``(f, g, (1 − g)·bias)`` (f the fp32 ``[1 or 2, d_out]`` stack, then its rows as views; no bias row
        without a bias), kept across forwards while W, A, B, m and the bias hold, or None where factors are not
        reused here (training, PEFT_DORA_NORM_CACHE=0), the kernels are off or unavailable, torch.compile traces, or a
        CUDA graph is captured. The caller has checked that autograd records nothing."""
        magnitude = self._parameters["weight"]
        env = _env()
        if env.norm_cache is False or (self.training and not env.norm_cache):
            return None  # `_reuse_mode(self) != "any"`: factors computed every forward, the one launch is cheaper
        if magnitude.dim() != 1:
            return None
        if env.fused is False or not dora_fused.kernels_available(result):
            _kernels_allowed(result)  # raises where PEFT_DORA_FUSED=1 forces kernels that cannot run
            return None  # the eager tier
        if torch.compiler.is_compiling():
            return None
        sources = (weight, source(lora_A), source(lora_B), magnitude) + (() if bias is None else (bias,))
        if capturing(sources):
            return None  # a graph is captured whose replays must follow updates

        def factors() -> torch.Tensor:
            weight_norm = self._forward_norm(weight, lora_A, lora_B, scaling, adapter_name)
            g = _magnitude_scale(magnitude, weight_norm, weight.dtype).float()
            return torch.stack((g,) if bias is None else (g, (1 - g) * bias.float()))

        scaling = float(scaling)
        # the common case first, without `memoised`'s checks of compile and capture (made above)
        f = reused(self._small_memo, "scale", sources, scaling)
        if f is None:
            f = memoised(self._small_memo, "any", "scale", sources, factors, extra=scaling)
        rows = self._small_rows
        if not rows or rows[0] is not f:  # the rows as views, made once per value of the factors
            rows = self._small_rows = (f, *f.unbind(0))
        return rows

    def __repr__(self) -> str:
        return "lora.dora." + super().__repr__()


class DoraEmbeddingLayer(DoraLinearLayer):
    """Magnitude vector of one adapter on an Embedding: one entry per embedding dimension (column of the table)."""

    @cache_decorator("weight-norm")
    def get_weight_norm(self, weight, lora_A, lora_B, scaling, adapter_name: Optional[str] = None) -> torch.Tensor:
        """Norm of each column of ``weight + scaling·(lora_B·lora_A)ᵀ``, with ``lora_A`` [r, num_embeddings] and
        ``lora_B`` [embedding_dim, r] as stored in ``lora_embedding_A/B``; factored like the Linear case."""
        return factored_row_norm(weight.T, lora_A, lora_B, scaling)

    def forward(self, x, *, lora_A, lora_B, scaling, base_layer, embed_fn, adapter_name="default"):
        """Return ``(g, lora)``: the [embedding_dim] scale and the unscaled LoRA output ``embed(x, A) @ B``.

        ``lora_A``/``lora_B`` are the transposed embedding factors as the Embedding layer passes them.
        """
        weight_norm = self._forward_norm(base_layer.weight, lora_A.T, lora_B.T, scaling, adapter_name)
        g = self._scale(weight_norm, base_layer.weight.dtype)
        return g, embed_fn(x, lora_A) @ lora_B

    def _fresh_norm(self, weight, lora_A, lora_B, scaling, adapter_name) -> torch.Tensor:
        return self.get_weight_norm(weight, lora_A, lora_B, scaling, adapter_name=adapter_name)

    def _norm_operands(self, weight, lora_A, lora_B) -> Optional[tuple]:
        return weight.T, lora_A, lora_B


class _DoraConvNdLayer(DoraLinearLayer):
    """Magnitude of one adapter on a ConvNd layer, shaped [1, out_channels, 1, ...] as in upstream checkpoints."""

    @cache_decorator("weight-norm")
    def get_weight_norm(self, weight, lora_A, lora_B, scaling, adapter_name: Optional[str] = None) -> torch.Tensor:
        """Per-output-channel norm of the adapted conv weight, shaped [1, out_channels, 1, ...]."""
        norm = factored_conv_norm(weight, lora_A, lora_B, scaling)
        return norm.view((1, -1) + (1,) * (weight.dim() - 2))

    def forward(self, x, *, lora_A, lora_B, scaling, base_layer, base_result=None, adapter_name: str = "default"):
        """The DoRA delta to add to the base conv output."""
        weight = base_layer.weight
        weight_norm = self._forward_norm(weight, lora_A.weight, lora_B.weight, scaling, adapter_name)
        g = self._scale(weight_norm, weight.dtype)
        if base_result is None:
            base_result = self.conv_fn(
                x,
                weight,
                bias=None,
                stride=base_layer.stride,
                padding=base_layer.padding,
                dilation=base_layer.dilation,
                groups=base_layer.groups,
            )
        elif base_layer.bias is not None:
            base_result = base_result - base_layer.bias.view((1, -1) + (1,) * (base_result.dim() - 2))
        return _compose_with_dispatch(lora_B(lora_A(x)), base_result, g, scaling, self)

    def _fresh_norm(self, weight, lora_A, lora_B, scaling, adapter_name) -> torch.Tensor:
        return self.get_weight_norm(weight, lora_A, lora_B, scaling, adapter_name=adapter_name)

    def _norm_operands(self, weight, lora_A, lora_B) -> Optional[tuple]:
        return None  # the conv norm is per group (factored_conv_norm): traced as PyTorch under torch.compile

    def adapted_output(self, x, result, *, lora_A, lora_B, scaling, base_layer, adapter_name="default"):
        """``result + forward(x, base_result=result)``: the conv scale broadcasts over a middle dimension, which the
        one-pass kernel does not take."""
        delta = self(x, lora_A=lora_A, lora_B=lora_B, scaling=scaling, base_layer=base_layer, base_result=result,
                     adapter_name=adapter_name)  # fmt: skip
        return result + delta


class DoraConv1dLayer(_DoraConvNdLayer):
    def __init__(self, fan_in_fan_out):
        super().__init__(fan_in_fan_out)
        self.conv_fn = F.conv1d


class DoraConv2dLayer(_DoraConvNdLayer):
    def __init__(self, fan_in_fan_out):
        super().__init__(fan_in_fan_out)
        self.conv_fn = F.conv2d


class DoraConv3dLayer(_DoraConvNdLayer):
    def __init__(self, fan_in_fan_out):
        super().__init__(fan_in_fan_out)
        self.conv_fn = F.conv3d


# ---------------------------------------------------------------------------------------------------------------
# Variants: the hooks upstream's LoRA layers call (routed here by the glue in variants.py).
# ---------------------------------------------------------------------------------------------------------------


def _register_magnitude(module) -> None:
    watch_merges(type(module))
    if not module.lora_magnitude_vector:
        # the first DoRA adapter on this layer: the magnitudes become trainable adapter weights
        module.adapter_layer_names = module.adapter_layer_names[:] + ("lora_magnitude_vector",)


def _merge_factor(module, active_adapter: str, weight_norm: torch.Tensor, view_shape) -> torch.Tensor:
    magnitude = module.lora_magnitude_vector[active_adapter].weight.reshape(-1)
    weight_dtype = module.get_base_layer().weight.dtype
    return _magnitude_scale(magnitude, weight_norm.reshape(-1), weight_dtype).reshape(view_shape)


def _on_device_of_result(forward):
    """Run a variant's ``forward(module, adapter, x, result)`` with ``result``'s CUDA device current.

    A model split over GPUs (``device_map="auto"``, pipeline stages) runs layers on cuda:1 while cuda:0 is current.
    PyTorch's own ops follow their tensors' device; Triton launches, the decode plan's raw stream and CUDA-graph
    capture and replay act on the current device, so the forward switches to the tensors' device where it differs
    (one device query otherwise). Backward passes run on autograd's per-device threads, where it already is current.
    """

    @wraps(forward)
    def run(module, active_adapter: str, x: torch.Tensor, result: torch.Tensor, **kwargs) -> torch.Tensor:
        switch = device_switch(result)
        if switch is None:
            return forward(module, active_adapter, x, result, **kwargs)
        with switch:
            return forward(module, active_adapter, x, result, **kwargs)

    return run


class _DoraVariantBase(LoraVariant):
    """merge/unmerge shared by all DoRA variants; subclasses say where the factors live and how to shape the factor.

    The norm is taken on the base weight with earlier merged adapters taken out (``_unmerged_base_weight``), as
    ``forward`` sees it, and cached on the module so ``unmerge`` divides by exactly the factor ``merge`` applied.
    """

    @staticmethod
    def _factors(module, active_adapter: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, B) of the adapter as its DoRA layer's ``get_weight_norm`` takes them."""
        return module.lora_A[active_adapter].weight, module.lora_B[active_adapter].weight

    @staticmethod
    def _factor_view(module) -> tuple[int, ...]:
        raise NotImplementedError

    @classmethod
    def _merge_parts(cls, module, active_adapter, orig_weight, safe_merge: bool):
        """(delta, factor) for merging: the factor is m / norm of the unmerged base weight plus this adapter."""
        delta_weight = module.get_delta_weight(active_adapter)
        dora_layer = module.lora_magnitude_vector[active_adapter]
        with module._unmerged_base_weight(safe_merge=safe_merge) as base_weight:
            lora_A, lora_B = cls._factors(module, active_adapter)
            weight_norm = dora_layer.get_weight_norm(base_weight, lora_A, lora_B, module.scaling[active_adapter])
        module._cache_store(f"{active_adapter}-weight_norm", weight_norm)
        factor = _merge_factor(module, active_adapter, weight_norm, cls._factor_view(module))
        return delta_weight, factor

    @classmethod
    def merge_safe(cls, module, active_adapter: str, orig_weight: torch.Tensor) -> torch.Tensor:
        delta_weight, factor = cls._merge_parts(module, active_adapter, orig_weight, safe_merge=True)
        # `merge` copied the weight before `_unmerged_base_weight` rebuilt it; in low precision the rebuilt weight
        # differs from that copy, so merge onto the rebuilt one.
        rebuilt = dequantize_module_weight(module.get_base_layer())
        return (factor * (rebuilt + delta_weight)).to(orig_weight.dtype)

    @classmethod
    def merge_unsafe(cls, module, active_adapter: str, orig_weight: torch.Tensor) -> None:
        delta_weight, factor = cls._merge_parts(module, active_adapter, orig_weight, safe_merge=False)
        orig_weight.data = (factor * (orig_weight.data + delta_weight)).to(orig_weight.dtype)

    @classmethod
    def unmerge(cls, module, active_adapter: str, orig_weight: torch.Tensor) -> torch.Tensor:
        delta_weight = module.get_delta_weight(active_adapter)
        weight_norm = module._cache_pop(f"{active_adapter}-weight_norm")
        factor = _merge_factor(module, active_adapter, weight_norm, cls._factor_view(module))
        return (orig_weight.data / factor - delta_weight).to(orig_weight.dtype)


class DoraLinearVariant(_DoraVariantBase):
    @staticmethod
    def init(module, adapter_name: str, **kwargs: Any) -> None:
        _register_magnitude(module)
        dora_layer = DoraLinearLayer(fan_in_fan_out=getattr(module, "fan_in_fan_out", False))
        lora_A = module.lora_A[adapter_name].weight
        lora_B = module.lora_B[adapter_name].weight
        place_on_cpu = module.ephemeral_gpu_offload and (lora_A.device.type == "cpu" or lora_B.device.type == "cpu")
        if module.ephemeral_gpu_offload:
            # compute the initial norm on the accelerator, then keep the magnitude where the adapter lives
            accel = _accelerator_of(lora_A, lora_B)
            lora_A, lora_B = lora_A.to(accel), lora_B.to(accel)
        dora_layer.update_layer(
            base_layer=module.get_base_layer(),
            lora_A=lora_A,
            lora_B=lora_B,
            scaling=module.scaling[adapter_name],
            place_on_cpu=place_on_cpu,
        )
        module.lora_magnitude_vector[adapter_name] = dora_layer

    @staticmethod
    def _factor_view(module):
        return (1, -1) if module.fan_in_fan_out else (-1, 1)

    @staticmethod
    @_on_device_of_result
    def forward(module, active_adapter: str, x: torch.Tensor, result: torch.Tensor, **kwargs) -> torch.Tensor:
        # submodules straight from the module dicts: nn.Module.__getattr__ and ModuleDict.__getitem__ cost host time
        # in every forward (a decode step runs this once per adapted Linear)
        modules = module._modules
        dora_layer = modules["lora_magnitude_vector"]._modules[active_adapter]
        lora_A, lora_B = modules["lora_A"]._modules[active_adapter], modules["lora_B"]._modules[active_adapter]
        scaling, base_layer = module.scaling[active_adapter], _base_layer(module)
        dropout = modules["lora_dropout"]._modules[active_adapter]
        if not module.training or isinstance(dropout, nn.Identity):
            return dora_layer.adapted_output(
                x, result, lora_A=lora_A, lora_B=lora_B, scaling=scaling, base_layer=base_layer,
                adapter_name=active_adapter,
            )  # fmt: skip
        # with dropout the base output of the dropped-out input is needed: W·dropout(x) is recomputed in slices
        return result + dora_layer(
            dropout(x), lora_A=lora_A, lora_B=lora_B, scaling=scaling, base_layer=base_layer, base_result=None,
            adapter_name=active_adapter,
        )  # fmt: skip


def _base_layer(module: nn.Module) -> nn.Module:
    """``module.get_base_layer()``, without its failing attribute probe (an exception per call) for a plain Linear."""
    base = module._modules.get("base_layer")
    return base if type(base) is nn.Linear else module.get_base_layer()


def _accelerator_of(lora_A: torch.Tensor, lora_B: torch.Tensor) -> torch.device:
    for t in (lora_A, lora_B):
        if t.device.type in ("cuda", "xpu"):
            return t.device
    return torch.device("xpu" if hasattr(torch, "xpu") and torch.xpu.is_available() else "cuda")


class DoraEmbeddingVariant(_DoraVariantBase):
    @staticmethod
    def init(module, adapter_name: str, **kwargs: Any) -> None:
        _register_magnitude(module)
        dora_layer = DoraEmbeddingLayer(fan_in_fan_out=True)
        dora_layer.update_layer(
            base_layer=module.get_base_layer(),
            lora_A=module.lora_embedding_A[adapter_name],
            lora_B=module.lora_embedding_B[adapter_name],
            scaling=module.scaling[adapter_name],
        )
        module.lora_magnitude_vector[adapter_name] = dora_layer

    @staticmethod
    def _factors(module, active_adapter):
        return module.lora_embedding_A[active_adapter], module.lora_embedding_B[active_adapter]

    @staticmethod
    def _factor_view(module):
        return (1, -1)

    @staticmethod
    @_on_device_of_result
    def forward(module, active_adapter: str, x: torch.Tensor, result: torch.Tensor, **kwargs) -> torch.Tensor:
        dora_layer = module.lora_magnitude_vector[active_adapter]
        g, lora = dora_layer(
            x,
            lora_A=module.lora_embedding_A[active_adapter].T,
            lora_B=module.lora_embedding_B[active_adapter].T,
            scaling=module.scaling[active_adapter],
            base_layer=module.get_base_layer(),
            embed_fn=module._embed,
            adapter_name=active_adapter,
        )
        # Scaled embeddings (e.g. Gemma's) scale the base output inside the layer; the LoRA path needs the same.
        embed_scale = module._get_embed_scale()
        if embed_scale is not None:
            lora = lora * embed_scale.to(lora.dtype)
        # g·result + g·s·lora, in the stable form with `result` as the base.
        return result + _compose_with_dispatch(lora, result, g, module.scaling[active_adapter], dora_layer)


class _DoraConvNdVariant(_DoraVariantBase):
    @staticmethod
    def init_convd_variant(module, adapter_name: str, dora_layer: nn.Module) -> None:
        _register_magnitude(module)
        dora_layer.update_layer(
            base_layer=module.get_base_layer(),
            lora_A=module.lora_A[adapter_name].weight,
            lora_B=module.lora_B[adapter_name].weight,
            scaling=module.scaling[adapter_name],
        )
        module.lora_magnitude_vector[adapter_name] = dora_layer

    @staticmethod
    def _factor_view(module):
        return module._get_dora_factor_view()

    forward = staticmethod(DoraLinearVariant.forward)


class DoraConv1dVariant(_DoraConvNdVariant):
    @staticmethod
    def init(module, adapter_name: str, config=None, **kwargs: Any) -> None:
        _DoraConvNdVariant.init_convd_variant(module, adapter_name, dora_layer=DoraConv1dLayer(fan_in_fan_out=False))


class DoraConv2dVariant(_DoraConvNdVariant):
    @staticmethod
    def init(module, adapter_name: str, config=None, **kwargs: Any) -> None:
        _DoraConvNdVariant.init_convd_variant(module, adapter_name, dora_layer=DoraConv2dLayer(fan_in_fan_out=False))


class DoraConv3dVariant(_DoraConvNdVariant):
    @staticmethod
    def init(module, adapter_name: str, config=None, **kwargs: Any) -> None:
        _DoraConvNdVariant.init_convd_variant(module, adapter_name, dora_layer=DoraConv3dLayer(fan_in_fan_out=False))
