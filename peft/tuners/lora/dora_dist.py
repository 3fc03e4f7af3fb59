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
"""DoRA under FSDP2 (``fully_shard``): the sharded factored norm and what stands for a gathered parameter's values.

FSDP2 keeps each parameter as a row shard (a DTensor, ``Shard(0)``) and gathers the whole tensor into the same
``nn.Parameter`` object for each forward and backward of its layer, freeing the storage in between. A gathered
tensor comes back at a new address, often, so a norm keyed on it is never reused, and with the same version counter,
so it would not show an edit of a shard; the rank's own shard is a persistent tensor that only an optimizer step (or
an in-place edit) changes, and the gathered values are a function of the shards of all ranks, which step together.
:func:`norm_shards` gives those shards as the keys of the norm's memos (the checkpoint recompute and eval forwards
reuse the norm, a frozen ``W``'s ``‖W‖²`` is kept) and, where W and B are both row-sharded on the same group, the
rank's rows: each rank computes ``‖W_p + s·B_p·A‖`` of its own rows (``‖W_p‖²`` kept, ``W_p·Aᵀ`` with the gathered
``A``, ``B_p·G``) – 1/N of the norm's work – and all-gathers of ``d_out`` floats assemble the norm
(:func:`gather_rows`): one per FSDP2 unit (a ``fully_shard`` parameter group, usually a decoder layer) and forward,
for all of its DoRA Linears (:class:`UnitNorms`), not one per module. :func:`stand_ins` and :class:`MagnitudeShard`
do the same for the scale, the decode factors and the magnitude's zero test.

FSDP2 publishes no map from a gathered parameter to its shard; the one private read (its per-module state and
``FSDPParam`` objects) is :func:`_index`, and anything it does not find computes the norm as without FSDP2.

DeepSpeed ZeRO-3 gathers a parameter into new storage at every gather: :class:`PartitionZeroTest` tests the
magnitudes' partitions for zeros, once per optimizer step for all of them, and :func:`partition_stand_ins` keys the
norm's memo on W's, A's and B's partitions, so that the checkpoint recompute reuses its forward's norm.

FSDP1 (``FullyShardedDataParallel``) holds a unit's parameters whole only inside that unit's own forward. PEFT's
``fsdp_auto_wrap_policy``, which accelerate and the Trainer apply to a PEFT model, makes every ``lora_A``, ``lora_B``
and magnitude module a unit of its own: outside their forwards their weights are flat shards (``use_orig_params``) or
views of freed storage. :func:`fsdp1_unit` tells such a module, and :func:`lora_output_and_weights` runs the LoRA
branch through the units' forwards and copies A and B as those forwards saw them, for the norm.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from . import dora_cache, dora_settings
from .dora_cache import norm_counts


try:
    from torch.distributed._composable_state import _module_state_mapping
except ImportError:  # a PyTorch without it has no FSDP2 of this layout either
    _module_state_mapping = {}
try:
    from torch.distributed.fsdp import FullyShardedDataParallel as _FSDP1
except ImportError:  # a PyTorch built without distributed support
    _FSDP1 = None


@dataclass(frozen=True)
class NormShards:
    """What a DoRA Linear's norm under FSDP2 is keyed on and, with ``group`` set, which rows this rank computes."""

    keys: tuple  # the rank's local shards of W, A and B: with ``versions()``, they stand for the gathered values
    params: tuple  # the sharded parameters (DTensors) those are the local tensors of
    gathered: tuple  # the gathered W, A and B (an edit of a gathered copy moves its own version only)
    group: Optional[object] = None  # the process group W and B are row-sharded over; None: not row-sharded together
    start: int = 0  # this rank's rows of the norm: [start, stop)
    stop: int = 0
    chunk: int = 0  # rows per rank, the last ranks' padded (FSDP2 shards like torch.chunk, with empty shards)
    unit: Optional[object] = None  # the FSDP2 parameter group holding W, A and B all three (gathered together)
    env: Optional[object] = None  # the PEFT_DORA_* snapshot it was made under (PEFT_DORA_SHARDED_NORM decides rows)
    fsdp_params: tuple = ()  # FSDP2's FSDPParam of W, A and B: what :meth:`holds` asks whether they still hold

    def holds(self, weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor) -> bool:
        """Whether these shards still stand for ``weight``, ``lora_A`` and ``lora_B`` as :func:`norm_shards` would
        find them now: the very gathered objects (FSDP2 gathers into the same ones every time), the same sharded
        parameters under FSDP2's ``FSDPParam`` and the same local shards under them (FSDP2 may swap both, e.g.
        loading a state dict with ``assign``), the same settings. A layer keeps its shards between forwards
        (``LayerReuse.shards``): finding them anew cost more host time than the rest of a recompute's norm."""
        gathered = self.gathered
        if gathered[0] is not weight or gathered[1] is not lora_A or gathered[2] is not lora_B:
            return False
        return self.current()

    def current(self) -> bool:
        """Whether FSDP2 still holds these sharded parameters and local shards, under the same settings (what
        :meth:`holds` asks beside the gathered objects)."""
        if self.env is not dora_settings.current() or not _module_state_mapping:
            return False
        return all(_still_sharded(fp, p, k) for fp, p, k in zip(self.fsdp_params, self.params, self.keys))

    def local_as_gathered(self, i: int) -> torch.Tensor:
        """The rank's local shard of W (0), A (1) or B (2) in its gathered copy's dtype, as FSDP2's mixed precision
        casts it for the all-gather (the shard itself where the dtypes agree): the values of its rows in the gathered
        tensor."""
        local, dtype = self.keys[i], self.gathered[i].dtype
        return local if local.dtype == dtype else local.to(dtype)

    @property
    def d_out(self) -> int:
        """The norm's length: W's rows."""
        return self.gathered[0].shape[0]

    def versions(self) -> tuple:
        """The version counters of the sharded parameters and of the gathered copies. An in-place op on a DTensor
        (``p.mul_()`` under ``no_grad``) reaches its local tensor below the dispatch key that counts versions: only
        the DTensor's own counter moves (writes to the local tensor itself, as FSDP2's state-dict loading does, move
        the local one, part of the memo's key). With ``reshard_after_forward=False`` an edit between eval forwards
        reaches the gathered copy only (FSDP2 gathers it again only after a reshard)."""
        (p0, p1, p2), (g0, g1, g2) = self.params, self.gathered  # W, A, B: no generator, on every forward's path
        return shard_versions(p0, g0) + shard_versions(p1, g1) + shard_versions(p2, g2)


def _still_sharded(fp, param: torch.Tensor, local: torch.Tensor) -> bool:
    """Whether FSDP2's ``FSDPParam`` ``fp`` still holds ``param`` as its sharded parameter with ``local`` as its local
    shard (FSDP2 may swap both, e.g. loading a state dict with ``assign``)."""
    return getattr(fp, "sharded_param", None) is param and getattr(param, "_local_tensor", None) is local


def shard_versions(param: torch.Tensor, gathered: torch.Tensor) -> tuple:
    """The version counters that, beside the local shard, key a value computed from a gathered tensor: the sharded
    parameter's (DTensor) and the gathered copy's (see :meth:`NormShards.versions`)."""
    return (param._version, gathered._version)


_MISSING = object()
# FSDP2's objects, each held weakly on both sides: an FSDPParam holds its gathered parameter and its module, and a
# parameter group its FSDPParams, so a value held strongly would keep its own key, and with it the whole model (its
# shards on the GPU included), alive after the model is deleted
_params: WeakIdKeyDictionary = WeakIdKeyDictionary()  # gathered parameter -> weakref to its FSDPParam, or None
_units: WeakIdKeyDictionary = WeakIdKeyDictionary()  # FSDPParam -> weakref to its FSDPParamGroup (gathered together)
_owners: WeakIdKeyDictionary = WeakIdKeyDictionary()  # module -> {parameter name: weakref to its FSDPParam}


def _deref(ref):
    return None if ref is None else ref()


def _index() -> None:
    """Map every gathered parameter FSDP2 has made so far to its ``FSDPParam`` (the private read of this module)."""
    for ref in list(_module_state_mapping.values()):
        state = ref()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            single = getattr(state, "_fsdp_param_group", None)
            groups = [] if single is None else [single]
        for group in groups:
            for fsdp_param in getattr(group, "fsdp_params", ()):
                mine = weakref.ref(fsdp_param)
                _units[fsdp_param] = weakref.ref(group)
                gathered = getattr(fsdp_param, "_unsharded_param", None)
                if gathered is not None:
                    _params[gathered] = mine
                info = getattr(fsdp_param, "_module_info", None)
                if info is not None:
                    _owners.setdefault(info.module, {})[info.param_name] = mine


def fsdp_param(param: torch.Tensor):
    """The ``FSDPParam`` whose gathered tensor ``param`` is, or None (no FSDP2, or a parameter it does not manage)."""
    if not _module_state_mapping:
        return None
    hit = _params.get(param, _MISSING)
    if hit is _MISSING:
        _index()
        hit = _params.get(param, _MISSING)
        if hit is _MISSING:
            hit = _params[param] = None
    return _deref(hit)


def _local_shard(fp) -> Optional[torch.Tensor]:
    local = getattr(getattr(fp, "sharded_param", None), "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else None


def _row_group(fp):
    """(group, rank, world) where ``fp`` is sharded over rows on a one-dimensional shard group, else None."""
    placement = getattr(fp, "fsdp_placement", None)
    info = getattr(fp, "mesh_info", None)
    if placement is None or getattr(placement, "dim", None) != 0 or info is None:
        return None
    group = getattr(info, "shard_process_group", None)
    rank, world = getattr(info, "shard_mesh_rank", None), getattr(info, "shard_mesh_size", None)
    if group is None or rank is None or not world:
        return None
    return group, rank, world


def stand_ins(tensors) -> Optional[tuple]:
    """``(keys, versions)`` for memos of values computed from ``tensors`` where some of them are FSDP2-gathered:
    each gathered tensor replaced by the rank's local shard, with :func:`shard_versions`; None where none is (the
    tensors key the memo themselves). A gathered tensor's own address and version counter do not stand for its
    values (see the module's docstring)."""
    return _stood_in(tensors, _fsdp2_stand_in) if _module_state_mapping else None


def _fsdp2_stand_in(t: torch.Tensor):
    fp = fsdp_param(t)
    local = None if fp is None else _local_shard(fp)
    return None if local is None else (local, shard_versions(fp.sharded_param, t))


def _stood_in(tensors, stand_in) -> Optional[tuple]:
    """``(keys, versions)``: ``tensors`` with each one ``stand_in`` answers for replaced by its key, and their
    versions; None where it answers for none, or where it answers False for one (one that cannot be keyed).
    ``stand_in(t)``: None (``t`` keys itself), False, or ``(key, versions)``."""
    keys, versions, found = [], [], False
    for t in tensors:
        got = stand_in(t)
        if got is None:
            keys.append(t)
            continue
        if got is False:
            return None
        keys.append(got[0])
        versions += got[1]
        found = True
    return (tuple(keys), tuple(versions)) if found else None


def module_shard(module: torch.nn.Module, name: str) -> Optional[tuple]:
    """``(local shard, sharded parameter)`` of the parameter FSDP2 manages as ``module.<name>``, or None. For a
    parameter whose gathered copy is not the object a forward sees: bitsandbytes wraps FSDP2's gathered 4-bit weight
    in a new ``Params4bit`` in every forward (FSDP2 gathers parameter subclasses as plain parameters)."""
    if not _module_state_mapping:
        return None
    owned = _owners.get(module)
    if owned is None:
        _index()
        owned = _owners.setdefault(module, {})
    fp = _deref(owned.get(name))
    local = None if fp is None else _local_shard(fp)
    return None if local is None else (local, fp.sharded_param)


@dataclass(frozen=True)
class MagnitudeShard:
    """An FSDP2-gathered magnitude's shard: what its zero test is kept on, and the group whose ranks step it together
    (the optimizer-step hook tests the ranks' shards and takes the maximum over that group)."""

    local: torch.Tensor  # the rank's local shard
    param: torch.Tensor  # the sharded parameter (DTensor) the optimizer steps
    gathered: torch.Tensor  # the gathered copy a forward sees
    group: object
    fsdp_param: weakref.ref  # FSDP2's FSDPParam of the magnitude, held weakly: what :meth:`holds` asks
    slot = 0  # one magnitude per stepped parameter

    @property
    def keys(self) -> tuple:
        return (self.local,)

    def holds(self, magnitude: torch.Tensor) -> bool:
        """Whether this still is ``magnitude``'s shard as :func:`magnitude_shard` would find it now: the very gathered
        object (FSDP2 gathers into the same one every time), the same sharded parameter under FSDP2's ``FSDPParam``
        and the same local shard under it (as :meth:`NormShards.holds` asks). A layer keeps its magnitude's shard
        between forwards (``LayerReuse.magnitude_shard``): finding it anew took ~8 µs per training forward."""
        if self.gathered is not magnitude or not _module_state_mapping:
            return False
        return _still_sharded(self.fsdp_param(), self.param, self.local)

    def versions(self) -> tuple:
        return shard_versions(self.param, self.gathered)

    def watch(self) -> tuple:
        """``(tested, versions, group)`` for the optimizer-step hook (``dora_cache.prefetch_shard_zero_tests``): the
        tensor to test and the memo's extra key after a step, each None once the gathered copy is gone (held weakly:
        the watch must not keep a deleted model's gathered magnitude alive)."""
        local, param, gathered = self.local, weakref.ref(self.param), weakref.ref(self.gathered)

        def versions():
            p, g = param(), gathered()
            return None if p is None or g is None else shard_versions(p, g)

        return (lambda: local), versions, self.group


def magnitude_shard(magnitude: torch.Tensor) -> Optional[MagnitudeShard]:
    """The shard of an FSDP2-gathered magnitude, or None (no FSDP2, or FSDP2 without a one-dimensional shard group)."""
    if not _module_state_mapping:
        return None
    fp = fsdp_param(magnitude)
    local = None if fp is None else _local_shard(fp)
    group = None if local is None else getattr(getattr(fp, "mesh_info", None), "shard_process_group", None)
    return None if group is None else MagnitudeShard(local, fp.sharded_param, magnitude, group, weakref.ref(fp))


@dataclass(frozen=True)
class FlatMagnitude:
    """An FSDP1-gathered magnitude: a view FSDP1 makes of its unit's unsharded ``FlatParameter`` in every forward
    (and, without ``use_orig_params``, in every recompute), so a memo on the view misses every time and each training
    node would read the GPU once per module and forward. Its zero test is kept instead on the flat parameter's local
    shard (``_local_shard``: one object and storage for the run) with the flat parameter's and the original
    parameter's versions (an in-place edit outside the optimizer moves one of them; an optimizer step ends the memo
    through the epoch), and the optimizer-step hook tests every rank's slice of the new values ahead (the gathered
    dtype: a value that parameter mixed precision flushes to zero counts), one all-reduce (max) over the world giving
    every rank the answer for the whole magnitudes."""

    flat: torch.Tensor  # the FlatParameter
    index: int  # the magnitude's place among the flat parameter's originals
    orig: Optional[torch.Tensor]  # with use_orig_params, the original parameter the optimizer steps; else None
    group: Optional[object]  # the world, or None where every rank holds the whole magnitude (NO_SHARD)
    dtype: torch.dtype  # the gathered dtype

    @property
    def keys(self) -> tuple:
        return (self.flat._local_shard,)

    @property
    def param(self) -> torch.Tensor:
        return self.flat if self.orig is None else self.orig

    @property
    def slot(self) -> int:
        return self.index

    def versions(self) -> tuple:
        return _flat_versions(self.flat, self.index)

    def watch(self) -> tuple:
        """As :meth:`MagnitudeShard.watch`: the rank's slice of the magnitude in the local shard (empty where the
        magnitude lies in other ranks' shards), in the gathered dtype. The flat parameter, held weakly, holds the
        original parameter."""
        flat, index, dtype = weakref.ref(self.flat), self.index, self.dtype

        def tested():
            f = flat()
            if f is None:
                return None
            info = f._shard_param_infos[index]
            local = f._local_shard
            if not info.in_shard:
                return local.new_empty(0, dtype=dtype)
            return local[info.offset_in_shard : info.offset_in_shard + info.numel_in_shard].to(dtype)

        def versions():
            f = flat()
            return None if f is None else _flat_versions(f, index)

        return tested, versions, self.group


def _flat_versions(flat: torch.Tensor, index: int) -> tuple:
    """What keys a value computed from FSDP1's original ``index`` of ``flat`` beside its local shard: the index and
    the flat and original parameters' version counters (the original's is None without ``use_orig_params``)."""
    params = getattr(flat, "_params", None)
    return (index, flat._version, None if params is None else params[index]._version)


_flat_offsets: WeakIdKeyDictionary = WeakIdKeyDictionary()  # FlatParameter -> {offset of an original: its index}


def _flat_index(base: torch.Tensor, view: torch.Tensor) -> Optional[int]:
    """The index among ``base``'s originals (``_param_infos``, ``_params``, ``_numels``) of ``view``, a view FSDP1
    made of its unsharded flat parameter (found by its offset in the flat parameter; padding skipped), or None."""
    offsets = _flat_offsets.get(base)
    if offsets is None:
        offsets, at, index = {}, 0, 0
        numels = getattr(base, "_numels_with_padding", ())
        for numel, padding in zip(numels, getattr(base, "_is_padding_mask", (False,) * len(numels))):
            if not padding:
                offsets.setdefault(at, index)
                index += 1
            at += numel
        _flat_offsets[base] = offsets
    index = offsets.get(view.storage_offset() - base.storage_offset())
    numels = getattr(base, "_numels", ())
    return index if index is not None and index < len(numels) and numels[index] == view.numel() else None


def flat_magnitude(magnitude: torch.Tensor) -> Optional[FlatMagnitude]:
    """The :class:`FlatMagnitude` of a magnitude FSDP1 gathered (a view of a ``FlatParameter``), or None: no FSDP1, an
    offloaded magnitude, or a shard group that is not the world (``HYBRID_SHARD``, a subgroup), whose training nodes
    then test the gathered view as without FSDP1."""
    base = dora_cache.flat_parameter_of(magnitude)
    if base is None:
        return None
    index = _flat_index(base, magnitude)
    if index is None:
        return None
    local, sharded = getattr(base, "_local_shard", None), getattr(base, "_sharded_size", None)
    if local is None or sharded is None or local.device != magnitude.device:
        return None
    unsharded = getattr(base, "_padded_unsharded_size", sharded)
    shards = unsharded.numel() // max(1, sharded.numel())
    if shards == 1:
        group = None
    elif dist.is_initialized() and shards == dist.get_world_size():
        group = dist.group.WORLD
    else:
        return None
    params = getattr(base, "_params", None)
    orig = None if params is None else params[index]
    return FlatMagnitude(base, index, orig, group, magnitude.dtype)


def flat_stand_ins(views) -> Optional[tuple]:
    """``(keys, versions)`` for memos of values computed from ``views`` (W, A and B as a forward sees them) where
    some are FSDP1's views of its gathered flat parameter: each such view replaced by the flat parameter's local shard
    (one object and storage for the run), with its index and the flat and original parameters' versions (an in-place
    edit outside the optimizer moves one of them; an optimizer step ends the memo through the epoch); None where none
    is, or where one is not found (the views then key the memo themselves). FSDP1 gathers into the same storage again
    and hands every forward a new view, so a memo keyed on the views kept a norm for the checkpoint recompute only
    where the allocator happened to hand back the same address."""
    return _stood_in(views, _flat_stand_in)


def _flat_stand_in(t: torch.Tensor):
    base = dora_cache.flat_parameter_of(t)
    if base is None:
        return None
    index, local = _flat_index(base, t), getattr(base, "_local_shard", None)
    return False if index is None or local is None else (local, _flat_versions(base, index))


def norm_shards(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor) -> Optional[NormShards]:
    """The keys and rows of a DoRA Linear's norm where FSDP2 manages ``W`` (stored [d_out, d_in]), ``A`` and ``B``
    (the gathered tensors a forward sees); None where it does not (the norm then runs as without FSDP2)."""
    if not _module_state_mapping:  # no composable state at all: the common case costs one check
        return None
    if any(type(t) is not torch.nn.Parameter for t in (weight, lora_A, lora_B)):
        return None  # FSDP2 with tensor parallelism gathers DTensors: their rows are not this module's to split
    fps = [fsdp_param(t) for t in (weight, lora_A, lora_B)]
    if any(fp is None for fp in fps):
        return None
    params = tuple(getattr(fp, "sharded_param", None) for fp in fps)
    keys = tuple(_local_shard(fp) for fp in fps)
    if any(k is None for k in keys):
        return None
    d_out, env, gathered, fps = weight.shape[0], dora_settings.current(), (weight, lora_A, lora_B), tuple(fps)
    if env.sharded_norm is False:  # PEFT_DORA_SHARDED_NORM=0: each rank the whole norm
        return NormShards(keys, params, gathered, env=env, fsdp_params=fps)
    w_group, b_group = _row_group(fps[0]), _row_group(fps[2])
    if w_group is None or w_group != b_group or weight.dim() != 2 or lora_B.shape[0] != d_out:
        return NormShards(keys, params, gathered, env=env, fsdp_params=fps)
    group, rank, world = w_group
    chunk, (start, stop) = -(-d_out // world), own_row_range(d_out, rank, world)
    if keys[0].shape[0] != stop - start or keys[2].shape[0] != stop - start:  # not torch.chunk's rows: the whole norm
        return NormShards(keys, params, gathered, env=env, fsdp_params=fps)
    unit = _deref(_units.get(fps[0]))
    unit = unit if unit is not None and all(_deref(_units.get(fp)) is unit for fp in fps[1:]) else None
    return NormShards(keys, params, gathered, group, start, stop, chunk, unit, env, fps)


@torch.no_grad()
def send_rows(parts: list, chunks: list) -> torch.Tensor:
    """What this rank sends in :func:`gather_rows`: its rows of each norm (``parts``) one after the other, each padded
    to its ``chunk``."""
    if all(part.shape[0] == chunk for part, chunk in zip(parts, chunks)):
        return torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()
    send, offset = parts[0].new_zeros(sum(chunks)), 0
    for part, chunk in zip(parts, chunks):
        send[offset : offset + part.shape[0]].copy_(part)
        offset += chunk
    return send


def gather_rows(parts: Optional[list], shards: list, send: Optional[torch.Tensor] = None) -> list:
    """The whole [d_out] norms of some DoRA Linears from every rank's rows (``parts``: this rank's, ``stop - start``
    of each, all of one dtype, or ``send``: :func:`send_rows` of them, made already; ``shards``: their
    :class:`NormShards`, all on one group) in one all-gather of ``sum(chunk)`` floats per rank (the last ranks' rows
    padded)."""
    group = shards[0].group
    world = dist.get_world_size(group)
    chunks = [s.chunk for s in shards]
    if send is None:
        send = send_rows(parts, chunks)
    out = send.new_empty(world * send.shape[0])
    dist.all_gather_into_tensor(out, send, group=group)
    norm_counts["norm_gathers"] += 1
    if len(shards) == 1:
        return [out[: shards[0].d_out]]
    # [world, chunk] each: rank p's rows of every norm in row p, made contiguous by one kernel for all of them (as
    # FSDP2 unpacks its own all-gathers), not one copy per norm
    rows = [out.new_empty(world, chunk) for chunk in chunks]
    torch.split_with_sizes_copy(out.view(world, -1), chunks, dim=1, out=rows)
    return [r.view(-1)[: s.d_out] for r, s in zip(rows, shards)]


@torch.no_grad()
def gather_whole_rows(parts: list, rows: list, group) -> list:
    """Whole tensors of ``rows[i]`` rows from every rank's ``torch.chunk`` rows of them (``parts``: this rank's,
    2-D, one dtype; FSDP2's row shards of the A matrices) in one all-gather (each rank's rows padded to the chunk)."""
    world = dist.get_world_size(group)
    chunks = [-(-n // world) for n in rows]
    flat = []
    for part, chunk in zip(parts, chunks):
        padded = part.new_zeros((chunk, part.shape[1]))
        padded[: part.shape[0]].copy_(part)
        flat.append(padded.view(-1))
    send = torch.cat(flat)
    out = send.new_empty(world * send.shape[0])
    dist.all_gather_into_tensor(out, send, group=group)
    norm_counts["step_gathers"] += 1
    out, whole, offset = out.view(world, -1), [], 0
    for part, chunk, n in zip(parts, chunks, rows):
        size = chunk * part.shape[1]
        whole.append(out[:, offset : offset + size].reshape(world * chunk, part.shape[1])[:n])
        offset += size
    return whole


# PEFT_DORA_STEP_NORMS=1: the DoRA Linears whose sharded norms the optimizer-step hook computes ahead, in the order
# their first sharded norm was asked for (the forward order, the same on every rank: the hook's collectives match),
# each with the scaling it last asked with
_step_layers: dict = {}  # id(layer) -> (weakref to the layer, scaling)


def watch_step_norms(layer, scaling: float) -> None:
    """Have the optimizer-step hook compute ``layer``'s sharded norm ahead (``dora.precompute_step_norms``)."""
    key = id(layer)
    entry = _step_layers.get(key)
    if entry is None or entry[1] != scaling:
        ref = entry[0] if entry is not None else weakref.ref(layer, lambda _ref: _step_layers.pop(key, None))
        _step_layers[key] = (ref, scaling)


def step_layers() -> list:
    """``(layer, scaling)`` of the live layers :func:`watch_step_norms` was asked for, in their order."""
    return [(layer, scaling) for ref, scaling in list(_step_layers.values()) if (layer := ref()) is not None]


def own_row_range(n: int, rank: int, world: int) -> tuple:
    """Rows ``[start, stop)`` of ``n`` that ``torch.chunk`` (FSDP2's row sharding) gives to ``rank`` of ``world``."""
    chunk = -(-n // world)
    return min(n, rank * chunk), min(n, (rank + 1) * chunk)


class UnitNorms:
    """The DoRA Linears of one FSDP2 unit (a ``fully_shard`` parameter group) that compute their norms sharded, in
    the order their forwards first asked (the unit's forward order), with the tensors and scaling each asked with.

    The first of them whose norm is not kept (the leader) computes its own rows and those of the ones after it,
    whose tensors are gathered with its own, and one all-gather assembles all of their norms; each of the others
    finds its norm waiting (``LayerReuse.batched``, keyed on its shards, versions and scaling as its own memo: an
    edit in between, or another scaling, and it computes its own). Every rank of the group takes the same
    decisions (the same forwards, shapes, versions and memos), so the collectives match. A layer whose waiting norm
    was never taken (not called since, e.g. another adapter active) is left out until it leads again; it keeps its
    place in the order."""

    __slots__ = ("members",)

    def __init__(self) -> None:
        # id(layer) -> [weakref to the layer, weakrefs to W, A, B, scaling, active]; in first-asked order
        self.members: dict = {}

    def followers(self, layer, weight, lora_A, lora_B, scaling) -> list:
        """Note ``layer``'s call (a known layer keeps its place) and return ``(layer, W, A, B, scaling)`` of the live,
        active members after it."""
        key = id(layer)
        self.members[key] = [weakref.ref(layer), weakref.ref(weight), weakref.ref(lora_A), weakref.ref(lora_B),
                             scaling, True]  # fmt: skip
        out, after = [], False
        for member_key, (layer_ref, *refs, s, active) in list(self.members.items()):
            if member_key == key:
                after = True
                continue
            live = (layer_ref(), *(r() for r in refs))
            if any(t is None for t in live):
                del self.members[member_key]
            elif after and active:
                out.append((*live, s))
        return out

    def drop(self, layer) -> None:
        """Leave ``layer`` out of later batches until it leads again."""
        entry = self.members.get(id(layer))
        if entry is not None:
            entry[-1] = False


_unit_norms: WeakIdKeyDictionary = WeakIdKeyDictionary()  # FSDPParamGroup -> UnitNorms


def unit_norms(unit) -> UnitNorms:
    """The :class:`UnitNorms` of an FSDP2 parameter group (``NormShards.unit``)."""
    norms = _unit_norms.get(unit)
    if norms is None:
        norms = _unit_norms[unit] = UnitNorms()
    return norms


def partition_stand_ins(tensors) -> Optional[tuple]:
    """``(keys, versions)`` for a memo of values computed from ``tensors`` where some are DeepSpeed ZeRO-3 parameters:
    each replaced by its partition (``ds_tensor``, this rank's: one object for the run, where the gathered tensor is
    new storage at every gather), with the parameter's version counter (an in-place edit of the gathered parameter,
    as inside ``GatheredParameters``, moves it; ``.data`` swaps keep it); the memo's key holds the partition's own.
    None where none is. ZeRO-3 writes its updated partitions through ``.data``, which no counter shows, so such a
    memo holds only until the next optimizer step (the epoch: DeepSpeed steps through the torch optimizer it wraps)
    and serves only the checkpoint recompute (``dora_cache.memoised``'s ``"recompute"``), never a later forward."""
    return _stood_in(tensors, _partition_stand_in)


def _partition_stand_in(t: torch.Tensor):
    part = getattr(t, "ds_tensor", None) if hasattr(t, "ds_id") else None
    # the partition's own version is in the memo's key (dora_cache.tensor_keys)
    return (part, (t._version,)) if isinstance(part, torch.Tensor) else None


class PartitionZeroTest:
    """The zero test (``dora_cache.output_saves_itself``) of DeepSpeed ZeRO-3's partitioned magnitudes, as its
    ``known`` memo. A gathered ZeRO-3 magnitude is new storage at every gather, so a memo on it misses and every node
    would read the GPU once per module and step (14 host syncs per step of a 2-layer model). Instead the first node
    that asks after an optimizer step tests the partitions (``ds_tensor``, each rank its own) of every ZeRO-3
    magnitude of its process group asked about so far, and one all-reduce (max) gives every rank the answer for all
    of them: one host read per step, as ``dora_cache.prefetch_zero_tests`` gives plain magnitudes (a zero anywhere
    keeps every node's ``inner`` buffer until the next step). The answer holds until the next optimizer step or merge
    (the epoch: DeepSpeed steps through the torch optimizer it wraps, and writes the new partitions before the next
    forward), until a magnitude not yet tested asks, or until the asking magnitude's partition moves its version (an
    edit through ``GatheredParameters``). Every rank of the group asks in the same order with the same versions, so
    each reaches the collective. Kept per group; ``put`` keeps nothing (the answer is the test's)."""

    _groups: dict = {}  # id(process group) -> [group, members {magnitude: partition version}, epoch, answer]

    @classmethod
    def applies(cls, magnitude: torch.Tensor) -> bool:
        """A ZeRO-3 magnitude whose partition is on its device: not one offloaded to the CPU or NVMe (there the
        partition may be swapped out, and NCCL reduces GPU tensors only), which keeps the per-node test."""
        part = getattr(magnitude, "ds_tensor", None)
        on_device = isinstance(part, torch.Tensor) and part.device == magnitude.device
        return on_device and hasattr(magnitude, "ds_process_group")

    def get(self, tensors, extra=()) -> bool:
        magnitude = tensors[0]
        group = magnitude.ds_process_group
        state = self._groups.get(id(group))
        if state is None or state[0] is not group:
            state = self._groups[id(group)] = [group, WeakIdKeyDictionary(), None, None]
        members = state[1]
        if state[2] == dora_cache._epoch[0] and members.get(magnitude) == magnitude.ds_tensor._version:
            return state[3]
        members[magnitude] = None  # a new member joins at the end, in the same order on every rank
        parts = [m.ds_tensor for m in members]
        # through the module: the tests count dora_cache._has_zero's calls
        has_zero = dora_cache._has_zero(*parts).to(torch.float32)
        dist.all_reduce(has_zero, op=dist.ReduceOp.MAX, group=group)
        for m, part in zip(list(members), parts):
            members[m] = part._version
        state[2], state[3] = dora_cache._epoch[0], not bool(has_zero)
        return state[3]

    def put(self, tensors, value, extra=()):
        return value


def fsdp1_unit(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an FSDP1 unit, whose parameters are whole only inside its own forward."""
    return _FSDP1 is not None and isinstance(module, _FSDP1)


def lora_output_and_weights(lora_A: torch.nn.Module, lora_B: torch.nn.Module, x: torch.Tensor) -> tuple:
    """``(lora_B(lora_A(x)), A, B)``: the LoRA branch through the modules' own forwards (an FSDP1 unit gathers its
    parameters for it) and detached copies of their weights as those forwards saw them ([r, d_in] and [d_out, r]:
    small), for the norm, which autograd treats as a constant (DoRA paper, section 4.3)."""
    seen = [None, None]

    def keeper(i):
        def hook(module, args):
            seen[i] = module.weight.detach().clone()

        return hook

    inner = [m.module if fsdp1_unit(m) else m for m in (lora_A, lora_B)]
    handles = [m.register_forward_pre_hook(keeper(i)) for i, m in enumerate(inner)]
    try:
        out = lora_B(lora_A(x))
    finally:
        for handle in handles:
            handle.remove()
    return out, seen[0], seen[1]
