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
"""The training norms of all of a device's DoRA Linears computed together, once per forward pass
(``PEFT_DORA_NORM_BATCH=1``; off by default until it is measured on GPUs).

A training forward computes each DoRA Linear's norm afresh (W, A and B may have changed in ways no version counter
shows, e.g. ``p.data -= lr * p.grad``): on a GPU one graph replay per module and forward, with the
checks around them, host time that small steps pay in full. With the batch on, the first of a device's members to
ask in a forward pass (the leader) computes the norms of all members at once (one CUDA graph replay and one copy for
all of them; eagerly on a CPU) and leaves each of the others its value. A member takes its value once, and only if it
was made in the same pass (no backward of a DoRA training node and no optimizer step since, :func:`end_pass`) from the
very tensors it holds now, unchanged (the same objects, data pointers and version counters, the same scaling and
settings). What a member gets was therefore computed from the values its tensors have when it asks, as its own
computation would have been, unless something wrote them through ``.data`` after the leader's forward within the
same forward pass.

Members are the layers that asked here; the batch is captured at the first pass in which no new member joined the
pass before, and dropped whenever a member is gone, holds other tensors or settings, or a storage it reads is freed
(FSDP) — each layer then computes its own norm, as without the batch, until the next capture (at most
``_MAX_CAPTURES`` per device).
"""

from __future__ import annotations

import weakref
from typing import Callable, Optional

import torch
from torch import nn

from .dora_cache import _epoch, capturing, identity_tracked, norm_counts, storage_holds
from .dora_graph import _key as _layout  # what a norm graph is keyed on: extra and the tensors' layout
from .dora_graph import _pool_and_stream, graph_counts, same_objects
from .dora_settings import current as settings


_MAX_CAPTURES = 16  # per device: members that keep changing (e.g. MoE experts seen one by one) stop being batched
_pass = [0]  # bumped by every backward of a DoRA training node: values handed out before it are not taken


def end_pass(*_args, **_kwargs) -> None:
    """A forward pass has ended (a DoRA training node's backward runs): no value computed before is taken."""
    _pass[0] += 1


def _versions(tensors) -> list:
    return [(t.data_ptr(), t._version) for t in tensors]


class _Member:
    __slots__ = ("layer", "refs", "key", "compute")

    def __init__(self, layer, tensors, extra, compute: Callable) -> None:
        self.layer = weakref.ref(layer)
        self.refs = tuple(weakref.ref(t) for t in tensors)
        self.key = _layout(tensors, extra)
        self.compute = compute  # (layer, tensors) -> norm, holding no tensor itself

    def tensors(self) -> Optional[tuple]:
        """The member's tensors where the layer and all of them are alive, in the layout they were taken in and with
        their storage in place; else None."""
        layer = self.layer()
        tensors = tuple(ref() for ref in self.refs)
        if layer is None or any(t is None for t in tensors):
            return None
        if _layout(tensors, self.key[0]) != self.key or not all(storage_holds(t) for t in tensors):
            return None
        return tensors


class DeviceNorms:
    """The batch of one device (see the module's docstring)."""

    __slots__ = ("members", "graph", "static", "sizes", "waiting", "changed", "captures", "device")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.members: dict = {}  # id(layer) -> _Member, in the order they joined
        self.graph, self.static, self.sizes = None, None, ()
        self.waiting: dict = {}  # id(layer) -> ((pass, epoch), tensor refs, versions, extra, value)
        self.changed = None  # (pass, epoch) in which the members last changed
        self.captures = 0

    def drop(self) -> None:
        self.graph, self.static, self.sizes = None, None, ()
        self.waiting.clear()

    def norm(self, layer, tensors: tuple, extra, compute: Callable, fallback: Callable) -> torch.Tensor:
        """This layer's norm of ``tensors`` (``compute(layer, tensors)`` computes it; ``extra`` is everything else
        it depends on): its waiting value, or, as the leader of a new pass, the batch's, or ``fallback()``."""
        key, now = id(layer), (_pass[0], _epoch[0])
        entry = self.waiting.pop(key, None)
        if entry is not None:
            made, refs, versions, made_extra, value = entry
            if made == now and same_objects(refs, tensors) and made_extra == extra and _versions(tensors) == versions:
                norm_counts["norm_batched"] += 1
                return value
        member = self.members.get(key)
        if member is None or member.layer() is not layer or member.key != _layout(tensors, extra):
            self.members[key] = _Member(layer, tensors, extra, compute)
            self.drop()
            self.changed = now
            return fallback()
        if self.changed == now:  # members still joining in this pass
            return fallback()
        values = self._run(now)
        if values is None:
            return fallback()
        return values[key]

    def _run(self, now) -> Optional[dict]:
        """Every member's norm from one computation (captured first where there is no batch yet), the others' left
        waiting; None (and the batch dropped) where a member is gone or changed, or the capture failed."""
        cuda = self.device.type == "cuda"
        if cuda and self.graph is None and self.captures >= _MAX_CAPTURES:
            return None  # given up on this device: each member computes its own
        live, gone = [], []
        for key, member in self.members.items():
            tensors = member.tensors()
            if tensors is None:
                gone.append(key)
            else:
                live.append((key, member, tensors))
        if gone:  # every member that is gone or changed leaves at once; the rest are batched from the next pass
            for key in gone:
                del self.members[key]
            self.drop()
            self.changed = now
            return None
        if cuda and self.graph is None and not self._capture(live):
            return None
        if self.graph is not None:
            self.graph.replay()
            graph_counts["replayed"] += 1
            parts = self.static.clone().split(self.sizes)
        else:  # a CPU: the members' norms computed one after another
            parts = [member.compute(member.layer(), tensors) for _, member, tensors in live]
        values = dict(zip([key for key, _, _ in live], parts))
        self.waiting = {
            key: (now, member.refs, _versions(tensors), member.key[0], values[key]) for key, member, tensors in live
        }
        return values

    def _capture(self, live) -> bool:
        """Capture the members' norms and their concatenation as one CUDA graph on the device's side stream (the
        norm graphs' pool); False where the capture fails or their dtypes differ."""
        self.captures += 1
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        pool, graphs, stream = _pool_and_stream(index)
        current = torch.cuda.current_stream(self.device)
        graph = torch.cuda.CUDAGraph()
        stream.wait_stream(current)
        try:
            with torch.cuda.stream(stream):
                outs = [member.compute(member.layer(), tensors) for _, member, tensors in live]  # warm-up
                if len({o.dtype for o in outs}) != 1 or any(o.dim() != 1 for o in outs):
                    current.wait_stream(stream)
                    self.captures = _MAX_CAPTURES  # norms that cannot be concatenated: not batched here
                    return False
                graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    static = torch.cat([member.compute(member.layer(), tensors) for _, member, tensors in live])
                finally:
                    graph.capture_end()
        except RuntimeError:
            current.wait_stream(stream)
            graph_counts["failed"] += 1
            self.captures = _MAX_CAPTURES  # as a layer's own graph that failed: not tried again
            return False
        current.wait_stream(stream)
        graphs.add(graph)
        graph_counts["captured"] += 1
        self.graph, self.static, self.sizes = graph, static, [o.numel() for o in outs]
        for _, member, _ in live:  # the layers' own norm graphs are not replayed while the batch holds
            member.layer()._reuse.graph.clear()
        return True


def applies(weight, lora_A, lora_B) -> bool:
    """Whether a training norm of these tensors goes through the device's batch: PEFT_DORA_NORM_BATCH=1, a forward
    that autograd records, outside backward (a checkpoint recompute reuses its forward's norm), torch.compile and
    graph capture, plain parameters of one device whose identity PyTorch tracks (not sharded, quantized or
    DeepSpeed's)."""
    env = settings()
    if not env.norm_batch or env.norm_graph is False or env.fused is False:
        return False  # PEFT_DORA_NORM_GRAPH=0 or PEFT_DORA_FUSED=0: no graph of ours, the batch's neither
    if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
        return False
    if torch.compiler.is_compiling():
        return False
    tensors = (weight, lora_A, lora_B)
    for t in tensors:
        if type(t) is not nn.Parameter or hasattr(t, "ds_id") or t.device != weight.device:
            return False
    return identity_tracked(tensors) and not capturing(tensors)


_batches: dict = {}  # device -> DeviceNorms


def batch(device: torch.device) -> DeviceNorms:
    """The batch of ``device``."""
    entry = _batches.get(device)
    if entry is None:
        entry = _batches[device] = DeviceNorms(device)
    return entry
