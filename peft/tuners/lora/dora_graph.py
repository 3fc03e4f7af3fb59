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
"""A DoRA layer's weight norm replayed as a CUDA graph.

A training forward computes the norm afresh (four to six launches, about 200 µs of host time per module on the
H200's host), although its inputs are the same tensors every time: the optimizer updates ``A`` and ``B`` in place
and ``W`` is frozen. A CUDA graph of that computation reads whatever those tensors hold when it is replayed, so
after one eager computation and one capture each fresh norm is one graph launch.

A graph is tied to the storage of its inputs, so it is replayed only for the very same tensor objects (weak
references) with the same storage, shape, strides, dtype and device, the same scaling and the same environment;
anything else computes eagerly and captures again on the next call that repeats. Replays write into the graph's
own output buffer, which a layer's graph hands out as it is (a copy per forward was one more allocation and launch
per module and step, on a host-bound step's critical path): a replay from the inputs' versions of the last one
writes the values that are there already, and one from other versions bumps the buffer's version counter
(:func:`note_write`), so that a training node holding the norm of an earlier forward (``dora_fused``) fails its
backward as autograd fails on a saved tensor edited in place, instead of reading the new norm. The torch.compile
op's graphs (:class:`StorageNormGraph`) hand out copies: a compiled graph may reuse an op's output as scratch space.

All graphs of a device capture into one shared memory pool: each capture's temporaries are freed when it ends
and serve the next one, and graphs replay one at a time on the current stream, so the pool stays as large as
the largest single norm's temporaries. That memory stays reserved while the graphs live (it is not counted by
``torch.cuda.memory_allocated``, which replays never change). The pool holds temporaries only: a graph's output
buffer is an ordinary allocation that the graph copies its norm into (:meth:`NormGraph._capture`), since a later
capture's output in the pool may lie where an earlier graph's temporaries were, which that graph's replays
overwrite.
"""

from __future__ import annotations

import collections
import weakref
from typing import Callable, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef


graph_counts: collections.Counter = collections.Counter()
"""Norm graphs ``captured``, ``replayed`` and ``failed`` (a capture that raised; that key then stays eager), and
``batch_replayed``: launches of a compiled forward's one graph for all its training norms (``dora_norm._BatchGraph``,
each also counted as ``replayed``), and ``unit_rows``: calls of an FSDP2 unit's graph for its rank's rows of the norms
(``DoraLinearLayer._unit_rows_graphed``: its replays are counted as ``replayed``)."""

_pools: dict = {}  # device index -> (memory pool handle shared by every norm graph there, the graphs that use it)
_streams: dict = {}  # device index -> side stream that captures run on (capture cannot use the default stream)


def _pool_and_stream(index: int):
    """The device's shared pool, the set of live graphs in it, and its capture stream. PyTorch frees a pool when
    the last graph using it is destroyed, and a freed pool's handle must not be captured into again: a new one is
    taken once no graph of ours holds the old one."""
    entry = _pools.get(index)
    if entry is None or not entry[1]:
        entry = _pools[index] = (torch.cuda.graph_pool_handle(), weakref.WeakSet())
    if index not in _streams:
        _streams[index] = torch.cuda.Stream(device=index)
    return entry[0], entry[1], _streams[index]


def same_objects(refs: tuple, tensors) -> bool:
    """Whether the weak references ``refs`` point at exactly these tensor objects, in order (a loop: cheaper than
    ``all()`` over a generator on the per-forward path)."""
    if len(refs) != len(tensors):
        return False
    for ref, t in zip(refs, tensors):
        if ref() is not t:
            return False
    return True


def _key(tensors, extra) -> tuple:
    return extra, [(t.data_ptr(), t.shape, t.stride(), t.dtype, t.device) for t in tensors]


def versions(tensors) -> tuple:
    """The version counters of a graph's inputs: what the values it writes are computed from."""
    return tuple(t._version for t in tensors)


def storage_refs(tensors) -> tuple:
    """Weak references to the tensors' storages: a referenced ``StorageImpl`` stays allocated, so no new storage can
    take its address, while its data is freed as usual (``expired()`` then)."""
    return tuple(StorageWeakRef(t.untyped_storage()) for t in tensors)


def hand_out(out: torch.Tensor, written: list, state: tuple) -> torch.Tensor:
    """A graph's output buffer as a layer hands it out after a replay from inputs at ``state``: the buffer itself,
    its version moved on where the values changed (:func:`note_write`), or a copy of a buffer captured under
    ``torch.inference_mode``: an inference tensor has no version counter for a training node to check, and outside
    inference mode autograd may not record it; its copy is an ordinary tensor."""
    if out.is_inference():
        return out.clone()
    note_write(out, written, state)
    return out


def note_write(out: torch.Tensor, written: list, state: tuple) -> None:
    """After a replay that wrote ``out`` from inputs at ``state`` (:func:`versions`): where the last write (kept in
    the one-element list ``written``, shared by everyone who replays that graph) was from other versions, the values
    changed, so ``out``'s version counter moves on, as an in-place edit's would."""
    if written[0] != state:
        if written[0] is not None:
            torch.autograd.graph.increment_version(out)
        written[0] = state


class NormGraph:
    """One layer's norm computation: eager on the first call with new inputs, captured on the second, replayed
    from then on. A layer holds it in its ``dora_cache.LayerReuse``, whose copies and pickles start empty."""

    __slots__ = ("key", "refs", "graph", "out", "failed", "written")
    copies = False  # whether callers get a copy of the output buffer (see the module's docstring)

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.key, self.refs, self.graph, self.out, self.failed = None, (), None, None, False
        self.written = [None]  # the input versions of the buffer's last write (note_write); a new list per capture

    def _same(self, tensors, extra) -> bool:
        return same_objects(self.refs, tensors) and _key(tensors, extra) == self.key

    @staticmethod
    def _refs(tensors) -> tuple:
        return tuple(weakref.ref(t) for t in tensors)

    def run(self, tensors, extra, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``compute()`` (a no-grad function of ``tensors``, CUDA tensors of one device, and of ``extra``: anything
        else it reads must be part of ``extra``), replayed from a graph where these inputs repeat."""
        if not self._same(tensors, extra):
            self.clear()
            self.key, self.refs = _key(tensors, extra), self._refs(tensors)
            return compute()
        if self.failed:
            return compute()
        if self.graph is None:
            out = self._capture(tensors[0].device, compute)
            if out is not None:
                return self._handed_out(tensors)
            return compute()
        self.graph.replay()
        graph_counts["replayed"] += 1
        return self._handed_out(tensors)

    def _handed_out(self, tensors) -> torch.Tensor:
        if self.copies:
            return self.out.clone()
        return hand_out(self.out, self.written, versions(tensors))

    def _capture(self, device: torch.device, compute) -> Optional[torch.Tensor]:
        """Capture ``compute`` on the device's side stream and replay it once; None (and eager from now on for
        this key) where the capture fails.

        The output buffer is allocated outside the shared pool, before the capture, and the graph copies the norm
        into it: the pool holds only temporaries, which every replay writes before it reads them. A buffer of the
        pool's would lie where an earlier graph's temporaries were freed at the end of its capture, and that graph's
        replays would overwrite it: a layer that captures again (new tensors, a new scaling, its ``||W||²`` kept
        anew) after the layers behind it have captured theirs replays first in the next forward, and the layers
        after it replaying theirs before its backward reads the buffer would hand that backward another norm."""
        pool, live, stream = _pool_and_stream(device.index if device.index is not None else torch.cuda.current_device())
        current = torch.cuda.current_stream(device)
        graph = torch.cuda.CUDAGraph()
        stream.wait_stream(current)
        try:
            with torch.cuda.stream(stream):
                # warm-up on the capture stream: cuBLAS sets up its workspace for it outside the capture
                warm = compute()
            # the caching allocator's (not the pool's), on the current stream
            out = torch.empty_like(warm, memory_format=torch.contiguous_format)
            del warm
            with torch.cuda.stream(stream):
                graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    out.copy_(compute())
                finally:
                    graph.capture_end()
        except RuntimeError:
            current.wait_stream(stream)
            self.failed = True
            graph_counts["failed"] += 1
            return None
        current.wait_stream(stream)
        live.add(graph)
        self.graph, self.out = graph, out
        graph_counts["captured"] += 1
        graph.replay()
        graph_counts["replayed"] += 1
        return out


class StorageNormGraph(NormGraph):
    """A :class:`NormGraph` for a caller that holds no layer (the torch.compile norm op, ``dora_norm``): its inputs
    are identified by their live storage (weak references) rather than the tensor objects, which a compiled graph
    hands over as fresh aliases of the parameters. A graph reads its inputs' addresses, so a replay for tensors with
    the captured data pointers, shapes, strides and dtypes computes from their current values. Callers get copies."""

    __slots__ = ()
    copies = True

    def _same(self, tensors, extra) -> bool:
        return len(self.refs) == len(tensors) and not self.dead() and _key(tensors, extra) == self.key

    @staticmethod
    def _refs(tensors) -> tuple:
        return storage_refs(tensors)

    def dead(self) -> bool:
        """Nothing kept, or a storage it was keyed on is gone (its table drops it)."""
        return not self.refs or any(ref.expired() for ref in self.refs)
