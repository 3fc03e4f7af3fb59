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
"""DoRA for PEFT: the layers that hold an adapter's magnitude and compute its contribution, and the variants that
upstream's LoRA layers call.

Where the rest lives: the weight norm in ``dora_norm`` (factored, never a dense ``B·A``), what a layer keeps across
forwards in ``dora_cache.LayerReuse``, the choice of tier in ``dora_dispatch``, the kernels and autograd nodes in
``dora_fused`` (decode: ``dora_decode``), the ``PEFT_DORA_*`` switches in ``dora_settings``. The names documented
as public (``factored_row_norm``, ``set_dora_norm_threshold_mb``, ``norm_counts``, ``tier_counts``, ...) are
importable from here.
"""

from __future__ import annotations

import collections
import contextlib
from copy import deepcopy
from functools import wraps
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _nn_module

from peft.utils.integrations import dequantize_module_weight, gather_params_ctx

from . import dora_batch, dora_decode, dora_dispatch, dora_dist, dora_fused, dora_norm, dora_quant, dora_settings
from .dora_cache import (
    KeyedMemo,
    LayerReuse,
    SmallRecord,
    TrainRecord,
    _epoch,
    capturing,
    identity_tracked,
    memoised,
    prefetch_zero_test,
    reused,
    source,
    watch_merges,
)
from .dora_cache import invalidate_norm_caches as invalidate_norm_caches  # public here, as documented
from .dora_cache import norm_counts as norm_counts  # public here, as documented
from .dora_cache import step_callbacks as dora_cache_step_callbacks
from .dora_dispatch import (
    KERNEL_DTYPES,
    TIER_DECODE,
    TIER_EAGER,
    TIER_FUSED_BACKWARD,
    TIER_FUSED_FORWARD,
    TIER_MEANINGS,
    TIER_SMALL_FORWARD,
    LinearGates,
    branch_node_stride,
    compose_tier,
    norm_operand,
    output_layout,
    record,
    records_grad,
    wider_branch,
    wider_result,
)
from .dora_dispatch import tier_counts as tier_counts  # public here, as documented
from .dora_graph import NormGraph
from .dora_graph import graph_counts as graph_counts  # public here, as documented
from .dora_launch import device_switch
from .dora_norm import compiled_weight_norm, eps_for, factored_conv_norm, magnitude_scale, reuse_mode, row_sq_norm
from .dora_norm import factored_row_norm as factored_row_norm  # public here, as documented
from .dora_settings import _invalidate_fused_cache as _invalidate_fused_cache  # the documented reset
from .dora_settings import get_dora_norm_threshold_bytes as get_dora_norm_threshold_bytes  # public, as documented
from .dora_settings import get_dora_norm_threshold_mb as get_dora_norm_threshold_mb  # public, as documented
from .dora_settings import set_dora_norm_threshold_mb as set_dora_norm_threshold_mb  # public, as documented
from .layer import LoraVariant


__all__ = [
    "TIER_DECODE",
    "TIER_EAGER",
    "TIER_FUSED_BACKWARD",
    "TIER_FUSED_FORWARD",
    "TIER_SMALL_FORWARD",
    "DoraConv1dLayer",
    "DoraConv2dLayer",
    "DoraConv3dLayer",
    "DoraEmbeddingLayer",
    "DoraLinearLayer",
    "factored_row_norm",
    "get_dora_norm_threshold_bytes",
    "get_dora_norm_threshold_mb",
    "graph_counts",
    "invalidate_norm_caches",
    "is_triton_available",
    "norm_counts",
    "set_dora_norm_threshold_mb",
    "summary",
    "tier_counts",
]

ENABLE_DORA_CACHING = False
"""Cache the weight norm in eval mode (see ``peft.helpers.DoraCaching``); no dense ``B·A`` is ever cached."""


def is_triton_available() -> bool:
    """True if Triton is importable."""
    return dora_fused.is_triton_available()


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
        if dora_settings.current().fused is False:
            lines.append("eager because PEFT_DORA_FUSED=0; unset it for the fused tiers")
        elif not is_triton_available():
            lines.append("eager because Triton is not installed: `pip install triton` gives the fused tiers")
    return "\n".join(lines)


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


# ---------------------------------------------------------------------------------------------------------------
# Layers: hold the magnitude vector of one adapter and compute its DoRA contribution.
# ---------------------------------------------------------------------------------------------------------------


def _shard_extra(weight, lora_A, lora_B, scaling, shards) -> tuple:
    """What a sharded norm is kept under beside the shards: the scaling, the gathered dtypes (FSDP2's mixed precision
    gathers shards in another dtype) and the versions (``dora_dist.NormShards.versions``)."""
    return (float(scaling), weight.dtype, lora_A.dtype, lora_B.dtype, shards.versions())


class DoraLinearLayer(nn.Module):
    """Magnitude vector and DoRA contribution of one adapter on a Linear (or GPT-2 ``Conv1D``) layer."""

    def __init__(self, fan_in_fan_out):
        super().__init__()
        self.fan_in_fan_out = fan_in_fan_out
        self.last_tier: Optional[str] = None  # the dispatch tier of the latest forward
        self._reuse = LayerReuse()  # what this layer keeps across forwards; not part of the state_dict
        self._dora_cache: dict[str, Any] = {}  # ENABLE_DORA_CACHING's values, under upstream's name
        # torch.compile: the norm op's output saved through checkpointed regions, not recomputed, and a graph's norm
        # op calls made one (set here, in eager code: a pass set while Dynamo traces is traced, not run)
        dora_norm.set_norm_passes()

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        # a module pickled by upstream PEFT (``torch.save(model)``) has upstream's attributes only
        self.__dict__.setdefault("_reuse", LayerReuse())
        self.__dict__.setdefault("last_tier", None)
        self.__dict__.setdefault("_dora_cache", {})

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
        if mode != self.training:
            # train()/eval() forget kept norms, whatever wrote the weights meanwhile; inference does not replay the
            # norm graph, whose memory pool then serves other graphs or none
            self._reuse.clear(graph=not mode)
        super().train(mode=mode)
        return self

    @cache_decorator("weight-norm")
    def get_weight_norm(
        self, weight, lora_A=None, lora_B=None, scaling=None, adapter_name: Optional[str] = None, w_sq=None, **kwargs
    ) -> torch.Tensor:
        """Detached fp32 norm of ``weight + scaling·lora_B·lora_A`` per output row (weight as stored by the layer, or a
        ``dora_quant.QuantizedWeight``). Upstream's form, ``get_weight_norm(weight, lora_weight, scaling)`` with the
        dense ``lora_weight`` (positional or by name, as outside code calls it), gives upstream's dense norm."""
        dense = _upstream_norm_args(lora_A, lora_B, scaling, kwargs)
        if dense is not None:
            return self._dense_norm(weight, *dense)
        if isinstance(weight, dora_quant.QuantizedWeight):
            return dora_quant.row_norm(weight, lora_A, lora_B, scaling, w_sq=w_sq)
        return factored_row_norm(_oriented(weight, self.fan_in_fan_out), lora_A, lora_B, scaling, w_sq=w_sq)

    def _dense_norm(self, weight, lora_weight, scaling) -> torch.Tensor:
        """Upstream's norm of the dense ``weight + scaling·lora_weight`` per output row, in ``weight``'s dtype."""
        weight = _oriented(weight, self.fan_in_fan_out)
        return torch.linalg.vector_norm(weight + scaling * lora_weight, dim=1).to(weight.dtype)

    @cache_decorator("lora-weight")
    def get_lora_weight(self, lora_A, lora_B, adapter_name: Optional[str] = None) -> torch.Tensor:
        """Upstream's dense ``lora_weight`` [d_out, d_in] of the LoRA modules: ``lora_B(lora_A(I))ᵀ``, run through the
        modules (their hooks see it) in ``lora_A``'s dtype. Not used by the forwards, except where the modules act on
        their calls (:meth:`_norm_through_modules`)."""
        return _lora_weight_through_modules(lora_A, lora_A.weight.device, lora_B)

    def update_layer(self, *, base_layer, lora_A, lora_B, scaling, place_on_cpu=False) -> None:
        """Create the magnitude vector: the row norm of the adapted weight, ``||W + s·B·A||_row``."""
        with gather_params_ctx(base_layer.parameters()):
            weight = dora_quant.quantized_weight(base_layer)  # bitsandbytes: read in chunks, never dequantized whole
            if weight is None:
                if base_layer.__class__.__name__ == "Linear4bit":
                    # FSDP rejects dequantizing the live module; 8-bit params cannot be deep-copied.
                    base_layer = deepcopy(base_layer)
                weight = dequantize_module_weight(base_layer).to(lora_A.device)
            weight_norm = self.get_weight_norm(weight, lora_A, lora_B, scaling).to(lora_A.device)
        # Same dtype as upstream's magnitude, so checkpoints interchange: the promoted weight/adapter dtype.
        weight_norm = weight_norm.to(torch.promote_types(weight.dtype, lora_A.dtype))
        if place_on_cpu:
            weight_norm = weight_norm.to("cpu")
        self.weight = nn.Parameter(weight_norm, requires_grad=True)

    def forward(
        self, x, *, lora_A, lora_B, scaling, base_layer, base_result=None, adapter_name="default", keep=None
    ):  # fmt: skip
        """The DoRA delta to add to the base layer's output: ``(g - 1)·base + g·(s·lora)`` (``keep``: see
        :meth:`dropout_output`)."""
        weight = _forward_weight(base_layer)
        if dora_dist.fsdp1_unit(lora_A) or dora_dist.fsdp1_unit(lora_B):
            # FSDP1 units of their own: A and B are whole only inside their forwards, so the branch first
            lora_result, weight_a, weight_b = dora_dist.lora_output_and_weights(lora_A, lora_B, x)
        else:
            lora_result, weight_a, weight_b = None, lora_A.weight, lora_B.weight
        if lora_result is None and _acts_on_calls(lora_A, lora_B):
            weight_norm = self._norm_through_modules(base_layer, lora_A, lora_B, scaling, x)
        else:
            weight_norm = self._forward_norm(weight, weight_a, weight_b, scaling, adapter_name)
        # The norm is a constant for autograd (DoRA paper, section 4.3); only the magnitude gets a gradient.
        g = self._scale(weight_norm, weight.dtype)
        if lora_result is None:
            lora_result = _lora_output(lora_A, lora_B, x)
        if base_result is None:
            return self._dropped_delta(x, weight, lora_result, g, scaling, keep)
        bias = base_layer.bias
        if bias is not None:
            base_result = base_result - bias
        return self._compose(lora_result, base_result, g, scaling)

    def adapted_output(self, x, result, *, lora_A, lora_B, scaling, base_layer, adapter_name="default"):
        """``result + forward(x, base_result=result)`` (no dropout on ``x``), on the first tier whose gates hold
        (``dora_dispatch`` lists them): the decode step or the small forward with reused factors, the training
        output with ``lora_B`` inside its node, the one-pass output kernel, the composition."""
        weight = _forward_weight(base_layer)
        bias = _own_param(base_layer, "bias") if type(base_layer) is nn.Linear else base_layer.bias
        magnitude = _own_param(self, "weight")
        plain = _plain_branch(lora_A, lora_B)
        weight_norm = None
        if plain is None:  # LoRA modules with a bias, hooks or a forward of their own run as they are
            weight_a, weight_b = lora_A.weight, lora_B.weight
            if _acts_on_calls(lora_A, lora_B):
                weight_norm = self._norm_through_modules(base_layer, lora_A, lora_B, scaling, x)
            elif hasattr(weight_a, "ds_id") or hasattr(weight_b, "ds_id"):
                # DeepSpeed ZeRO-3 gathers A and B on access and partitions them again after lora_A's and lora_B's
                # forwards: the norm first, as upstream's DoRA does
                weight_norm = self._forward_norm(weight, weight_a, weight_b, scaling, adapter_name)
            lora = _lora_output(lora_A, lora_B, x)
            gates = LinearGates(result, magnitude, (lora,), False, self.training)
        elif torch.compiler.is_compiling():
            return self._traced_output(x, result, weight, *plain, magnitude, bias, scaling, adapter_name)
        else:
            weight_a, weight_b = plain
            lora = None
            gates = LinearGates(result, magnitude, (x, weight_a, weight_b), True, self.training)

        zero_free = self._reuse.zero_free
        if self.training and gates.fused:
            shard = self._reuse.magnitude_shard
            if shard is None or not shard.holds(magnitude):
                shard = self._reuse.magnitude_shard = dora_dist.magnitude_shard(magnitude)
            if shard is None:
                shard = dora_dist.flat_magnitude(magnitude)
            if shard is not None:  # FSDP2, FSDP1: the answer is kept for the magnitude's shard, not its gathered copy
                zero_free = KeyedMemo(zero_free, shard.keys, shard.versions(), shard)
            elif hasattr(magnitude, "ds_id") and dora_dist.PartitionZeroTest.applies(magnitude):
                zero_free = dora_dist.PartitionZeroTest()  # DeepSpeed ZeRO-3: one test of all partitions per step
            if not gates.grad and magnitude.requires_grad and magnitude.is_cuda:
                # the no-grad first pass of a reentrant checkpoint: start the magnitude's zero test now, so that the
                # training node of the recompute (in the backward) finds the answer instead of waiting for the GPU
                prefetch_zero_test(magnitude, zero_free)
        factors = None
        if gates.reuses_factors and weight_norm is None:
            factors = self._factors(weight, weight_a, weight_b, magnitude, bias, scaling, adapter_name)
            if factors is not None and gates.decode:
                out = self._decode(x, result, weight_a, weight_b, factors, bias, scaling)
                if out is not None:
                    self._keep_decode_record(
                        x, result, base_layer, weight, weight_a, weight_b, magnitude, bias, scaling, adapter_name
                    )
                    return out

        if factors is not None:  # gates.small: no autograd, a plain branch, factors reused
            out = self._small_output(x, result, weight_a, weight_b, factors, scaling)
            if out is not None:
                record(self, TIER_SMALL_FORWARD)
                self._keep_small_record(
                    x, result, base_layer, weight, weight_a, weight_b, magnitude, bias, scaling, adapter_name
                )
                return out

        if lora is None:
            a = F.linear(x, weight_a)
            stride = branch_node_stride(a, result, weight_b, magnitude, bias) if gates.one_node else None
            if stride is not None:
                weight_norm = self._forward_norm(weight, weight_a, weight_b, scaling, adapter_name, batched=True)
                if norm_operand(weight_norm, magnitude):
                    record(self, TIER_FUSED_BACKWARD)
                    eps = eps_for(weight.dtype)
                    consts = (weight_norm, bias, float(scaling), eps, stride, zero_free)
                    if zero_free is self._reuse.zero_free and stride == result.shape[-1]:
                        self._keep_train_record(x, result, base_layer, weight, weight_a, weight_b, magnitude, bias,
                                                scaling, eps)  # fmt: skip
                    return dora_fused.linear_node(result, a, weight_b, magnitude, None, consts)
            lora = F.linear(a, weight_b)

        if weight_norm is None:
            weight_norm = self._forward_norm(weight, weight_a, weight_b, scaling, adapter_name)
        output = gates.output_tier(result, lora, bias, magnitude, weight_norm)
        if output is not None:
            tier, strides = output
            record(self, tier)
            eps = eps_for(weight.dtype)
            out = dora_fused.run_fused_output(
                result, lora, magnitude, weight_norm, scaling, eps, bias, strides, zero_free
            )
            if (
                plain is not None
                and not (self.training or gates.grad)
                and dora_settings.current().norm_cache is not False
            ):
                self._keep_one_pass_record(
                    x, result, lora, base_layer, weight, plain, magnitude, bias, scaling, adapter_name, weight_norm, eps
                )
            return out
        g = self._scale(weight_norm, weight.dtype)
        base_result = result if bias is None else result - bias
        return result + self._compose(lora, base_result, g, scaling, gates)

    def dropout_output(self, x, result, *, lora_A, lora_B, scaling, base_layer, adapter_name="default", keep=None):
        """``result + forward(x)`` for the dropped-out input ``x`` (LoRA dropout, upstream's semantics: the magnitude
        scales ``W·x`` of the dropped-out input, a second base matmul). A training forward of a Linear with a plain
        LoRA branch and a dense or bitsandbytes-quantized W, whose output fits PEFT_DORA_FWD_CHUNK_MB, runs ``W·x`` and
        ``a = x·Aᵀ`` as ordinary matmuls and the rest in the output's node (``FusedDoRALinearFunction`` with its
        ``base`` input): one node in place of the composition's ops and the residual add; anything else composes as
        :meth:`forward` does. ``keep``: ``x`` is ``nn.Dropout``'s output (keep probability ``keep``) of a bf16 input
        cast to fp32 adapters (:func:`_half_input_keep`), so a bf16 W computes ``W·x`` without an fp32 copy
        (:func:`_dropped_base`)."""
        if type(self) is DoraLinearLayer and not torch.compiler.is_compiling():
            out = self._dropout_node(x, result, lora_A, lora_B, scaling, base_layer, adapter_name, keep)
            if out is not None:
                return out
        kwargs = {} if keep is None else {"keep": keep}  # the Linear's own forward takes it (not Conv's)
        return result + self(
            x, lora_A=lora_A, lora_B=lora_B, scaling=scaling, base_layer=base_layer, base_result=None,
            adapter_name=adapter_name, **kwargs,
        )  # fmt: skip

    def _dropout_node(
        self, x, result, lora_A, lora_B, scaling, base_layer, adapter_name, keep=None
    ) -> Optional[torch.Tensor]:
        plain = _plain_branch(lora_A, lora_B)
        weight = _forward_weight(base_layer)
        quantized = isinstance(weight, dora_quant.QuantizedWeight)
        if plain is None or not (quantized or type(weight) in (torch.Tensor, nn.Parameter)):
            return None  # hooks on the branch (ZeRO-3), wrapped weights (HQQ, torchao): the composition
        weight_a, weight_b = plain
        magnitude = _own_param(self, "weight")
        if not LinearGates(result, magnitude, (x, weight_a, weight_b), True, self.training).one_node:
            return None
        if result.numel() * result.element_size() > dora_settings.current().fwd_chunk_mb * dora_settings.MB:
            return None  # W·x whole would pass PEFT_DORA_FWD_CHUNK_MB: the composition in output slices
        autocast = torch.is_autocast_enabled(x.device.type)
        branch_dtype = torch.get_autocast_dtype(x.device.type) if autocast else x.dtype
        dense = None if quantized else _oriented(weight, self.fan_in_fan_out)
        half = dense is not None and _half_base(dense, keep)
        if result.dtype != branch_dtype and not (
            wider_result(result.dtype, branch_dtype) or (half and wider_branch(result.dtype, x.dtype))
        ):  # fmt: skip
            return None  # e.g. fp32 adapters beside a bf16 result without autocast: nothing computed in vain
        if dense is not None and dense.dtype != x.dtype and not autocast and not half:
            return None  # W·x would need a cast of W (the composition's path makes it)
        weight_norm = self._forward_norm(weight, weight_a, weight_b, scaling, adapter_name)
        if not norm_operand(weight_norm, magnitude):
            return None
        dropped = x
        if autocast and not quantized and x.dtype != branch_dtype:
            # autocast would cast the dropped-out x to its dtype for each of the two matmuls, and each cast's backward
            # widen its gradient: once here, the same forward bits (the two matmuls' input gradients then sum in the
            # compute dtype, as for any tensor two matmuls read)
            x = x.to(branch_dtype)
        a = F.linear(x, weight_a)
        stride = branch_node_stride(a, result, weight_b, magnitude, None)
        if stride is None:
            return None
        # bias-free (the bias is in result once); a quantized W dequantized for the matmul and again in the backward,
        # never kept between them (dora_quant.base_output)
        base = dora_quant.base_output(weight, x) if quantized else _dropped_base(x, dense, keep if half else None)
        if base.shape != result.shape or base.dtype not in KERNEL_DTYPES or not base.is_contiguous():
            return None
        record(self, TIER_FUSED_BACKWARD)
        eps = eps_for(weight.dtype)
        consts = (weight_norm, None, float(scaling), eps, stride, None)
        if stride == result.shape[-1]:
            bias = _own_param(base_layer, "bias") if type(base_layer) is nn.Linear else base_layer.bias
            self._keep_train_record(dropped, result, base_layer, weight, weight_a, weight_b, magnitude, bias, scaling,
                                    eps, exact=True)  # fmt: skip
        return dora_fused.linear_node(result, a, weight_b, magnitude, base, consts)

    def _traced_output(self, x, result, weight, weight_a, weight_b, magnitude, bias, scaling, adapter_name):
        """The adapted output as torch.compile traces it, for a plain LoRA branch: ``g = m / norm`` scales B's rows
        rather than the ``[tokens, d_out]`` LoRA output, ``y = result + (g - 1)·(result - bias) + a·(s·g·B)ᵀ`` with
        ``a = x·Aᵀ``, summed in fp32 and rounded once. Inductor emits one pointwise kernel for the output, as for
        LoRA's ``result + s·lora``; in the backward the LoRA output's gradient is ``d_y`` itself, and DoRA adds
        ``d_result = g·d_y`` with the column sum for ``d_g`` (one kernel) and ``[d_out, r]``-sized work. Composing
        the ``[tokens, d_out]`` LoRA output instead wrote and read two more activation-sized tensors per module in
        the backward. Without autograd there is no backward: ``g`` then scales the LoRA output's columns inside that
        same pointwise kernel, ``y = result + (g - 1)·(result - bias) + s·g·(a·Bᵀ)`` (the eager tiers' order), and
        B goes to the matmul as LoRA's does, so the forward has LoRA's kernels (``s·g·B`` was one more launch per
        module, host time in a short compiled eval forward)."""
        weight_norm = self._forward_norm(weight, weight_a, weight_b, scaling, adapter_name)
        g = magnitude_scale(magnitude, weight_norm, weight.dtype)
        a = F.linear(x, weight_a)
        acc = torch.promote_types(g.dtype, torch.float32)
        if torch.is_grad_enabled():
            lora = F.linear(a, ((g * float(scaling)).unsqueeze(-1) * weight_b).to(a.dtype))
            delta = lora.to(acc)
        else:
            lora = F.linear(a, weight_b)
            delta = (g * float(scaling)) * lora.to(acc)
        base = result if bias is None else result - bias
        out = result.to(acc) + (g - 1) * base.to(acc) + delta
        return out.to(torch.promote_types(result.dtype, lora.dtype))

    def _compose(self, lora, base, g, scaling, gates: Optional[LinearGates] = None) -> torch.Tensor:
        """The DoRA delta ``(g - 1)·base + g·(s·lora)`` on the tier ``dora_dispatch.compose_tier`` picks; ``lora``
        must be a fresh tensor (the fused forward and the eager tier without autograd write into it)."""
        tier = compose_tier(lora, base, g, gates)
        record(self, tier)
        if tier == TIER_FUSED_BACKWARD:
            return dora_fused.fused_dora_compose_autograd(lora, base, g, scaling)
        if tier == TIER_FUSED_FORWARD:
            return dora_fused.fused_dora_compose(lora, base, g, scaling, inplace=True)
        # in place only when autograd records nothing, so no saved tensor is overwritten
        grad = gates.grad if gates is not None else records_grad(lora, base, g)
        return dora_fused.compose_torch(lora, base, g, scaling, inplace=not grad)

    def _dropped_delta(self, x, weight, lora_result, g, scaling, keep=None) -> torch.Tensor:
        """The DoRA delta for the dropped-out ``x`` (LoRA dropout, upstream's semantics): ``base = W·x`` dequantized
        for the matmul on a bitsandbytes base (no dense W kept from the forward to the backward), else in output
        slices (:meth:`_base_chunks`), composed with ``lora_result``."""
        if isinstance(weight, dora_quant.QuantizedWeight):
            return self._compose(lora_result, dora_quant.base_output(weight, x), g, scaling)
        return self._base_chunks(x, weight, lora_result, g, scaling, keep)

    def _base_chunks(self, x, weight, lora_result, g, scaling, keep=None) -> torch.Tensor:
        """Dropout path: ``base = W·dropout(x)`` computed and composed in output slices of PEFT_DORA_FWD_CHUNK_MB."""
        weight = _oriented(weight, self.fan_in_fan_out)
        if not _half_base(weight, keep):
            keep = None
        if keep is None and weight.dtype != x.dtype and not torch.is_autocast_enabled(x.device.type):
            # autocast runs the matmul in its own dtype: a cast here would copy W to x's (fp32) dtype every forward
            weight = weight.to(x.dtype)
        d_out = weight.shape[0]
        row_bytes = max(1, lora_result.numel() // max(d_out, 1)) * lora_result.element_size()
        step = max(1, (dora_settings.current().fwd_chunk_mb * dora_settings.MB) // row_bytes)
        if step >= d_out:
            return self._compose(lora_result, _dropped_base(x, weight, keep), g, scaling)
        masked = None if keep is None else dora_fused.undo_dropout_scale(x, keep, weight.dtype)  # once for all slices
        parts = [
            self._compose(
                lora_result[..., c : c + step],
                _dropped_base(x, weight[c : c + step], keep, masked),
                g[c : c + step],
                scaling,
            )  # fmt: skip
            for c in range(0, d_out, step)
        ]
        return torch.cat(parts, dim=-1)

    # The norm and what comes of it, by the first of ``dora_cache.LayerReuse``'s sources that holds it.

    def _forward_norm(self, weight, lora_A, lora_B, scaling, adapter_name, batched: bool = False) -> torch.Tensor:
        """The norm for this forward: under torch.compile one opaque op (``compiled_weight_norm``) where
        ``ENABLE_DORA_CACHING`` is off; else the kept norm while W, A, B and s provably hold, else a fresh one."""
        if torch.compiler.is_compiling() and not ENABLE_DORA_CACHING:
            operands = self._norm_operands(weight, lora_A, lora_B)
            if operands is not None:
                return compiled_weight_norm(self, *operands, scaling)
        if ENABLE_DORA_CACHING and not self.training and adapter_name is not None:
            # DoraCaching: the first cached eval forward's norm, until train() (upstream's semantics), under
            # ``cache_decorator``'s key for get_weight_norm
            key = f"weight-norm-{adapter_name}"
            cached = self._cache_get(key, None)
            if cached is not None:
                return cached
            norm = self._forward_norm_kept(weight, lora_A, lora_B, scaling, adapter_name)
            self._cache_store(key, norm)  # also where a kept norm answered, not computed
            return norm
        return self._forward_norm_kept(weight, lora_A, lora_B, scaling, adapter_name, batched)

    def _forward_norm_kept(self, weight, lora_A, lora_B, scaling, adapter_name, batched=False) -> torch.Tensor:
        """:meth:`_forward_norm` outside torch.compile and ``DoraCaching``'s cache: the kept norm while W, A, B and s
        provably hold (sharded under FSDP2), else a fresh one (``batched``: the training node's forward, whose norm
        may come from the device's batch, ``dora_batch``)."""
        if type(self) is DoraLinearLayer and not (self.fan_in_fan_out or ENABLE_DORA_CACHING):
            record = self._reuse.record
            if record is not None and self.training and not capturing(()):
                # the training norm's record (``dora_norm.eager_record``, ``eager_quant_record``): one graph replay,
                # or the recompute's reuse, after a few attribute reads
                frozen = type(weight) is dora_quant.QuantizedWeight or not weight.requires_grad
                norm = record.answer(weight, lora_A, lora_B, float(scaling), 1, frozen, eager=True)
                if norm is not None:
                    return norm
            shards = self._norm_shards(weight, lora_A, lora_B)
            if shards is not None:
                return self._sharded_norm(weight, lora_A, lora_B, scaling, adapter_name, shards)
        sources, extra = (*_weight_sources(weight), source(lora_A), source(lora_B)), (float(scaling),)
        shards, partitioned = dora_dist.stand_ins(sources), False
        if shards is None and type(weight) is torch.Tensor:  # not a parameter: FSDP1's views, kept on its shards
            shards = dora_dist.flat_stand_ins((weight, lora_A, lora_B))
        if shards is None:  # DeepSpeed ZeRO-3: kept on the partitions, for the recompute only (see the function)
            shards = dora_dist.partition_stand_ins(sources)
            partitioned = shards is not None
        if shards is not None:  # FSDP2 with a quantized W: A and B kept on their shards, as W already is
            sources, extra = shards[0], (*extra, shards[1])
        mode = reuse_mode(self, sources)
        return memoised(
            self._reuse.norm,
            "recompute" if partitioned and mode else mode,
            "norm",
            sources,
            # the Embedding's and Conv's own _fresh_norm take no ``batched``: only the Linear's training node asks
            lambda: (
                self._fresh_norm(weight, lora_A, lora_B, scaling, adapter_name, batched=True)
                if batched
                else self._fresh_norm(weight, lora_A, lora_B, scaling, adapter_name)
            ),
            extra=(*extra, _weight_versions(weight)),
        )

    def _norm_through_modules(self, base_layer, lora_A, lora_B, scaling, x) -> torch.Tensor:
        """Upstream's norm, for LoRA modules that act on their calls (:func:`_acts_on_calls`): ``lora_B(lora_A(I))``
        run through the modules in ``lora_A``'s dtype (:meth:`get_lora_weight`'s, uncached), so their hooks fire and
        shape the norm as in upstream's DoRA, and ``‖W + s·(lora_B(lora_A(I)))ᵀ‖`` of the dense sum, in fp32 at least;
        computed in every forward, never kept (what a hook does can change between calls)."""
        with torch.no_grad():
            device = lora_A.weight.device if lora_A.weight.device.type != "meta" else x.device  # offloaded: x's
            lora_weight = _lora_weight_through_modules(lora_A, device, lora_B)
            weight = _oriented(dequantize_module_weight(base_layer), self.fan_in_fan_out)
            acc = torch.promote_types(weight.dtype, torch.float32)
            dense = weight.to(acc) + float(scaling) * lora_weight.to(device=weight.device, dtype=acc)
            norm_counts["norm_computed"] += 1
            return torch.linalg.vector_norm(dense, dim=1)

    def _norm_shards(self, weight, lora_A, lora_B) -> Optional[dora_dist.NormShards]:
        """``dora_dist.norm_shards`` of these tensors, kept in ``LayerReuse.shards`` while they hold (the same
        gathered and local objects, the same settings): a forward and its recompute ask for them every time."""
        kept = self._reuse.shards
        if kept is not None and kept.holds(weight, lora_A, lora_B):
            return kept
        shards = self._reuse.shards = dora_dist.norm_shards(weight, lora_A, lora_B)
        return shards

    def _sharded_norm(self, weight, lora_A, lora_B, scaling, adapter_name, shards) -> torch.Tensor:
        """Under FSDP2 (``dora_dist``): the norm kept on the rank's shards of W, A and B, which stand for the gathered
        values (the checkpoint recompute and eval forwards reuse it); where W and B are row-sharded together, this
        rank computes its own rows (``‖W_p‖²`` kept on its shard of a frozen W) and an all-gather assembles them,
        one per unit for all of its DoRA Linears (``dora_dist.UnitNorms``): the first computes the rows of those
        after it, which find their norms waiting (``LayerReuse.batched``)."""
        reuse = self._reuse
        extra = _shard_extra(weight, lora_A, lora_B, scaling, shards)

        def compute() -> torch.Tensor:
            if shards.group is None:  # the whole norm, ``‖W‖²`` kept on the shard as for the rows
                with dora_norm.eager_norms():
                    w_sq = self._shard_w_sq(weight, weight, lora_A, lora_B, shards)
                    return self.get_weight_norm(weight, lora_A, lora_B, scaling, adapter_name=adapter_name, w_sq=w_sq)
            if shards.env.step_norms:  # PEFT_DORA_STEP_NORMS=1: the next ones computed after each optimizer step
                dora_dist.watch_step_norms(self, float(scaling))
            waiting = reuse.batched.get(shards.keys, extra)
            reuse.batched.clear()
            if waiting is not None:
                norm_counts["norm_batched"] += 1
                return waiting
            jobs = [(self, weight, lora_A, lora_B, scaling, shards, extra)]
            if shards.unit is not None:
                jobs += self._unit_followers(weight, lora_A, lora_B, scaling, shards)
            send = self._unit_rows_graphed(jobs)
            parts = None if send is not None else [layer._own_rows(*job[:5]) for layer, *job in jobs]
            norms = dora_dist.gather_rows(parts, [job[5] for job in jobs], send=send)
            for (layer, *_, sh, ex), norm in zip(jobs[1:], norms[1:]):
                layer._reuse.batched.put(sh.keys, norm, ex)
            return norms[0]

        return memoised(reuse.norm, reuse_mode(self, (weight, lora_A, lora_B)), "norm", shards.keys, compute, extra)

    def _unit_followers(self, weight, lora_A, lora_B, scaling, shards) -> list:
        """The jobs ``(layer, W, A, B, s, shards, extra)`` of the DoRA Linears after this one in its FSDP2 unit whose
        norms this one computes with its own: gathered on the same group in the same dtype, not kept already (their
        own memo would answer, or their norm is waiting), and called since their last waiting norm (else they are left
        out until they lead again)."""
        jobs, unit = [], dora_dist.unit_norms(shards.unit)
        for layer, w, a, b, s in unit.followers(self, weight, lora_A, lora_B, scaling):
            sh = layer._norm_shards(w, a, b)
            if sh is None or sh.unit is not shards.unit or sh.group is not shards.group or w.dtype != weight.dtype:
                continue
            ex, waiting = _shard_extra(w, a, b, s, sh), layer._reuse.batched
            if waiting.value is not None:
                if waiting.get(sh.keys, ex) is None:  # not called since its last one (or edited since)
                    waiting.clear()
                    unit.drop(layer)
                continue  # else its norm is waiting already
            if reuse_mode(layer, (w, a, b)) == "any" and layer._reuse.norm.get(sh.keys, ex) is not None:
                continue
            jobs.append((layer, w, a, b, s, sh, ex))
        return jobs

    def _unit_rows_graphed(self, jobs: list) -> Optional[torch.Tensor]:
        """This rank's rows of every norm of ``jobs`` (:meth:`_sharded_norm`'s: this layer first, then the followers
        in its unit) as the row all-gather's send buffer (``dora_dist.send_rows``), from one CUDA graph for all of
        them (kept in this layer's ``LayerReuse.unit_rows``), or None where it does not apply: then each layer
        launches its own rows (:meth:`_own_rows`), several launches and their Python per layer and forward.

        A graph reads fixed addresses, and FSDP2 gathers W, A and B anew for every forward, often elsewhere. The rows
        a rank computes are its local shards of W and B, though (the sharded parameters' local tensors: one storage
        for the run, updated in place by the optimizer), which FSDP2's all-gather has just sent in the gathered dtype
        (cast as its mixed precision casts them, here inside the graph); A, needed whole, is copied from the gathered
        tensor into buffers the graph reads (one ``_foreach_copy_`` per unit). The same kernels as the launched rows
        (``dora_norm.eager_norms``), so the same bits. Only in training forwards, which FSDP2 gathers for (an
        edit of a gathered copy between forwards, with ``reshard_after_forward=False``, would not be in the shards),
        for plain local shards of the rows' shapes, where ``dora_norm.norm_graph_applies`` (CUDA, the graph settings,
        no capture or compile). The graph is keyed on the shards, the buffers and each kept ``‖W_p‖²`` (objects,
        addresses, layouts), the scalings, the gathered dtypes, the row ranges and the settings: a change of any
        computes eagerly and captures again at the next forward that repeats it."""
        if not (self.training and torch.is_grad_enabled()):
            return None
        for _, weight, lora_A, lora_B, _, shards, _ in jobs:
            w_local, b_local, rows = shards.keys[0], shards.keys[2], shards.stop - shards.start
            if (
                rows <= 0 or type(weight) is dora_quant.QuantizedWeight
                or type(w_local) is not torch.Tensor or type(b_local) is not torch.Tensor
                or w_local.shape != (rows, weight.shape[1]) or b_local.shape != (rows, lora_B.shape[1])
            ):  # fmt: skip
                return None
        lead = jobs[0][5]
        if not dora_norm.norm_graph_applies(lead.keys[0], jobs[0][2], lead.keys[2]):
            return None
        lora_As = [job[2] for job in jobs]
        kept = self._reuse.unit_rows
        if kept is None or len(kept[1]) != len(lora_As) or any(
            b.shape != a.shape or b.dtype != a.dtype or b.device != a.device for b, a in zip(kept[1], lora_As)
        ):  # fmt: skip
            buffers = [torch.empty_like(a, requires_grad=False) for a in lora_As]
            kept = self._reuse.unit_rows = (NormGraph(), buffers)
        graph, buffers = kept
        with torch.no_grad():
            torch._foreach_copy_(buffers, lora_As)
        with dora_norm.eager_norms():  # as _rows_norm keeps it: the launched rows' kernels, the same bits
            w_sqs = [
                layer._shard_w_sq(w, w[sh.start : sh.stop], a, b[sh.start : sh.stop], sh)
                for layer, w, a, b, _, sh, _ in jobs
            ]
        operands = [(sh, buffer, float(s), w_sq) for (*_, s, sh, _), buffer, w_sq in zip(jobs, buffers, w_sqs)]
        chunks = [job[5].chunk for job in jobs]

        def compute() -> torch.Tensor:
            with dora_norm.eager_norms():
                parts = [
                    factored_row_norm(sh.local_as_gathered(0), buffer, sh.local_as_gathered(2), scale, w_sq=w_sq)
                    for sh, buffer, scale, w_sq in operands
                ]
            return dora_dist.send_rows(parts, chunks)

        tensors = tuple(
            t
            for sh, buffer, _, w_sq in operands
            for t in (sh.keys[0], buffer, sh.keys[2], *(() if w_sq is None else (w_sq,)))
        )
        extra = (
            tuple((sh.gathered[0].dtype, sh.gathered[2].dtype, scale, w_sq is None) for sh, _, scale, w_sq in operands),
            tuple((job[5].start, job[5].stop, job[5].chunk) for job in jobs),
            dora_settings.current(),
            get_dora_norm_threshold_bytes(),
        )
        graph_counts["unit_rows"] += 1
        return graph.run(tensors, extra, compute)

    def _own_rows(self, weight, lora_A, lora_B, scaling, shards) -> torch.Tensor:
        """This rank's rows ``[start, stop)`` of the norm, from the gathered tensors."""
        w_rows, b_rows = weight[shards.start : shards.stop], lora_B[shards.start : shards.stop]
        return self._rows_norm(weight, w_rows, lora_A, b_rows, scaling, shards)

    def _rows_norm(self, weight, w_rows, lora_A, b_rows, scaling, shards) -> torch.Tensor:
        """The norm of this rank's rows ``w_rows`` and ``b_rows`` with the whole ``lora_A`` (``‖W_p‖²`` kept on its
        shard of a frozen ``weight``): the forward's rows (:meth:`_own_rows`) and the step hook's
        (:func:`precompute_step_norms`) alike."""
        if shards.stop == shards.start:
            return torch.empty(0, device=w_rows.device, dtype=torch.promote_types(w_rows.dtype, torch.float32))
        with dora_norm.eager_norms():  # launched every step (the gathered W and A move): fewer launches first
            w_sq = self._shard_w_sq(weight, w_rows, lora_A, b_rows, shards)
            return factored_row_norm(w_rows, lora_A, b_rows, scaling, w_sq=w_sq)

    def _shard_w_sq(self, weight, w_rows, lora_A, b_rows, shards) -> Optional[torch.Tensor]:
        """``‖W‖²`` of ``w_rows`` (this rank's rows of the gathered ``weight``, or all of them) kept on the rank's shard
        of a frozen W with the versions that stand for the gathered values (``NormShards.versions``); None where the
        norm does not take it (``dora_norm.w_sq_reusable``) or W trains."""
        if weight.requires_grad or not dora_norm.w_sq_reusable(w_rows, lora_A, b_rows):
            return None
        extra = (weight.dtype, shards.versions()[:2], w_rows.shape[0])  # the row count: the rank's rows or all
        return memoised(self._reuse.w_sq, "any", "w_sq", shards.keys[:1], lambda: row_sq_norm(w_rows), extra=extra)

    def _norm_operands(self, weight, lora_A, lora_B) -> Optional[tuple]:
        """(W, A, B) as ``factored_row_norm`` takes them, or None where the norm is not a single factored row norm."""
        if isinstance(weight, dora_quant.QuantizedWeight):
            return None  # chunked dequantization, traced as PyTorch and bitsandbytes ops under torch.compile
        return _oriented(weight, self.fan_in_fan_out), lora_A, lora_B

    def _fresh_norm(self, weight, lora_A, lora_B, scaling, adapter_name, batched: bool = False) -> torch.Tensor:
        """The norm computed now (``batched``: by the device's batch where ``dora_batch.applies``). One that is
        neither a training norm's CUDA graph nor the batch's is launched as it is each time it is computed (ZeRO-3's
        and FSDP1's gathered weights in every forward, PEFT_DORA_NORM_GRAPH=0, an eval forward's first): inside
        ``dora_norm.eager_norms()``, where the one-pass kernel's fewer launches take larger ranks."""
        graph_weight = weight.param if isinstance(weight, dora_quant.QuantizedWeight) else weight
        graphed = self.training and dora_norm.norm_graph_applies(graph_weight, lora_A, lora_B)
        in_batch = (
            batched and self.training and type(self) is DoraLinearLayer and dora_batch.applies(weight, lora_A, lora_B)
        )
        if graphed or in_batch:
            return self._norm_now(weight, lora_A, lora_B, scaling, adapter_name, graphed, in_batch)
        with dora_norm.eager_norms():
            return self._norm_now(weight, lora_A, lora_B, scaling, adapter_name, False, False)

    def _norm_now(self, weight, lora_A, lora_B, scaling, adapter_name, graphed: bool, in_batch: bool) -> torch.Tensor:
        """:meth:`_fresh_norm`'s computation, with its decisions (``graphed``: a training norm's CUDA graph,
        ``in_batch``: the device's batch): ``||W||²`` kept where it may be, then the batch, a graph or launches."""
        reuse = self._reuse
        w_sq = None
        if isinstance(weight, dora_quant.QuantizedWeight):
            # ||W||² of the frozen quantized weight, kept while its storage and scales are unchanged
            sources, graph_weight = weight.sources, weight.param
            if dora_settings.current().norm_cache is not False:
                w_sq = memoised(reuse.w_sq, "any", "w_sq", weight.keys, lambda: dora_quant.row_sq_norm(weight),
                                extra=weight.versions)  # fmt: skip
        else:
            sources, graph_weight = (weight,), weight
            w = _oriented(weight, self.fan_in_fan_out)
            if not weight.requires_grad and dora_norm.w_sq_reusable(w, lora_A, lora_B):
                # a frozen W keeps its ||W||²_row across optimizer steps (they skip it): only cross and Gram are new
                w_sq = memoised(reuse.w_sq, "any", "w_sq", sources, lambda: row_sq_norm(w))

        def compute() -> torch.Tensor:
            return self.get_weight_norm(weight, lora_A, lora_B, scaling, adapter_name=adapter_name, w_sq=w_sq)

        def own() -> torch.Tensor:
            if graphed:
                # training forwards recompute the norm of the same tensors, updated in place: one graph launch each (a
                # quantized weight's chunked dequantization and GEMMs too: the graph reads its packed storage and
                # scales)
                norm = reuse.graph.run(*dora_norm.graph_key((*sources, lora_A, lora_B), w_sq, scaling), compute)
                if type(self) is DoraLinearLayer and not self.fan_in_fan_out:
                    made = dora_norm.eager_record if graph_weight is weight else dora_norm.eager_quant_record
                    reuse.record = made(reuse.graph, weight, lora_A, lora_B, scaling, w_sq, norm)
                return norm
            return compute()

        if in_batch:
            # PEFT_DORA_NORM_BATCH=1: the norms of all of the device's members, once per forward pass (a plain weight:
            # the batch keys them as this layer's own graph would)
            tensors, extra = dora_norm.graph_key((weight, lora_A, lora_B), w_sq, scaling)
            members = dora_batch.batch(weight.device)
            return members.norm(self, tensors, extra, _member_norm(float(scaling), adapter_name), own)
        return own()

    def _scale(self, weight_norm: torch.Tensor, weight_dtype: torch.dtype) -> torch.Tensor:
        """g = m / max(w_norm, eps); without autograd (inference, frozen m) kept while m and the norm hold."""
        magnitude = self.weight
        if records_grad(magnitude):
            return magnitude_scale(magnitude, weight_norm, weight_dtype)
        sources, extra = (magnitude, weight_norm), weight_dtype
        shards = dora_dist.stand_ins(sources)
        if shards is not None:  # FSDP2: kept on m's shard (its gathered copy does not show edits)
            sources, extra = shards[0], (weight_dtype, shards[1])
        return memoised(
            self._reuse.scale,
            reuse_mode(self),
            "scale",
            sources,
            lambda: magnitude_scale(magnitude, weight_norm, weight_dtype),
            extra=extra,
        )

    def _factors(self, weight, lora_A, lora_B, magnitude, bias, scaling, adapter_name) -> Optional[tuple]:
        """``(f, g, (1 − g)·bias)`` for the decode and small tiers (f the fp32 ``[1 or 2, d_out]`` stack, then its
        rows as views; no bias row without a bias), kept across forwards while W, A, B, m and the bias hold; None
        while a CUDA graph is captured, whose replays must follow later updates. The caller has checked the gates
        (``LinearGates.reuses_factors``)."""
        sources = (*_weight_sources(weight), source(lora_A), source(lora_B), magnitude) + (
            () if bias is None else (bias,)
        )
        if capturing(sources):
            return None

        def factors() -> torch.Tensor:
            weight_norm = self._forward_norm(weight, lora_A, lora_B, scaling, adapter_name)
            g = magnitude_scale(magnitude, weight_norm, weight.dtype).float()
            return torch.stack((g,) if bias is None else (g, (1 - g) * bias.float()))

        scaling = float(scaling)
        extra = (scaling, _weight_versions(weight))
        shards = dora_dist.stand_ins(sources)
        if shards is not None:  # FSDP2: kept on the shards (gathered copies do not show edits)
            sources, extra = shards[0], (*extra, shards[1])
        reuse = self._reuse
        # the common case first, without `memoised`'s checks of compile and capture (the gates and the caller's)
        f = reused(reuse.factors, "scale", sources, extra)
        if f is None:
            f = memoised(reuse.factors, "any", "scale", sources, factors, extra=extra)
        rows = reuse.rows
        if not rows or rows[0] is not f:  # the rows as views, made once per value of the factors
            rows = reuse.rows = (f, *f.unbind(0))
        return rows

    def _small_output(self, x, result, weight_a, weight_b, factors, scaling) -> Optional[torch.Tensor]:
        """The small tier: ``y = g·result + (1 − g)·bias + a·(s·g·B)ᵀ`` with ``a = x·Aᵀ``, as three PyTorch ops where
        LoRA's ``result + s·B·(A·x)`` takes four: the two matmuls, the second with ``s·g`` folded into B's rows and
        the bias term as its bias (both in the branch's dtype, :meth:`_scaled_b`), then ``g·result`` added into that
        output with the fp32 ``g`` (``addcmul_``, in fp32, rounded once: an error in proportion to ``y``, also where
        ``g·result`` and the LoRA term nearly cancel).

        An fp32 ``result`` beside a half-precision branch (bitsandbytes under autocast, ``dora_dispatch.wider_result``)
        keeps the LoRA output PyTorch's ``result + lora`` would add: ``(result + s·lora)·g + (1 − g)·bias`` in fp32,
        up to ``SMALL_FORWARD_WIDE_NUMEL`` elements (folding ``s·g`` into B rounds the LoRA term differently, which
        moved an LLM.int8 output off upstream's by more than bf16's tolerance in a GPU test); larger ones take the
        one-pass kernel. A half ``result`` beside an fp32 branch (fp32 adapters without autocast,
        ``dora_dispatch.wider_branch``) takes the same three ops in fp32, the output fp32 (PyTorch's promotion), with
        ``g·result`` added in fp32. None where ``result``'s dtype is none of these."""
        branch_dtype = dora_decode.compute_dtype(x)
        if result.dtype != branch_dtype and not wider_branch(result.dtype, branch_dtype):
            if not wider_result(result.dtype, branch_dtype) or result.numel() > dora_dispatch.SMALL_FORWARD_WIDE_NUMEL:
                return None
            bias_row = factors[2] if len(factors) > 2 else None
            return _small_fp32(x, result, weight_a, weight_b, float(scaling), factors[1], bias_row)
        scaled_b, bias_term = self._scaled_b(weight_b, factors, float(scaling), branch_dtype)
        return _small_folded(x, result, weight_a, scaled_b, bias_term, factors[1])

    def _keep_small_record(
        self, x, result, base_layer, weight, weight_a, weight_b, magnitude, bias, scaling, adapter_name
    ) -> None:
        """After a small-tier forward: a :class:`dora_cache.SmallRecord` of it, for :meth:`recorded_small_output`,
        where W (a plain Linear's or a 4-bit layer's), A, B, m and the bias are parameters whose changes their
        version counters show (not sharded or gathered: FSDP, ZeRO-3). The folded path's record holds the kept
        ``s·g·B`` and bias term (none where B was too large to keep them); an fp32 result beside a half branch (the
        QLoRA recipe's fp32 hidden states) is recorded with its ``g`` and bias row. Under ``DoraCaching`` it also
        holds the adapter's cached norm (None if there is none), and answers only while the cache holds that very
        entry."""
        rows = self._reuse.rows
        branch_dtype = dora_decode.compute_dtype(x)
        row_scale = None
        if result.dtype == branch_dtype or wider_branch(result.dtype, branch_dtype):
            kept = self._reuse.scaled_b
            if kept is not None and kept[0] is rows[0] and kept[1] == branch_dtype:
                scaled_b, bias_term = kept[2], kept[3]
            elif weight_b.numel() > dora_dispatch.SCALED_B_KEPT_NUMEL:  # B scaled in each forward: so in the record's
                scaled_b, (row_scale, bias_term) = None, _fold_terms(weight_b, rows, float(scaling), branch_dtype)
            else:
                return
        else:  # _small_output took the fp32 composition
            scaled_b, bias_term = None, (rows[2] if len(rows) > 2 else None)
        tensors = self._record_tensors(base_layer, weight, weight_a, weight_b, magnitude, bias)
        if tensors is None:
            return
        state = _small_state(x, result, scaling)
        cached = self._cache_get(f"weight-norm-{adapter_name}", None) if ENABLE_DORA_CACHING else None
        self._reuse.keep_eval_record(
            SmallRecord(tensors, state, scaled_b, bias_term, rows[1], cached, row_scale=row_scale), ENABLE_DORA_CACHING
        )

    def _keep_train_record(
        self, x, result, base_layer, weight, weight_a, weight_b, magnitude, bias, scaling, eps, exact=False
    ) -> None:
        """After a training forward on the one-node branch whose norm came through the layer's training norm record:
        a :class:`dora_cache.TrainRecord` of it, for :meth:`recorded_training_output`, where W is a plain Linear's
        parameter or a bitsandbytes layer's quantized weight (not FSDP2's sharded one), m and the bias plain
        parameters in PyTorch's own parameter dicts (not DeepSpeed ZeRO-3's, FSDP1's views or FSDP2's gathered ones),
        the output's rows contiguous, and the magnitude's zero test the layer's own (``exact``: the dropout node's
        forward, :meth:`_dropout_node`, whose base input ``W·x`` is its own)."""
        norm = self._reuse.record
        if (
            norm is None or type(self) is not DoraLinearLayer or self.fan_in_fan_out or ENABLE_DORA_CACHING
            or not result.is_contiguous()
        ):  # fmt: skip
            return
        if isinstance(weight, dora_quant.QuantizedWeight):
            if weight.versions or type(norm) is not dora_norm._QuantRecord:
                return  # FSDP2's sharded packed weight: a new gathered copy in every forward
            sources, kind = weight.sources, weight.kind
        elif type(base_layer) is nn.Linear and type(weight) is nn.Parameter:
            sources, kind = (weight,), None
        else:
            return
        tensors = _small_tensors(self, base_layer, (weight_a, weight_b))
        expected = (*sources, weight_a, weight_b, magnitude) + (() if bias is None else (bias,))
        if tensors is None or len(tensors) != len(expected) or any(t is not e for t, e in zip(tensors, expected)):
            return
        if hasattr(magnitude, "ds_id") or dora_dist.magnitude_shard(magnitude) is not None:
            return
        if dora_dist.flat_magnitude(magnitude) is not None:
            return
        device_type = x.device.type
        state = _train_state(x, result, scaling, device_type, exact)
        self._reuse.train = TrainRecord(
            tensors, state, norm, device_type, float(scaling), float(eps), len(sources), kind
        )

    def recorded_training_output(
        self, x, result, lora_A, lora_B, scaling, base_layer, exact=False, keep=None
    ) -> Optional[torch.Tensor]:
        """A training forward (or its checkpoint recompute) from the layer's :class:`dora_cache.TrainRecord`:
        ``a = x·Aᵀ`` and the one-node branch with the norm its norm record answers, after the record's checks and
        the gates' that can change per call (grad mode, compile and capture, hooks on the branch, the rows' layout);
        None where any fails or the norm record does not answer (the full path then decides). The same ops and
        bits as :meth:`adapted_output`'s one-node branch (``exact``: :meth:`_dropout_node`'s, for the dropped-out
        ``x``, with ``W·x`` its base input), without their gates and lookups: host time that a host-bound training
        step waits on in every forward and recompute. A training-mode forward without autograd (a reentrant
        checkpoint's first pass) gets what the full path runs there instead: the one-pass output kernel
        (:meth:`_recorded_no_grad_output`), or for the dropout node the composition :meth:`forward` runs
        (:meth:`_dropped_delta`)."""
        if torch.compiler.is_compiling():
            return None  # first: compiled code reads nothing a forward changes (Dynamo would guard on it)
        grad_mode = torch.is_grad_enabled()
        kept = self._reuse.train
        if kept is None or kept.norm is not self._reuse.record or ENABLE_DORA_CACHING:
            return None
        if not grad_mode and not (exact or kept.no_grad):
            return None  # a layout the one-pass kernel declined
        plain = _plain_branch(lora_A, lora_B)
        if plain is None:
            return None
        weight_a, weight_b = plain
        tensors = _small_tensors(self, base_layer, (weight_a, weight_b))
        if tensors is None or not kept.holds(tensors, _train_state(x, result, scaling, kept.device_type, exact)):
            return None
        if not result.is_contiguous() or x.shape[:-1] != result.shape[:-1] or capturing(()):
            return None
        sources = kept.sources
        weight, magnitude = tensors[0], tensors[sources + 2]
        if grad_mode and not (
            result.requires_grad or magnitude.requires_grad or x.requires_grad or weight_a.requires_grad
            or weight_b.requires_grad
        ):  # fmt: skip
            return None  # autograd records nothing: not the one-node branch's forward
        if exact and result.numel() * result.element_size() > kept.state[0].fwd_chunk_mb * dora_settings.MB:
            return None  # W·x whole would pass PEFT_DORA_FWD_CHUNK_MB: the composition in output slices
        if kept.kind is None:
            norm = kept.norm.answer(weight, weight_a, weight_b, kept.scale, 1, not weight.requires_grad, eager=True)
        else:  # a bitsandbytes base: its wrapper, read afresh (the dequantized shape and dtype its state says now)
            weight = dora_quant.QuantizedWeight(base_layer, weight, kept.kind)
            if weight.versions:
                return None  # FSDP2 has sharded it since
            norm = kept.norm.answer(weight, weight_a, weight_b, kept.scale, 1, True)
        if norm is None or not norm_operand(norm, magnitude):
            return None
        autocast = kept.state[4]
        if exact and grad_mode and kept.kind is None and autocast and x.dtype != autocast:
            x = x.to(autocast)  # as the dropout node casts it: once for both matmuls
        a = F.linear(x, weight_a)
        width = result.shape[-1]
        bias = tensors[sources + 3] if len(tensors) > sources + 3 else None
        if not grad_mode:
            if exact:  # what forward composes there (base_result None), without the node's gates and module calls
                g = self._scale(norm, weight.dtype)
                return result + self._dropped_delta(x, weight, F.linear(a, weight_b), g, kept.scale, keep)
            return self._recorded_no_grad_output(kept, result, F.linear(a, weight_b), magnitude, norm, bias)
        if exact:
            # bias-free (the bias is in result once); a quantized W dequantized for the matmul and again in the
            # backward (dora_quant.base_output)
            if kept.kind is not None:
                base = dora_quant.base_output(weight, x)
            else:
                if not _half_base(weight, keep):
                    keep = None
                if keep is None and weight.dtype != x.dtype and not autocast:
                    return None  # without autocast the dropout node declines a cast of W
                base = _dropped_base(x, weight, keep)
            if not base.is_contiguous():
                return None
            record(self, TIER_FUSED_BACKWARD)
            return dora_fused.linear_node(
                result, a, weight_b, magnitude, base, (norm, None, kept.scale, kept.eps, width, None)
            )
        record(self, TIER_FUSED_BACKWARD)
        consts = (norm, bias, kept.scale, kept.eps, width, self._reuse.zero_free)
        return dora_fused.linear_node(result, a, weight_b, magnitude, None, consts)

    def _recorded_no_grad_output(self, kept, result, lora, magnitude, norm, bias) -> Optional[torch.Tensor]:
        """A training-mode forward without autograd from the layer's training record: the first pass of a reentrant
        checkpoint (``torch.utils.checkpoint(use_reentrant=True)``, what ``prepare_model_for_kbit_training`` and
        transformers' ``gradient_checkpointing_enable()`` run by default), whose recompute in the backward takes the
        training node. The same ops and bits as :meth:`adapted_output`'s path there (``lora = x·Aᵀ·Bᵀ``, the
        one-pass output kernel with the norm, the magnitude's zero test started for the recompute's node), without
        its gates and lookups. None (the full path) where the kernel does not take ``lora``'s layout, after which the
        record no longer tries."""
        strides = output_layout(result, lora, bias, magnitude, norm)
        if strides is None:
            kept.no_grad = False
            return None
        zero_free = self._reuse.zero_free
        if magnitude.requires_grad and magnitude.is_cuda:
            prefetch_zero_test(magnitude, zero_free)
        record(self, TIER_FUSED_FORWARD)
        return dora_fused.run_fused_output(
            result, lora, magnitude, norm, kept.scale, kept.eps, bias, strides, zero_free
        )

    def _record_tensors(self, base_layer, weight, weight_a, weight_b, magnitude, bias) -> Optional[tuple]:
        """The tensors an eval forward's record is keyed on (:func:`_small_tensors`), where they are the very ones
        this forward used and their changes show in their versions and storage (not sharded, gathered or wrapped);
        else None."""
        tensors = _small_tensors(self, base_layer, (weight_a, weight_b))
        expected = (*_weight_sources(weight), weight_a, weight_b, magnitude) + (() if bias is None else (bias,))
        if (
            tensors is None or type(self) is not DoraLinearLayer or len(tensors) != len(expected)
            or _weight_versions(weight) or any(t is not e for t, e in zip(tensors, expected))
            or not identity_tracked(tensors) or dora_dist.stand_ins(tensors) is not None
        ):  # fmt: skip
            return None
        return tensors

    def _keep_one_pass_record(
        self, x, result, lora, base_layer, weight, plain, magnitude, bias, scaling, adapter_name, weight_norm, eps
    ) -> None:
        """After an eval forward on the one-pass output kernel: a :class:`dora_cache.SmallRecord` of it holding its
        own copy of the norm (the memo's may be a graph's buffer that a later replay rewrites), for
        :meth:`_recorded_one_pass`; kept only where the kernel wrote rows of ``result``'s width (both contiguous),
        which is what the recorded forward checks again."""
        d_out = result.shape[-1] if result.dim() else 0
        if not (result.is_contiguous() and lora.is_contiguous()) or lora.shape != result.shape or d_out == 0:
            return
        if capturing(()):
            return  # the norm's copy would live in the capture's private pool, which its replays rewrite
        tensors = self._record_tensors(base_layer, weight, *plain, magnitude, bias)
        if tensors is None:
            return
        state = _small_state(x, result, scaling)
        cached = self._cache_get(f"weight-norm-{adapter_name}", None) if ENABLE_DORA_CACHING else None
        wide = wider_result(result.dtype, lora.dtype)  # its own size limit (beside a wider branch, the small tier's)
        norm = weight_norm.detach().clone()
        record = SmallRecord(tensors, state, None, None, None, cached, norm, float(eps), wide)
        self._reuse.keep_eval_record(record, ENABLE_DORA_CACHING)

    def recorded_small_output(
        self, x, result, lora_A, lora_B, scaling, base_layer, adapter_name="default"
    ) -> Optional[torch.Tensor]:
        """An eval forward from the layer's :class:`dora_cache.SmallRecord`: the small tier's three ops after the
        record's checks and the gates' that can change between forwards (the output's size, autograd, compile and
        capture, hooks on the branch, ``DoraCaching``'s entry); None where any fails (the full path then decides).
        This is what keeps a host-bound eval forward at LoRA's cost: the gates and memo lookups it skips cost more
        host time than its ops."""
        if torch.compiler.is_compiling() or self.training or torch.is_grad_enabled():
            return None
        numel = result.numel()
        if numel <= dora_dispatch.DECODE_MAX_ROWS * result.shape[-1] and dora_settings.current().decode_kernels:
            return self._recorded_decode(x, result, lora_A, lora_B, scaling, base_layer, adapter_name)
        kept, one_pass = self._reuse.eval_records(ENABLE_DORA_CACHING)
        folded = kept is not None and (kept.scaled_b is not None or kept.row_scale is not None)
        if (
            kept is None
            or numel > dora_dispatch.SMALL_FORWARD_NUMEL
            or (not folded and numel > dora_dispatch.SMALL_FORWARD_WIDE_NUMEL)
        ):
            # above the small tier's limit (an fp32 result beside a half branch has its own): the one-pass kernel's
            kept = one_pass
            if kept is None or numel <= (
                dora_dispatch.SMALL_FORWARD_WIDE_NUMEL if kept.wide else dora_dispatch.SMALL_FORWARD_NUMEL
            ):
                return None
        held = self._record_holds(kept, x, result, lora_A, lora_B, scaling, base_layer, adapter_name)
        if held is None:
            return None
        plain, tensors = held
        if kept.norm is not None:
            return self._recorded_one_pass(kept, x, result, plain, tensors, scaling, base_layer)
        if not folded:  # _small_output's fp32 composition (numel within its limit, checked above)
            out = _small_fp32(x, result, *plain, float(scaling), kept.g, kept.bias_term)
        else:  # s·g·B kept, or (a B too large to keep twice) scaled as _scaled_b scales it
            scaled_b = kept.scaled_b
            if scaled_b is None:  # in the branch's dtype: result's, or fp32 beside a half result (wider_branch)
                scaled_b = _scale_b(plain[1], kept.row_scale, dora_decode.compute_dtype(x))
            out = _small_folded(x, result, plain[0], scaled_b, kept.bias_term, kept.g)
        if out is None:
            return None
        record(self, TIER_SMALL_FORWARD)
        norm_counts["scale_reused"] += 1
        return out

    def _record_holds(self, kept, x, result, lora_A, lora_B, scaling, base_layer, adapter_name) -> Optional[tuple]:
        """``(plain, tensors)`` where the eval record ``kept`` answers this forward (``DoraCaching``'s entry is the
        record's, the branch is plain, its tensors and state are the record's, no capture), else None."""
        if ENABLE_DORA_CACHING and self._dora_cache.get(f"weight-norm-{adapter_name}") is not kept.cached:
            return None  # DoraCaching's norm, kept until train() whatever the weights do: the record's, or none
        plain = _plain_branch(lora_A, lora_B)
        tensors = None if plain is None else _small_tensors(self, base_layer, plain)
        if tensors is None or capturing(()) or not kept.holds(tensors, _small_state(x, result, scaling)):
            return None
        return plain, tensors

    def _keep_decode_record(
        self, x, result, base_layer, weight, weight_a, weight_b, magnitude, bias, scaling, adapter_name
    ) -> None:
        """After a decode-tier eval forward: a :class:`dora_cache.SmallRecord` of it with the plan it ran, for
        :meth:`_recorded_decode` (where the tensors are parameters whose changes their versions show, as for the
        small tier's record); one for ``DoraCaching`` on and one for off, as theirs."""
        plan = self._reuse.decode
        if self.training or plan is None:
            return  # read in eval forwards only (train() and eval() forget them)
        tensors = self._record_tensors(base_layer, weight, weight_a, weight_b, magnitude, bias)
        if tensors is None:
            return
        state = _small_state(x, result, scaling)
        cached = self._cache_get(f"weight-norm-{adapter_name}", None) if ENABLE_DORA_CACHING else None
        # the plan's factors as the record's g: one made in inference mode answers only there, as the memo's would
        record = SmallRecord(tensors, state, None, None, plan.factors, cached)
        self._reuse.keep_decode_record((record, plan), ENABLE_DORA_CACHING)

    def _recorded_decode(self, x, result, lora_A, lora_B, scaling, base_layer, adapter_name) -> Optional[torch.Tensor]:
        """A decode step from the layer's decode record: the kept plan's two launches after the record's checks (the
        same objects, versions, layout, settings, scaling, dtypes and autocast; ``DoraCaching``'s entry; no capture)
        and the plan's own key (the rows' layout, device and stream); None (the full path) where any fails. The
        gates and the factors' memo lookup it skips cost more host time than the step's launches."""
        kept = self._reuse.decode_records(ENABLE_DORA_CACHING)
        if kept is None:
            return None
        made, plan = kept
        if plan is not self._reuse.decode:
            return None
        held = self._record_holds(made, x, result, lora_A, lora_B, scaling, base_layer, adapter_name)
        if held is None:
            return None
        (weight_a, weight_b), _ = held
        if weight_a is not plan.weight_a or weight_b is not plan.weight_b:
            return None
        if plan.key != dora_decode.plan_key(x, result):
            return None
        out = plan.run(x, result)
        record(self, TIER_DECODE)
        norm_counts["scale_reused"] += 1
        return out

    def _recorded_one_pass(self, kept, x, result, plain, tensors, scaling, base_layer) -> Optional[torch.Tensor]:
        """The one-pass output kernel's eval forward from its record: ``a = x·Aᵀ``, ``lora = a·Bᵀ`` and the kernel
        with the record's norm, the same ops as :meth:`adapted_output`'s; None (the full path) where the outputs'
        rows are not contiguous rows of ``result``'s width."""
        if not result.is_contiguous():
            return None
        lora = F.linear(F.linear(x, plain[0]), plain[1])
        if lora.shape != result.shape or not lora.is_contiguous() or lora._base is not None:
            return None
        bias = base_layer._parameters.get("bias")  # as _small_tensors read it: the record's last tensor, if any
        magnitude = tensors[-1] if bias is None else tensors[-2]
        d_out = result.shape[-1]
        record(self, TIER_FUSED_FORWARD)
        norm_counts["norm_reused"] += 1
        return dora_fused.run_fused_output(result, lora, magnitude, kept.norm, scaling, kept.eps, bias, (d_out, d_out))

    def _scaled_b(self, weight_b, factors, scaling: float, dtype: torch.dtype) -> tuple:
        """(``s·g·B`` [d_out, r], ``(1 − g)·bias`` or None) in ``dtype``, the products taken in fp32 (or wider). Kept
        in ``LayerReuse.scaled_b`` with the factors they came from (their memo is keyed on B, m, W, the bias and s, so
        a new value of any of them is a new factors tensor) where B has at most
        ``dora_dispatch.SCALED_B_KEPT_NUMEL`` elements; a larger B (large ranks, whose forwards the GPU bounds) is
        scaled in each forward instead of kept twice."""
        kept = self._reuse.scaled_b
        f = factors[0]
        if kept is not None and kept[0] is f and kept[1] == dtype:
            return kept[2], kept[3]
        row_scale, bias_term = _fold_terms(weight_b, factors, scaling, dtype)
        scaled_b = _scale_b(weight_b, row_scale, dtype)
        if weight_b.numel() <= dora_dispatch.SCALED_B_KEPT_NUMEL:
            self._reuse.scaled_b = (f, dtype, scaled_b, bias_term)
        return scaled_b, bias_term

    def _decode(self, x, result, weight_a, weight_b, factors, bias, scaling) -> Optional[torch.Tensor]:
        """The decode tier: ``F.linear(F.linear(x, A), B)`` and the composition in two Triton launches
        (``dora_decode``), kept as a plan while the factors and the rows' layout hold; None where the rows' layout
        does not fit the kernels."""
        key, plan = dora_decode.plan_key(x, result), self._reuse.decode
        if plan is None or plan.factors is not factors[0] or plan.key != key:
            layout = dora_decode.decode_layout(x, result, weight_a, weight_b)
            if layout is None:
                return None
            has_bias = bias is not None
            plan = dora_decode.DecodePlan(key, x, result, weight_a, weight_b, factors[0], scaling, layout, has_bias)
            self._reuse.decode = plan
        out = plan.run(x, result)
        record(self, TIER_DECODE)
        return out

    def __repr__(self) -> str:
        return "lora.dora." + super().__repr__()


def precompute_step_norms(optimizer) -> None:
    """PEFT_DORA_STEP_NORMS=1 (experimental), after each optimizer step: the sharded norms of the DoRA Linears that
    ``optimizer`` steps (their A or B), computed from the ranks' shards the step has just written, for the next
    forward to take (``LayerReuse.batched``, keyed as the forward keys its norm: shards, versions, scaling, gathered
    dtypes; anything changed since and the forward computes its own). Per process group, one all-gather assembles
    the whole A matrices from their row shards and one the norms from every rank's rows, each rank computing its own
    rows as a forward would (``_own_rows``'s operands in the gathered dtypes, the same kernels): in place of one row
    all-gather per FSDP2 unit inside the forward, each a point on the compute stream where the ranks wait for each
    other. Every rank steps the same optimizer and asks the same layers in the same order, so the collectives match."""
    layers = dora_dist.step_layers()
    if not layers or not dora_settings.current().step_norms:
        return
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    groups: dict = {}  # id(group) -> (group, [(layer, shards, scaling)])
    for layer, scaling in layers:
        shards = layer._reuse.shards
        if shards is None or shards.group is None or not shards.current():
            continue
        if id(shards.params[1]) not in stepped and id(shards.params[2]) not in stepped:
            continue
        a_group = dora_dist._row_group(shards.fsdp_params[1])
        if a_group is None or a_group[0] is not shards.group:
            continue
        rank, world = a_group[1], a_group[2]
        start, stop = dora_dist.own_row_range(shards.gathered[1].shape[0], rank, world)
        if shards.keys[1].dim() != 2 or shards.keys[1].shape[0] != stop - start:
            continue
        groups.setdefault(id(shards.group), (shards.group, []))[1].append((layer, shards, scaling))

    with torch.no_grad():
        for group, jobs in groups.values():
            whole_a = dora_dist.gather_whole_rows(
                [sh.local_as_gathered(1) for _, sh, _ in jobs], [sh.gathered[1].shape[0] for _, sh, _ in jobs], group
            )
            parts = [
                layer._rows_norm(sh.gathered[0], sh.local_as_gathered(0), lora_A, sh.local_as_gathered(2), scaling, sh)
                for (layer, sh, scaling), lora_A in zip(jobs, whole_a)
            ]
            norm_counts["step_norms"] += len(jobs)
            for (layer, sh, scaling), norm in zip(jobs, dora_dist.gather_rows(parts, [sh for _, sh, _ in jobs])):
                weight, lora_A, lora_B = sh.gathered
                layer._reuse.batched.put(sh.keys, norm, _shard_extra(weight, lora_A, lora_B, scaling, sh))


dora_cache_step_callbacks.append(precompute_step_norms)


class DoraEmbeddingLayer(DoraLinearLayer):
    """Magnitude vector of one adapter on an Embedding: one entry per embedding dimension (column of the table)."""

    @cache_decorator("weight-norm")
    def get_weight_norm(
        self, weight, lora_A=None, lora_B=None, scaling=None, adapter_name: Optional[str] = None, **kwargs
    ) -> torch.Tensor:
        """Norm of each column of ``weight + scaling·(lora_B·lora_A)ᵀ``, with ``lora_A`` [r, num_embeddings] and
        ``lora_B`` [embedding_dim, r] as stored in ``lora_embedding_A/B``; factored like the Linear case (upstream's
        dense form as the Linear's)."""
        dense = _upstream_norm_args(lora_A, lora_B, scaling, kwargs)
        if dense is not None:
            return self._dense_norm(weight, *dense)
        return factored_row_norm(weight.T, lora_A, lora_B, scaling)

    @cache_decorator("lora-weight")
    def get_lora_weight(self, lora_A, lora_B, adapter_name: Optional[str] = None) -> torch.Tensor:
        """Upstream's dense ``lora_weight`` of the embedding factors as the Embedding layer passes them."""
        return (lora_A @ lora_B).T

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
    def get_weight_norm(
        self, weight, lora_A=None, lora_B=None, scaling=None, adapter_name: Optional[str] = None, **kwargs
    ) -> torch.Tensor:
        """Per-output-channel norm of the adapted conv weight, shaped [1, out_channels, 1, ...] (upstream's dense
        form too: ``get_weight_norm(weight, lora_weight, scaling)``)."""
        dense = _upstream_norm_args(lora_A, lora_B, scaling, kwargs)
        if dense is not None:
            lora_weight, scale = dense
            adapted = weight + scale * lora_weight.reshape(weight.shape)
            return adapted.norm(p=2, dim=tuple(range(1, weight.dim())), keepdim=True).transpose(1, 0)
        norm = factored_conv_norm(weight, lora_A, lora_B, scaling)
        return norm.view((1, -1) + (1,) * (weight.dim() - 2))

    @cache_decorator("lora-weight")
    def get_lora_weight(self, lora_A, lora_B, adapter_name: Optional[str] = None) -> torch.Tensor:
        """Upstream's dense ``lora_weight`` [out_channels, in_channels/groups·kernel] of the LoRA conv modules."""
        r = lora_A.weight.shape[0]
        return torch.mm(lora_B.weight.view([-1, r]), lora_A.weight.view([r, -1]))

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
        return self._compose(lora_B(lora_A(x)), base_result, g, scaling)

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


def _member_norm(scaling: float, adapter_name):
    """``compute(layer, (W, A, B[, ‖W‖²]))`` of a DoRA Linear's norm for ``dora_batch``: holds no tensor itself."""

    def compute(layer, tensors) -> torch.Tensor:
        w_sq = tensors[3] if len(tensors) > 3 else None
        return layer.get_weight_norm(tensors[0], tensors[1], tensors[2], scaling, adapter_name=adapter_name, w_sq=w_sq)

    return compute


def _register_magnitude(module) -> None:
    watch_merges(type(module))
    if not module.lora_magnitude_vector:
        # the first DoRA adapter on this layer: the magnitudes become trainable adapter weights
        module.adapter_layer_names = module.adapter_layer_names[:] + ("lora_magnitude_vector",)


def _merge_factor(module, active_adapter: str, weight_norm: torch.Tensor, view_shape, weight_dtype) -> torch.Tensor:
    """m / norm shaped for the weight; ``weight_dtype`` is the (dequantized) base weight's, which sets eps."""
    magnitude = module.lora_magnitude_vector[active_adapter].weight.reshape(-1)
    return magnitude_scale(magnitude, weight_norm.reshape(-1), weight_dtype).reshape(view_shape)


def _on_device_of_result(forward):
    """Run a variant's ``forward(module, adapter, x, result)`` with ``result``'s CUDA device current.

    A model split over GPUs (``device_map="auto"``, pipeline stages) runs layers on cuda:1 while cuda:0 is current.
    PyTorch's own ops follow their tensors' device; Triton launches, the decode plan's raw stream and CUDA-graph
    capture and replay act on the current device, so the forward switches to the tensors' device where it differs
    (one device query otherwise). Backward passes run on autograd's per-device threads, where it already is current.
    """

    @wraps(forward)
    def run(module, active_adapter: str, x: torch.Tensor, result: torch.Tensor, **kwargs) -> torch.Tensor:
        if torch._C._are_functorch_transforms_active():
            # torch.func (grad, vmap, jacrev...): wrapped tensors without storage, upstream's eager path
            with dora_settings.plain(), device_switch(result) or contextlib.nullcontext():
                return forward(module, active_adapter, x, result, **kwargs)
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
        factor = _merge_factor(module, active_adapter, weight_norm, cls._factor_view(module), base_weight.dtype)
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
        factor = _merge_factor(module, active_adapter, weight_norm, cls._factor_view(module), orig_weight.dtype)
        return (orig_weight.data / factor - delta_weight).to(orig_weight.dtype)


class DoraLinearVariant(_DoraVariantBase):
    # The LoRA Linear's forward leaves casting x to the adapter's dtype to this variant (the overlay's one-line change
    # to upstream's layer.py): see ``forward``.
    casts_own_input = True

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
        dropped = module.training and not isinstance(dropout, nn.Identity)
        source = x  # the layer's input, before any cast
        if dropped or not torch.is_autocast_enabled(x.device.type):
            # upstream's cast of x to the adapter's dtype (fp32 by default). Under autocast without dropout it is
            # skipped: every use of x there is a matmul that autocast casts to its own dtype, and x·(fp32 round trip)
            # is x, so the outputs and gradients are the same bits without two copies of x per forward and two in the
            # backward (ATen ops that a host-bound step waits on). With dropout the cast stays: dropout's random mask
            # follows the tensor's dtype, and must match upstream's.
            x = module._cast_input_dtype(x, lora_A.weight.dtype)
        exact = dropped and dora_settings.current().dropout != "branch"
        keep = None
        if dropped:
            x = dropout(x)  # once: everything below takes the dropped-out input
            if exact and type(dora_layer) is DoraLinearLayer:
                keep = _half_input_keep(source, x, dropout)
        if not dora_layer.training:  # an eval forward the layer has a record of: its three ops, few checks
            out = dora_layer.recorded_small_output(x, result, lora_A, lora_B, scaling, base_layer, active_adapter)
            if out is not None:
                return out
        elif type(dora_layer) is DoraLinearLayer:  # a training forward the layer has a record of
            out = dora_layer.recorded_training_output(x, result, lora_A, lora_B, scaling, base_layer, exact, keep)
            if out is not None:
                return out
        adapted_output, dropout_output = dora_layer.adapted_output, dora_layer.dropout_output
        if dora_dist.fsdp1_unit(dora_layer) or dora_dist.fsdp1_unit(lora_A) or dora_dist.fsdp1_unit(lora_B):
            # FSDP1 units of their own (PEFT's fsdp_auto_wrap_policy): m, A and B are whole only inside their own
            # forwards, so the magnitude module is called (upstream's route), not its methods
            def adapted_output(x, result, **kwargs):
                return result + dora_layer(x, base_result=result, **kwargs)

            def dropout_output(x, result, **kwargs):
                return result + dora_layer(x, base_result=None, **kwargs)

        if not exact:
            # no dropout, or PEFT_DORA_DROPOUT=branch: dropout on the LoRA branch's input only, y = g·(W·x +
            # s·B·A·dropout(x)), which is the no-dropout path with a dropped-out branch input (no second base matmul)
            return adapted_output(
                x, result, lora_A=lora_A, lora_B=lora_B, scaling=scaling, base_layer=base_layer,
                adapter_name=active_adapter,
            )  # fmt: skip
        # upstream's semantics: the magnitude scales the base output of the dropped-out input, so W·dropout(x) is
        # computed too
        return dropout_output(
            x, result, lora_A=lora_A, lora_B=lora_B, scaling=scaling, base_layer=base_layer,
            adapter_name=active_adapter, keep=keep,
        )  # fmt: skip


def _half_input_keep(source: torch.Tensor, dropped: torch.Tensor, dropout: nn.Module) -> Optional[float]:
    """``nn.Dropout``'s keep probability where ``dropped = dropout(x)`` of a bf16 layer input ``source`` cast to fp32
    (PEFT's default fp32 adapters beside a bf16 model, without autocast), on a device where
    :class:`dora_fused.DroppedHalfBase` computes ``W·dropped`` of a bf16 W in bf16 with an fp32 output; else None
    (``W·dropped`` in fp32, as upstream: under autocast, torch.compile, another dropout module)."""
    if source.dtype is not torch.bfloat16 or dropped.dtype is not torch.float32 or type(dropout) is not nn.Dropout:
        return None
    device_type = dropped.device.type
    if device_type not in dora_fused.HALF_BASE_DEVICES or torch.is_autocast_enabled(device_type):
        return None
    if not dora_fused.WIDE_MM:
        return None
    keep = 1.0 - float(dropout.p)
    if not 0.0 < keep < 1.0 or torch.compiler.is_compiling():
        return None
    return keep


def _half_base(weight: torch.Tensor, keep: Optional[float]) -> bool:
    """Whether ``W·x`` of the dropped-out fp32 ``x`` takes :class:`dora_fused.DroppedHalfBase`: ``keep`` given
    (:func:`_half_input_keep`) and W a frozen bf16 matrix (a plain tensor: not a wrapper subclass, whose matmul is
    its own)."""
    if keep is None or type(weight) not in (torch.Tensor, nn.Parameter) or weight.dtype is not torch.bfloat16:
        return False
    return not weight.requires_grad and weight.dim() == 2


def _dropped_base(x: torch.Tensor, weight: torch.Tensor, keep: Optional[float], masked=None) -> torch.Tensor:
    """``W·x`` of the dropped-out ``x``: ``F.linear`` where ``keep`` is None, else from the bf16 ``mask·x``
    (``masked``, made here where not given) where :func:`_half_base` holds."""
    if keep is None:
        return F.linear(x, weight)
    if masked is None:
        masked = dora_fused.undo_dropout_scale(x, keep, weight.dtype)
    return dora_fused.dropped_half_base(x, masked, weight, keep)


def _base_layer(module: nn.Module) -> nn.Module:
    """``module.get_base_layer()``, without its failing attribute probe (an exception inside ``nn.Module.__getattr__``
    per call) where the wrapped layer has no ``base_layer`` of its own: a plain Linear, a bitsandbytes layer."""
    base = module._modules.get("base_layer")
    if type(base) is nn.Linear:
        return base
    if base is not None and "base_layer" not in base._modules and "base_layer" not in base.__dict__:
        if not hasattr(type(base), "base_layer"):
            return base
    return module.get_base_layer()


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
        return result + dora_layer._compose(lora, result, g, module.scaling[active_adapter])


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


# ---------------------------------------------------------------------------------------------------------------
# The base and LoRA modules' own tensors, read past nn.Module's call machinery where nothing else can see the call.
# ---------------------------------------------------------------------------------------------------------------


def _own_param(module: nn.Module, name: str) -> Optional[torch.Tensor]:
    """``module.<name>``, straight from its parameter dict where that is PyTorch's own (``nn.Module.__getattr__``
    costs host time in every forward); through the attribute where a framework stands in: DeepSpeed ZeRO-3 replaces
    the dict with one that gathers a partitioned parameter on access (a bare dict read gives its empty partition),
    FSDP1 (``use_orig_params``) replaces the parameters with plain tensor views for its forward and backward."""
    params = module._parameters
    if type(params) is dict and name in params:
        return params[name]
    return getattr(module, name)


def _forward_weight(base_layer: nn.Module):
    """The base weight for the forward: the parameter itself, a ``dora_quant.QuantizedWeight`` for bitsandbytes
    (read in chunks by the norm), else upstream's dequantization. Plain parameters skip upstream's dequantize probe,
    whose type-name string test Dynamo cannot trace (a graph break per DoRA layer under torch.compile)."""
    if type(base_layer) is nn.Linear:
        weight = _own_param(base_layer, "weight")  # no probe for a quantized weight's `W_q` either
    else:
        weight = getattr(base_layer, "weight", None)
        # an attribute probe that fails costs an exception inside nn.Module.__getattr__, hence not for a plain Linear
        if type(weight) is nn.Parameter and hasattr(base_layer, "W_q"):
            weight = None
    if type(weight) is nn.Parameter:
        return weight
    quantized = dora_quant.quantized_weight(base_layer)
    return quantized if quantized is not None else dequantize_module_weight(base_layer)


def _oriented(weight: torch.Tensor, fan_in_fan_out: bool) -> torch.Tensor:
    """The base weight as ``[d_out, d_in]``: a transposed view where it is stored ``fan_in_fan_out`` (GPT-2's
    ``Conv1D``). Upstream's ``transpose`` wraps that view in a new ``nn.Parameter`` in every call, a leaf that asks for
    a gradient even of a frozen weight, and which torch.compile cannot trace (a graph break per module)."""
    return weight.T if fan_in_fan_out else weight


def _weight_sources(weight) -> tuple:
    """The tensors whose identity and versions stand for the base weight's values in the norm's memos."""
    return weight.keys if isinstance(weight, dora_quant.QuantizedWeight) else (weight,)


def _weight_versions(weight) -> tuple:
    """Version counters that key the base weight's values besides :func:`_weight_sources` (FSDP2's sharded packed
    weight and its gathered copy, ``dora_quant.QuantizedWeight.versions``)."""
    return weight.versions if isinstance(weight, dora_quant.QuantizedWeight) else ()


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


def _upstream_norm_args(lora_A, lora_B, scaling, kwargs: dict) -> Optional[tuple]:
    """``(lora_weight, scaling)`` where ``get_weight_norm`` was called in upstream's form, ``(weight, lora_weight,
    scaling[, adapter_name])`` or with ``lora_weight=`` by name, else None (our factored form: A and B tensors)."""
    unknown = set(kwargs) - {"lora_weight"}
    if unknown:
        raise TypeError(f"get_weight_norm() got unexpected keyword arguments {sorted(unknown)}")
    if "lora_weight" in kwargs:
        return kwargs["lora_weight"], scaling if scaling is not None else lora_A
    if lora_B is not None and not isinstance(lora_B, torch.Tensor):  # upstream's scaling in B's place
        return lora_A, lora_B
    return None


def _lora_weight_through_modules(lora_A: nn.Module, device, lora_B: nn.Module) -> torch.Tensor:
    """``lora_B(lora_A(I))ᵀ`` [d_out, d_in], the identity in ``lora_A``'s dtype on ``device``: upstream's dense LoRA
    weight of a Linear, computed through the modules as upstream computes it (their hooks see the call)."""
    eye = torch.eye(lora_A.weight.shape[1], device=device, dtype=lora_A.weight.dtype)
    return lora_B(lora_A(eye)).T


def _acts_on_calls(lora_A: nn.Module, lora_B: nn.Module) -> bool:
    """Whether the LoRA modules themselves act on their calls: forward hooks or pre-hooks of their own, or a forward
    wrapped on the instance (accelerate's offload hooks). Upstream's DoRA runs ``lora_B(lora_A(I))`` through them for
    the norm, so a hook that changes their outputs changes the norm there; :meth:`DoraLinearLayer._norm_through_modules`
    follows it. Not DeepSpeed ZeRO-3's partitioned parameters, whose hooks only gather them (``dora._own_param``), nor
    global hooks (profilers', debuggers'): the weights give the same norm there."""
    modules = (lora_A, lora_B)
    if not any(m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__ for m in modules):
        return False
    return not any(hasattr(m._parameters.get("weight"), "ds_id") for m in modules)


def _lora_output(lora_A: nn.Module, lora_B: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``lora_B(lora_A(x))``, as two ``F.linear`` calls where both modules are plain Linears: nn.Module's call
    machinery costs about as much host time as the matmul's dispatch, per module and forward."""
    if _plain_linear(lora_A) and _plain_linear(lora_B):
        params_a, params_b = lora_A._parameters, lora_B._parameters
        weight_a, weight_b = params_a.get("weight"), params_b.get("weight")
        if weight_a is not None and weight_b is not None:
            return F.linear(F.linear(x, weight_a, params_a.get("bias")), weight_b, params_b.get("bias"))
    return lora_B(lora_A(x))


def _small_folded(x, result, weight_a, scaled_b, bias_term, g) -> Optional[torch.Tensor]:
    """The small tier's ops (``DoraLinearLayer._small_output``, and its record's): ``F.linear(F.linear(x, A), s·g·B,
    (1 − g)·bias)``, then ``g·result`` added with the fp32 ``g``, rounded once; None where the output's shape is not
    ``result``'s."""
    out = F.linear(F.linear(x, weight_a), scaled_b, bias_term)
    return out.addcmul_(result, g) if out.shape == result.shape else None


def _fold_terms(weight_b, factors, scaling: float, dtype: torch.dtype) -> tuple:
    """What the small tier folds into B's matmul, from the factors ``(f, g[, (1 − g)·bias])`` (``f`` the tensor whose
    rows the others are): the column ``s·g`` [d_out, 1] in fp32 (or B's dtype where wider) and the bias term in
    ``dtype`` (None without a bias)."""
    acc = torch.promote_types(weight_b.dtype, torch.float32)
    return (factors[1].to(acc) * scaling).unsqueeze(1), (factors[2].to(dtype) if len(factors) > 2 else None)


def _scale_b(weight_b, row_scale, dtype: torch.dtype) -> torch.Tensor:
    """``s·g·B`` in ``dtype``: one product in ``row_scale``'s dtype (B's elements widened exactly, as ``B.to(acc)``
    would), rounded once on its store into ``dtype`` (one kernel, no product-sized temporary in the wider dtype)."""
    return torch.mul(weight_b, row_scale, out=torch.empty_like(weight_b, dtype=dtype))


def _small_fp32(x, result, weight_a, weight_b, scaling: float, g, bias_row) -> Optional[torch.Tensor]:
    """The small tier beside a half branch with an fp32 ``result``: ``(result + s·lora)·g (+ (1 − g)·bias)`` in fp32
    from the LoRA output PyTorch's ``result + lora`` would add; None where the LoRA output's shape is not
    ``result``'s."""
    lora = F.linear(F.linear(x, weight_a), weight_b)
    if lora.shape != result.shape:
        return None
    out = torch.add(result, lora, alpha=scaling).mul_(g)
    return out if bias_row is None else out.add_(bias_row)


def _small_tensors(layer: nn.Module, base_layer: nn.Module, plain: tuple) -> Optional[tuple]:
    """(W's sources, A, B, m[, bias]) for a :class:`dora_cache.SmallRecord`: a plain Linear's weight, or a
    bitsandbytes layer's quantized weight and scales (a 4-bit layer's packed weight and block scales, LLM.int8's
    weight and row scales: ``dora_quant.QuantizedWeight.sources``), with the layer's magnitude and the bias as plain
    parameters; None for anything else (a framework's parameter dicts, wrapped weights)."""
    params, own = base_layer._parameters, layer._parameters
    if type(params) is not dict or type(own) is not dict:
        return None  # DeepSpeed ZeRO-3's gathering dict
    weight, bias, magnitude = params.get("weight"), params.get("bias"), own.get("weight")
    if type(magnitude) is not nn.Parameter or not (bias is None or type(bias) is nn.Parameter):
        return None
    kind = type(weight).__name__
    if type(base_layer) is nn.Linear and type(weight) is nn.Parameter:
        sources = (weight,)
    elif kind == "Params4bit" and weight.quant_state is not None:
        sources = dora_quant.four_bit_sources(weight)
    elif kind == "Int8Params":
        sources = (weight, dora_quant.int8_scales(base_layer, weight))
        if sources[1] is None:
            return None
    else:
        return None
    return (*sources, *plain, magnitude) + (() if bias is None else (bias,))


def _train_state(x: torch.Tensor, result: torch.Tensor, scaling, device_type: str, exact: bool) -> tuple:
    """What a :class:`dora_cache.TrainRecord` was made under besides its tensors: the settings (first), the scaling,
    x's and the result's dtypes, autocast's dtype for x's device (False where it is off), the output's width and
    device, and whether it was the dropout node's (``exact``)."""
    autocast = torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type)
    shape = result.shape
    width = shape[-1] if shape else None
    return (dora_settings.current(), float(scaling), x.dtype, result.dtype, autocast, width, result.device, exact)


def _small_state(x: torch.Tensor, result: torch.Tensor, scaling) -> tuple:
    """What a :class:`dora_cache.SmallRecord` was made under besides its tensors: the epoch, the settings,
    ``DoraCaching``, the scaling, x's and the result's dtypes, autocast's dtype for x's device (False where it is
    off)."""
    device_type = x.device.type
    autocast = torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type)
    caching = ENABLE_DORA_CACHING
    return (_epoch[0], dora_settings.current(), caching, float(scaling), x.dtype, result.dtype, autocast)


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
