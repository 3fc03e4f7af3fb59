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
"""Reuse of DoRA norms: the norm depends only on W, A, B and s, which change at optimizer steps and merges, not per
forward. A value is reused only while PyTorch can prove its inputs unchanged (``Memo``, ``memoised``); what a layer
keeps, and which of it wins, is :class:`LayerReuse`; when reuse is allowed at all is ``dora_norm.reuse_mode``
(``PEFT_DORA_NORM_CACHE``)."""

from __future__ import annotations

import collections
import contextlib
import weakref
from functools import wraps
from typing import Optional

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.weak import WeakIdKeyDictionary

from .dora_graph import NormGraph, StorageNormGraph, same_objects, storage_refs


norm_counts: collections.Counter = collections.Counter()
"""DoRA forwards' weight norms and scales, ``norm_computed``/``norm_reused``, ``scale_computed``/``scale_reused``."""

_NO_TORCH_FUNCTION = torch._C.DisableTorchFunctionSubclass
_epoch = [0]  # bumped by every optimizer step and every merge/unmerge: no norm memo survives either
_merge_epoch = [0]  # bumped by merges/unmerges only: what can change a frozen weight behind its version counter


def _bump_epoch(*_args, **_kwargs) -> None:
    _epoch[0] += 1


def _bump_merge_epoch() -> None:
    _merge_epoch[0] += 1
    _bump_epoch()


def invalidate_norm_caches() -> None:
    """Forget every reused DoRA norm, scale and ``||W||²``. Needed only after writing parameters through ``.data``
    (or another path PyTorch's version counters do not see)."""
    _bump_merge_epoch()


def _after_optimizer_step(optimizer=None, *_args, **_kwargs) -> None:
    before = _epoch[0]
    _bump_epoch()
    # the ids of the parameters the stepped optimizer holds: what both zero-test prefetches ask, found once
    stepped = None
    if optimizer is not None and (_zero_watch or _shard_watch):
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if _zero_watch:
        prefetch_zero_tests(stepped, before)
    if _shard_watch and stepped is not None:
        prefetch_shard_zero_tests(stepped, before)
    if optimizer is not None:
        for callback in step_callbacks:
            callback(optimizer)


# What else runs after every optimizer step, with the optimizer, once the epoch has moved on (modules that this one
# cannot import add theirs: ``dora.precompute_step_norms``, PEFT_DORA_STEP_NORMS=1)
step_callbacks: list = []


# Optimizers built on torch.optim (PyTorch's, bitsandbytes', DeepSpeed's) may write parameters through `.data`,
# which PyTorch's version counters do not see; a global step hook catches all of them. They skip parameters without
# a gradient, so a frozen weight's memo (``Memo(frozen=True)``) survives the steps. The same hook starts the zero
# tests of the magnitudes' new values (``prefetch_zero_tests``).
register_optimizer_step_post_hook(_after_optimizer_step)


def watch_merges(cls: type) -> None:
    """Make ``cls.merge``/``cls.unmerge`` bump the epoch: upstream merges write the base weight through ``.data``."""
    if cls.__dict__.get("_dora_merges_watched"):
        return
    for name in ("merge", "unmerge"):
        method = getattr(cls, name)

        @wraps(method)
        def watched(self, *args, _method=method, **kwargs):
            try:
                return _method(self, *args, **kwargs)
            finally:
                _bump_merge_epoch()

        setattr(cls, name, watched)
    cls._dora_merges_watched = True


def identity_tracked(tensors, inference: bool = True) -> bool:
    """True when every change of these tensors' values shows in their version counter or storage.

    Sharded or wrapped parameters (DeepSpeed ZeRO-3, DTensors, torchao's and HQQ's classes) are re-gathered or
    re-materialised behind PyTorch's back (FSDP2's gathered copies are plain parameters: their memos are keyed on
    the ranks' shards instead, ``dora_dist``); bitsandbytes' quantized parameters are plain storage that requantizing or
    merging replaces (a new object or ``.data``), so they are tracked. Inference tensors have no version counter
    (``inference=False`` leaves that test to the caller: Dynamo cannot trace ``is_inference``).
    """
    return all(
        (type(t) in (torch.Tensor, nn.Parameter) or type(t).__name__ in _QUANTIZED_PARAMS)
        and not hasattr(t, "ds_id") and not (inference and t.is_inference())
        for t in tensors
    )  # fmt: skip


_QUANTIZED_PARAMS = ("Params4bit", "Int8Params")  # bitsandbytes' (dora_quant.quantized_kind)


def flat_parameter_of(t: torch.Tensor) -> Optional[torch.Tensor]:
    """The ``FlatParameter`` (an ``nn.Parameter`` FSDP1 marks ``_is_flat_param``) that ``t`` is a view of, else None:
    FSDP1 hands a forward such views of its unsharded flat parameters instead of the parameters."""
    base = t._base
    return base if base is not None and getattr(base, "_is_flat_param", False) else None


def regathered(tensors) -> bool:
    """Whether any of ``tensors`` is a view FSDP1 makes of its unsharded flat parameter (:func:`flat_parameter_of`):
    a new view in every forward, over storage gathered anew, so a norm graph keyed on it never replays: its every
    forward would run the first-sight eager path under the graphed norms' kernel rule (on 2x H200 at r = 128, the
    split path's seven launches, ~0.48 ms of host per norm) instead of the eager norms' one launch."""
    return any(flat_parameter_of(t) is not None for t in tensors)


class Memo:
    """A value computed from some tensors, valid while the very same tensor objects keep their storage, version
    counter, layout and dtype, the extra key (e.g. the scaling) is unchanged, and no optimizer step or merge happened
    since (the epoch; for a ``frozen`` memo, whose tensors take no optimizer steps, no merge). A layer holds its
    memos in a :class:`LayerReuse`, whose copies and pickles start empty. ``pins``: the storages the value was
    computed from, held weakly (:func:`storage_pins`), so that "the same storage" means that storage and not a new
    one at a freed one's address."""

    __slots__ = ("refs", "key", "value", "epoch", "pins", "owner")

    def __init__(self, frozen: bool = False):
        self.epoch = _merge_epoch if frozen else _epoch
        self.owner = None  # a magnitude's zero-test memo: a weak reference to it once its optimizer has stepped it
        self.clear()

    def clear(self) -> None:
        self.refs, self.key, self.value, self.pins = (), None, None, ()

    def _key(self, tensors, extra) -> tuple:
        # without __torch_function__: bitsandbytes' Params4bit has a Python one, which made every attribute read here
        # a Python call (a QDoRA forward's key cost ~4x a plain one's); the values are the same
        with _NO_TORCH_FUNCTION():
            return self.epoch[0], extra, tensor_keys(tensors)

    def get(self, tensors, extra=()) -> Optional[torch.Tensor]:
        if self.value is None or not same_objects(self.refs, tensors):
            return None
        return self.value if self._key(tensors, extra) == self.key else None

    def put(self, tensors, value: torch.Tensor, extra=()) -> torch.Tensor:
        key = self._key(tensors, extra)
        # the pins and references of the last put where they are these storages' and tensors' (the optimizer-step
        # hook puts every watched magnitude's answer anew after each step): the key has the storages already
        pins = self.pins
        if not pins or tuple(pin.cdata for pin in pins) != tuple(k[0] for k in key[2]):
            pins = storage_pins(tensors)
        if not same_objects(self.refs, tensors):
            self.refs = tuple(weakref.ref(t) for t in tensors)
        self.pins, self.key, self.value = pins, key, value
        return value

    def carry(self, epoch: int) -> bool:
        """Keep a value put at optimizer-step epoch ``epoch`` into the current one: for a step that did not write its
        tensors (an optimizer that does not hold them). Nothing for a value of another epoch or a ``frozen`` memo.
        Whether it was carried."""
        if self.epoch is _epoch and self.key is not None and self.key[0] == epoch:
            self.key = (_epoch[0], *self.key[1:])
            return True
        return False


class KeyedMemo:
    """A :class:`Memo` asked about some tensors but keyed on others that stand for their values (an FSDP2-gathered
    magnitude's local shard and versions, ``dora_dist.MagnitudeShard``): ``get``/``put`` ignore the tensors they are
    given. ``shard``: the magnitude's ``MagnitudeShard``, whose zero test the optimizer-step hook starts."""

    __slots__ = ("memo", "keys", "extra", "shard")

    def __init__(self, memo: Memo, keys: tuple, extra, shard=None) -> None:
        self.memo, self.keys, self.extra, self.shard = memo, keys, extra, shard

    def get(self, tensors, extra=()) -> Optional[torch.Tensor]:
        return self.memo.get(self.keys, self.extra)

    def put(self, tensors, value, extra=()):
        return self.memo.put(self.keys, value, self.extra)


class StorageMemo(Memo):
    """A :class:`Memo` that identifies its tensors by their storage instead of the tensor objects: the same live
    storage (held by a weak reference, so no other storage can take its place while the memo holds it), data
    pointer, version counter, layout and dtype. A torch.compile'd graph hands a custom op fresh aliases of the
    parameters (``aot_eager``) or the parameters themselves (Inductor); an alias shares its parameter's storage and
    version counter, so both hit."""

    __slots__ = ()

    def _key(self, tensors, extra) -> tuple:
        return (
            self.epoch[0],
            extra,
            [
                (t.untyped_storage()._cdata, t.data_ptr(), t._version, t.shape, t.stride(), t.dtype, t.device)
                for t in tensors
            ],
        )

    def dead(self) -> bool:
        """Nothing kept, or a storage it was computed from is gone."""
        return self.value is None or any(ref.expired() for ref in self.refs)

    def get(self, tensors, extra=()) -> Optional[torch.Tensor]:
        return None if self.dead() or self._key(tensors, extra) != self.key else self.value

    def put(self, tensors, value: torch.Tensor, extra=()) -> torch.Tensor:
        self.refs = storage_refs(tensors)
        self.key, self.value = self._key(tensors, extra), value
        return value


_storage_memos: dict = {}
_STORAGE_MEMOS_MAX = 1 << 14  # past this many entries, those whose storage is gone are dropped


def storage_memo(what: str, tensors, frozen: bool = False) -> StorageMemo:
    """The :class:`StorageMemo` for ``what`` of these tensors (by storage and offset): one per module's norm, kept
    in one process-wide table, for callers that hold no module (a custom op's implementation)."""
    return _storage_entry(what, tensors, lambda: StorageMemo(frozen))


def storage_graph(tensors) -> StorageNormGraph:
    """The :class:`dora_graph.StorageNormGraph` of the norm of these tensors (by storage and offset), from the same
    process-wide table as :func:`storage_memo`'s."""
    return _storage_entry("norm_graph", tensors, StorageNormGraph)


def _storage_entry(what: str, tensors, make):
    key = (what,) + tuple((t.untyped_storage()._cdata, t.storage_offset()) for t in tensors)
    entry = _storage_memos.get(key)
    if entry is None:
        if len(_storage_memos) >= _STORAGE_MEMOS_MAX:
            for k in [k for k, m in _storage_memos.items() if m.dead()]:
                del _storage_memos[k]
        entry = _storage_memos[key] = make()
    return entry


def source(t: torch.Tensor) -> torch.Tensor:
    """The tensor that owns a view's storage (the parameter behind ``lora_embedding_A.T``), else ``t`` itself."""
    return t if t._base is None else t._base


def memoised(memo: Memo, mode: Optional[str], what: str, sources, compute, extra=()) -> torch.Tensor:
    """``compute()`` unless ``memo`` holds its value for ``sources`` and ``mode`` allows reuse here.

    ``mode``: ``"any"`` reuses across forwards, ``"recompute"`` only inside backward (a gradient-checkpoint recompute
    runs there, after its own forward of the same step: nothing but ``.data`` writes, which autograd's own
    saved-tensor checks cannot see either, can come between), None never. Counted in ``norm_counts`` as ``what``.
    """
    if torch.compiler.is_compiling():
        return compute()  # a traced graph has no storage to identify, and counters would be side effects
    keep = mode is not None and not capturing(sources)
    if keep and (mode == "any" or torch._C._current_graph_task_id() != -1):
        hit = reused(memo, what, sources, extra)
        if hit is not None:
            return hit
    norm_counts[what + "_computed"] += 1
    value = compute()
    if keep and identity_tracked(sources):
        memo.put(sources, value, extra)
    return value


def reused(memo: Memo, what: str, sources, extra=()) -> Optional[torch.Tensor]:
    """``memo``'s value for ``sources`` and ``extra``, counted in ``norm_counts`` as ``what`` reused, or None. Only
    values of identity-tracked sources are ever put. An inference tensor must not reach a forward that autograd
    records: it is reused only in inference mode."""
    hit = memo.get(sources, extra)
    if hit is not None and (not hit.is_inference() or torch.is_inference_mode_enabled()):
        norm_counts[what + "_reused"] += 1
        return hit
    return None


def capturing(sources) -> bool:
    """Whether a CUDA graph is being captured on the current stream. A capture computes afresh: its replays must
    follow later in-place updates of the factors, as eager forwards do. (Asked of CUDA, not of the tensors: a
    quantized parameter's ``is_cuda`` is a Python call through its ``__torch_function__``.)"""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


class SmallRecord:
    """An eval forward on the small tier (``DoraLinearLayer._small_output``: ``s·g·B`` and the bias term kept, or
    the column ``s·g`` and the bias term where B is too large to keep ``s·g·B`` beside it (``row_scale``; B scaled
    in each forward, as the full path does), or the fp32 composition beside a half branch with ``g`` and the bias
    row), kept so that the next ones run its ops after a handful of checks instead of the gates and the memos'
    lookups (which cost more host time than the ops where a forward is host-bound, and more than LoRA's whole
    forward).

    It answers while the very same W, A, B, m (and bias) objects keep their storage, version counter, layout, dtype
    and device, no optimizer step or merge came between (the epoch), and the settings (the ``PEFT_DORA_*``
    snapshot), ``DoraCaching``'s switch, the scaling, x's and the result's dtypes and the autocast state are those it
    was made under; the caller checks the rest of the small tier's gates on every forward (eval, no autograd, the
    output's size, no compile or capture, a plain branch, ``DoraCaching``'s entry). Weak references: a replaced
    parameter is not kept alive.

    The same record serves an eval forward on the one-pass output kernel (``norm`` set: its own copy of the
    forward's fp32 norm, with ``eps`` and whether ``result`` was wider than the branch; ``DoraLinearLayer
    ._recorded_one_pass``), for outputs above the small tier's limit: there it skips the gates, the norm's memo
    lookup and the kernel's layout checks, which a host-bound forward (QLoRA's 1024-token eval, small models at long
    sequences) waits on.
    """

    __slots__ = (
        "refs", "key", "state", "inference", "plain", "scaled_b", "bias_term", "g", "cached", "pins", "norm", "eps",
        "wide", "row_scale",
    )  # fmt: skip

    def __init__(
        self, tensors, state: tuple, scaled_b, bias_term, g, cached=None, norm=None, eps=0.0, wide=False,
        row_scale=None,
    ) -> None:  # fmt: skip
        self.refs = tuple(weakref.ref(t) for t in tensors)
        # a bitsandbytes weight (Params4bit) has a Python __torch_function__: its key is read without it
        self.plain = all(type(t) is nn.Parameter for t in tensors)
        self.key = tensor_keys(tensors, self.plain)
        self.pins = storage_pins(tensors)
        self.state, self.scaled_b, self.bias_term, self.g = state, scaled_b, bias_term, g
        self.cached = cached  # DoraCaching's norm it was made with (held: its identity is what the caller compares)
        self.norm, self.eps, self.wide = norm, eps, wide
        self.row_scale = row_scale  # the column s·g where B is too large to keep s·g·B: scaled in each forward
        # an inference tensor answers only in inference mode (as ``reused``'s do)
        self.inference = any(t is not None and t.is_inference() for t in (g, scaled_b, bias_term, norm, row_scale))

    def holds(self, tensors, state: tuple) -> bool:
        """Whether the record answers for these tensors (the same objects, unchanged) and this state."""
        if state != self.state or not same_objects(self.refs, tensors):
            return False
        if self.inference and not torch.is_inference_mode_enabled():
            return False
        return tensor_keys(tensors, self.plain) == self.key


class TrainRecord:
    """A training forward on the one-node branch (``dora_fused.FusedDoRALinearFunction`` without dropout), kept so
    that the next training forwards and their checkpoint recomputes run its ops (``a = x·Aᵀ``, the norm, the node)
    after a handful of checks instead of the gates, the zero test's and the norm's lookups and the layout checks,
    which on a host-bound training step cost more host time than the ops (``DoraLinearLayer.recorded_training_output``).

    Unlike :class:`SmallRecord` it keys on no version counter: the tensors change at every optimizer step, and the
    norm comes from the layer's training norm record (``dora_norm.eager_record``, or ``eager_quant_record`` on a
    bitsandbytes base; held here as ``norm``), which checks W's (or the packed weight's and scales'), A's and B's
    storages, data pointers, layout, versions and settings itself and replays its graph for new values. This record
    answers while that norm record is the layer's, the very same W (or packed weight and scales), A, B, m (and bias)
    objects are the layer's, m's and the bias's layout (shape, strides, dtype, device, the bias frozen) and the state
    (the settings snapshot, the scaling, x's and the result's dtypes, autocast's dtype, the output's width and device)
    are those it was made under; the caller checks what can change per call (grad mode, compile and capture, hooks on
    the branch, the rows' layout). Weak references: a replaced parameter is not kept alive."""

    __slots__ = ("refs", "layouts", "state", "norm", "device_type", "scale", "eps", "sources", "kind", "no_grad")

    def __init__(
        self, tensors, state: tuple, norm, device_type: str, scale: float, eps: float, sources: int = 1,
        kind: Optional[str] = None,
    ) -> None:  # fmt: skip
        # ``tensors``: W's ``sources`` (the parameter itself, or a bitsandbytes layer's packed weight and scales,
        # ``dora_quant.QuantizedWeight.sources``, of ``kind`` "4bit" or "8bit"), then A, B, m and the bias
        self.sources, self.kind = sources, kind
        self.no_grad = True  # answers training-mode forwards without autograd too (until the kernel declines one)
        self.refs = tuple(weakref.ref(t) for t in tensors)
        self.layouts = train_layouts(tensors, self.sources)
        self.state, self.norm, self.device_type, self.scale, self.eps = state, norm, device_type, scale, eps

    def holds(self, tensors, state: tuple) -> bool:
        """Whether the record answers for these tensors (the same objects, m's and the bias's layout) and state."""
        return (
            state == self.state and same_objects(self.refs, tensors)
            and train_layouts(tensors, self.sources) == self.layouts
        )  # fmt: skip


def train_layouts(tensors, sources: int = 1) -> tuple:
    """The layout of a :class:`TrainRecord`'s magnitude and bias (its tensors after W's ``sources``, A and B, which
    are the norm record's to check): shape, strides, dtype, device and whether it requires grad."""
    return tuple((t.shape, t.stride(), t.dtype, t.device, t.requires_grad) for t in tensors[sources + 2 :])


def tensor_keys(tensors, plain: bool = True) -> list:
    """Each tensor's storage (its ``StorageImpl``), data pointer, version counter, layout, dtype and device: what
    :class:`Memo` and :class:`SmallRecord` compare (``plain``: all of them ``nn.Parameter``, whose reads need not
    switch off ``__torch_function__``; a caller that has switched it off passes True). A key is kept with the
    :func:`storage_pins` of its storages: ``p.data = ...`` gives ``p`` a new storage and keeps its version counter,
    and the allocator may put that storage, and its data, where a freed one was."""
    if not plain:
        with _NO_TORCH_FUNCTION():
            return tensor_keys(tensors)
    return [(t.untyped_storage()._cdata, t.data_ptr(), t._version, t.shape, t.stride(), t.dtype, t.device)
            for t in tensors]  # fmt: skip


def storage_pins(tensors, held: tuple = ()) -> tuple:
    """The storages of ``tensors`` held weakly (``dora_graph.storage_refs``; ``held``: the pins kept so far, reused
    where they are these storages'). A pinned ``StorageImpl`` stays allocated, its data does not: no new storage can
    take its address, so a key's storage entry that compares equal is the very storage."""
    with _NO_TORCH_FUNCTION():
        if held and tuple(pin.cdata for pin in held) == tuple(t.untyped_storage()._cdata for t in tensors):
            return held
        return storage_refs(tensors)


class LayerReuse:
    """Everything one DoRA layer keeps across forwards, and which of it wins. The norm of a forward is, in order:

    1. under torch.compile: ``peft::dora_weight_norm`` (``dora_norm``), which answers calls with the very parameter
       objects from a record per object triple (``dora_norm._OpRecord``), else keeps its values by storage
       (:class:`StorageMemo`) and replays a training norm from a graph keyed the same way (:func:`storage_graph`);
       nothing below is read or written;
    2. ``norm``: the previous norm, where ``dora_norm.reuse_mode`` allows reuse and W, A, B and s provably hold;
    3. the layer's ``_dora_cache`` (upstream's name, which its tests read): ``ENABLE_DORA_CACHING``
       (``peft.helpers.DoraCaching``) in eval mode, per adapter, kept until ``train()`` whatever happens to the
       weights (upstream's semantics);
    4. ``graph``: a training norm replayed as a CUDA graph (``dora_graph``), which reads the tensors' current values;
    5. computed afresh, with ``w_sq``: ``||W||²`` of a frozen W, kept across optimizer steps (a merge ends it).

    Downstream of the norm, each keyed on the tensors it came from, so a new norm ends it: ``scale`` (g = m / norm,
    without autograd), ``factors`` (g and (1 − g)·bias for the decode and small tiers, with ``rows``, their rows as
    views, and ``scaled_b``, ``s·g·B`` and the bias term in the branch's dtype for the small tier, made from those
    factors and kept with them) and ``decode`` (the latest decode step's launches, a ``dora_decode.DecodePlan``).
    Beside them ``zero_free``: whether m has no exact zero (read on the host, so asked once per value of m, or its
    test started ahead: an event and a pinned flag), which lets the training output nodes read ``inner`` back from
    their output.
    ``batched``: under FSDP2, this layer's norm computed ahead by the first DoRA Linear of its unit with its own
    (``dora_dist.UnitNorms``), keyed as ``norm`` is, taken once; ``shards``: the ``dora_dist.NormShards`` its norm is
    keyed on, while they hold (``NormShards.holds``). ``record``: a training norm taken from ``graph``
    (``dora_norm.eager_record``), which answers the next training forwards and their recompute ahead of 2 and 4
    while its objects, layout, versions and settings hold. ``small``: the latest small-tier eval forward
    (:class:`SmallRecord`), which answers the next ones ahead of all of the above while its tensors and state hold;
    ``one_pass``: the same for the latest eval forward on the one-pass output kernel; ``small_cached`` and
    ``one_pass_cached``: the two made under ``DoraCaching`` (:meth:`eval_records`). ``decode_record``: the latest
    decode-tier eval forward, ``(SmallRecord, DecodePlan)``: the next decode steps with the same tensors, state and
    rows' layout run that plan after the record's checks, ahead of all of the above; ``decode_record_cached``: the
    one made under ``DoraCaching`` (:meth:`decode_records`). ``unit_rows``: under FSDP2, where this layer leads its
    unit's row norms, ``(NormGraph, A buffers)``: one CUDA graph for the rows of all of them (``DoraLinearLayer.
    _unit_rows_graphed``). ``train``: the latest training forward on the one-node branch (:class:`TrainRecord`),
    which answers the next training forwards and recomputes ahead of the gates while its objects, layouts, state and
    norm record hold. ``magnitude_shard``: under FSDP2, the magnitude's ``dora_dist.MagnitudeShard`` (what its zero
    test is kept on), while it holds (``MagnitudeShard.holds``).
    ``clear`` forgets all of it; copies and pickles of a layer start empty.
    """

    __slots__ = (
        "norm", "w_sq", "scale", "factors", "rows", "scaled_b", "graph", "decode", "zero_free", "batched", "record",
        "small", "one_pass", "small_cached", "one_pass_cached", "shards", "decode_record", "decode_record_cached",
        "unit_rows", "train", "magnitude_shard",
    )  # fmt: skip

    def __init__(self) -> None:
        self.norm, self.scale, self.factors, self.zero_free, self.batched = Memo(), Memo(), Memo(), Memo(), Memo()
        self.w_sq = Memo(frozen=True)  # a frozen W takes no optimizer steps
        self.graph = NormGraph()
        self.rows: tuple = ()
        self.decode = self.record = self.scaled_b = self.shards = None
        self.small = self.one_pass = self.small_cached = self.one_pass_cached = None
        self.decode_record = self.decode_record_cached = None
        self.unit_rows = self.train = self.magnitude_shard = None

    def eval_records(self, caching: bool) -> tuple:
        """(small, one-pass) eval records kept for ``DoraCaching`` on (``caching``) or off: a pair each, so forwards
        that alternate between the two (a record's state holds the switch) answer from their own records instead of
        replacing the other's in every forward, a norm copy each time."""
        return (self.small_cached, self.one_pass_cached) if caching else (self.small, self.one_pass)

    def decode_records(self, caching: bool) -> Optional[tuple]:
        """The decode record kept for ``DoraCaching`` on (``caching``) or off, as :meth:`eval_records`' pairs."""
        return self.decode_record_cached if caching else self.decode_record

    def keep_decode_record(self, kept: tuple, caching: bool) -> None:
        """Keep ``(record, plan)`` in its place for ``DoraCaching`` on or off."""
        setattr(self, "decode_record_cached" if caching else "decode_record", kept)

    def keep_eval_record(self, record: SmallRecord, caching: bool) -> None:
        """Keep ``record`` (a one-pass record where it holds a norm) in its place for ``DoraCaching`` on or off."""
        name = "one_pass" if record.norm is not None else "small"
        setattr(self, name + "_cached" if caching else name, record)

    def clear(self, graph: bool = True) -> None:
        """Forget every kept value (``graph=False`` keeps the norm graph, which reads current values anyway)."""
        for memo in (self.norm, self.w_sq, self.scale, self.factors, self.zero_free, self.batched):
            memo.clear()
        self.rows, self.decode, self.record, self.scaled_b, self.shards = (), None, None, None, None
        self.small = self.one_pass = self.small_cached = self.one_pass_cached = None
        self.decode_record = self.decode_record_cached = self.train = self.magnitude_shard = None
        if graph:
            self.graph.clear()
            self.unit_rows = None

    def __deepcopy__(self, memo):
        return LayerReuse()

    def __reduce__(self):
        return (LayerReuse, ())


# ---------------------------------------------------------------------------------------------------------------
# The magnitude's zero test: whether a training output node may read ``inner`` back from its output.
# ---------------------------------------------------------------------------------------------------------------

_zero_watch = WeakIdKeyDictionary()  # magnitude -> its layer's ``zero_free`` memo, for prefetch_zero_tests
# the parameter an optimizer steps (FSDP2's sharded magnitude; FSDP1's original or flat parameter) -> {slot: (memo,
# memo keys, (tested, versions, group))} (``dora_dist.MagnitudeShard.watch``), for prefetch_shard_zero_tests
_shard_watch = WeakIdKeyDictionary()

# Devices whose magnitudes the optimizer-step hook tests (prefetch_zero_tests): on CUDA ahead of the forwards that read
# the answer; on a CPU, where nothing runs ahead, one test of all magnitudes per step instead of one per module and
# forward (and the same code path as on a GPU). Others (meta, ...) test in their nodes.
_PREFETCHED = ("cuda", "cpu")


def output_saves_itself(magnitude: torch.Tensor, known: Optional[Memo]) -> bool:
    """Whether a training output node's backward can take ``inner`` from the output itself: ``y - bias = g·inner``
    recovers it wherever g is finite and non-zero, i.e. wherever m is (the test is ``m·(1/m)`` finite, which also
    sends an m whose reciprocal overflows to the safe side).

    Saving y instead of a separate ``inner`` buffer costs nothing where the next op saves y anyway (the MLP's gate
    and up projections feed SiLU and a product, attention's value projection feeds SDPA) and the same memory
    elsewhere. A magnitude with a zero keeps the ``inner`` buffer. The test reads a GPU value on the host, so a DoRA
    layer passes its ``known`` memo (``LayerReuse.zero_free``): the test runs once per value of m (every micro-step
    and checkpoint recompute reuses the answer), and it is started ahead, where the answer is waited for only if it
    has not arrived (an event): after each optimizer step for every magnitude seen here (``prefetch_zero_tests``),
    and in the no-grad first pass of a reentrant checkpoint (``prefetch_zero_test``). Only a magnitude that changed
    outside both (the first step, an in-place edit) makes the host wait. Without a memo it runs every call. During
    CUDA-graph capture, where a sync is not allowed, the buffer is kept.
    """
    if magnitude.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    hit = None if known is None else known.get((magnitude,))
    if isinstance(hit, bool):
        return hit
    if hit is not None:  # (event, pinned host flag "has a zero") from a started test
        event, has_zero = hit
        event.synchronize()  # a no-op where the copy is done
        no_zero = not bool(has_zero)
    else:
        no_zero = bool(_has_zero(magnitude).logical_not_())
    if known is not None:
        known.put((magnitude,), no_zero)
        if type(known) is Memo and type(magnitude) is nn.Parameter and magnitude.device.type in _PREFETCHED:
            # not DeepSpeed's partitioned parameters (ds_id), nor FSDP2's gathered ones (a KeyedMemo, below): the
            # step hook would read a gathered copy whose shard the step has just changed
            if not hasattr(magnitude, "ds_id"):
                _zero_watch[magnitude] = known
        elif isinstance(known, KeyedMemo) and known.shard is not None:
            shard = known.shard
            slots = _shard_watch.get(shard.param)
            if slots is None:
                slots = _shard_watch[shard.param] = {}
            slots[shard.slot] = (known.memo, shard.keys, shard.watch())
    return no_zero


def storage_holds(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage still holds all of its elements. FSDP (1 and 2) frees a gathered parameter by
    resizing its storage to nothing while the tensor object lives on; a kept reference must not read it then."""
    needed = (t.storage_offset() + t.numel()) * t.element_size() if t.numel() else 0
    return t.untyped_storage().nbytes() >= needed


def _has_zero(*magnitudes: torch.Tensor) -> torch.Tensor:
    """A bool scalar on the magnitudes' device: some entry is zero, infinite, NaN or so small that its reciprocal
    overflows (``m·(1/m)`` is not finite), where ``inner`` cannot be read back from ``g·inner``."""
    with torch.no_grad():  # a Linear's magnitudes are 1-D already: no detach or reshape per magnitude
        m = (
            torch.cat([t if t.dim() == 1 else t.reshape(-1) for t in magnitudes])
            if len(magnitudes) > 1
            else magnitudes[0]
        )
        return torch.isfinite(m * m.reciprocal()).logical_not_().any()


def _start(has_zero: torch.Tensor):
    """(event, pinned flag): ``has_zero`` copied to the host without waiting, behind an event (on a CPU, where
    nothing runs ahead, the answer itself)."""
    if not has_zero.is_cuda:
        return not bool(has_zero)
    flag = torch.empty((), dtype=torch.bool, pin_memory=True)
    flag.copy_(has_zero, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return event, flag


def prefetch_zero_test(magnitude: torch.Tensor, known: Memo) -> None:
    """Start :func:`output_saves_itself`'s test for this value of m without waiting (the training node reads it
    later: a reentrant checkpoint's recompute runs in the backward, long after). Nothing to do where the answer or a
    started test is kept for this value of m."""
    if known.get((magnitude,)) is not None or torch.cuda.is_current_stream_capturing():
        return
    known.put((magnitude,), _start(_has_zero(magnitude)))


def prefetch_zero_tests(stepped: Optional[set] = None, before: Optional[int] = None) -> None:
    """Start the zero test of every magnitude a training node has asked about, after an optimizer step changed
    them (``stepped``: the ids of the parameters that optimizer holds; None: test them all): one test per device for
    all of them (a zero anywhere sends every node of that device to the saved buffer until the next step), so the
    next forwards find the answer instead of waiting for the GPU, once per module and step, under non-reentrant
    checkpointing or none.

    Every optimizer step ends every memo (the epoch), also the step of an optimizer that never saw these
    magnitudes. A magnitude that an optimizer holds and has stepped before is written by that one: another
    optimizer's step keeps its answer (``before``: the epoch that step ended; ``Memo.carry``) instead of testing it
    again. Two adapters trained in turn (``set_adapter`` freezes the inactive one, each with its own optimizer, as
    the grid's paired steps run a DoRA adapter and its LoRA twin) would otherwise find their answers gone after the
    other adapter's step and wait for the GPU once per module in their next forward, or have the other's step test
    them all again. Any other magnitude is tested again after every step: one no optimizer has stepped yet, or one
    that none holds, as under DeepSpeed ZeRO-1/2, whose optimizer steps fp32 copies and writes the magnitudes
    afterwards.

    CPU magnitudes are tested here too, synchronously (nothing runs ahead there): one test per step for all of them
    instead of one per module in the next forwards."""
    by_device: dict = {}
    for magnitude, known in list(_zero_watch.items()):
        if stepped is not None:
            owner = known.owner
            if id(magnitude) in stepped:
                if owner is None or owner() is not magnitude:
                    known.owner = weakref.ref(magnitude)
            elif before is not None and owner is not None and owner() is magnitude and known.carry(before):
                continue  # another optimizer writes it, and has not stepped since its answer
        if not storage_holds(magnitude):
            # FSDP's gathered parameter between its layer's passes: the storage is freed (resized to nothing) and
            # reading it is an illegal memory access; the next gather writes new values anyway (a new version)
            del _zero_watch[magnitude]
        elif magnitude.device.type in _PREFETCHED:
            by_device.setdefault(magnitude.device, []).append((magnitude, known))
    for device, watched in by_device.items():
        cuda = device.type == "cuda"
        with torch.cuda.device(device) if cuda else contextlib.nullcontext():
            if cuda and torch.cuda.is_current_stream_capturing():
                continue
            started = _start(_has_zero(*(m for m, _ in watched)))  # on a CPU, the answer itself
        for magnitude, known in watched:
            known.put((magnitude,), started)


def prefetch_shard_zero_tests(stepped: set, before: Optional[int] = None) -> None:
    """Start the zero test of every sharded magnitude an optimizer has just stepped (FSDP2's, FSDP1's; ``stepped``: the
    ids of the parameters that optimizer holds), keyed as the next forward asks (``KeyedMemo``: FSDP2's local shard
    with the sharded parameter's new version and the gathered copy's, which FSDP2's next gather keeps; FSDP1's local
    flat shard with the flat and original parameters' versions). Each rank tests its own shards (one test per device
    and group) and one all-reduce (max) gives every rank the answer for the whole magnitudes: the engine steps a
    sharded optimizer on every rank of the group, so each rank reaches this collective, in the same order. A group of
    None (FSDP1's ``NO_SHARD``) holds the whole magnitudes on every rank: no collective. Magnitudes this optimizer
    does not hold keep their answers (it wrote none of them; ``before``: the epoch this step ended, whose answers are
    carried into the new one): without that a second optimizer in the process (a head's, another model's: a LoRA
    twin's in the multi-GPU benchmark's pairs) sent every DoRA module's next forward to test its gathered magnitude
    on the host, one GPU sync per module. That takes an optimizer to write only the parameters it holds, which the
    optimizers over FSDP's sharded parameters do."""
    import torch.distributed as dist

    batches: dict = {}  # (device, group) -> (group, [(memo, keys, tested tensor, versions)])
    for param, slots in list(_shard_watch.items()):
        if id(param) not in stepped:
            if before is not None:
                for memo, _, _ in slots.values():
                    memo.carry(before)
            continue
        for memo, keys, (tested, versions, group) in list(slots.values()):
            local, extra = tested(), versions()
            if local is not None and extra is not None:
                batches.setdefault((local.device, id(group)), (group, []))[1].append((memo, keys, local, extra))
    for group, watched in batches.values():
        has_zero = _has_zero(*(local for _, _, local, _ in watched)).to(torch.float32)
        if group is not None:
            dist.all_reduce(has_zero, op=dist.ReduceOp.MAX, group=group)
        started = _start(has_zero.bool())
        for memo, keys, _, extra in watched:
            memo.put(keys, started, extra)
