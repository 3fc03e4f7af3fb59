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
"""DoRA's weight norm ``||W + s·B·A||_row``, factored: ``||W||²_row``, the cross term through ``U = W·Aᵀ`` and
``||B·A||²_row`` through the Gram ``G = A·Aᵀ`` – never a dense ``B·A`` – in fp32 under ``no_grad``; which of its
implementations runs (PyTorch, the one-pass and split Triton norms, a CUDA graph), when a computed norm may be reused
(``reuse_mode``), and the norm as one opaque op under torch.compile (``peft::dora_weight_norm``)."""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Optional

import torch
from torch import nn

from . import dora_norm_triton
from .dora_cache import (
    _NO_TORCH_FUNCTION,
    _epoch,
    _merge_epoch,
    capturing,
    identity_tracked,
    memoised,
    norm_counts,
    regathered,
    storage_graph,
    storage_memo,
    storage_pins,
)
from .dora_dispatch import records_grad
from .dora_graph import NormGraph, graph_counts, hand_out, same_objects, versions
from .dora_launch import INTERPRET
from .dora_settings import current as settings
from .dora_settings import get_dora_norm_threshold_bytes


def eps_for(dtype: torch.dtype) -> float:
    return 1e-6 if dtype in (torch.float16, torch.bfloat16) else 1e-12


def _chunk_columns(d_out: int, r: int, d_in: int, budget_bytes: int) -> int:
    """Columns per chunk so that the fp32 copies of a chunk of W ([d_out, cs]) and of A ([r, cs]) fit the budget."""
    cs = budget_bytes // (4 * (d_out + r))
    cs = max(64, cs - cs % 64)  # multiples of 64 keep the matmul tiles aligned on tensor cores
    return max(1, min(d_in, cs))


def _acc_dtype(weight: torch.Tensor) -> torch.dtype:
    """fp32 accumulation, or fp64 for an fp64 weight."""
    return torch.promote_types(weight.dtype, torch.float32)


def matmul_acc(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype, split: bool = False) -> torch.Tensor:
    """a @ b accumulated and returned in ``acc``.

    On CUDA, half-precision ``a`` stays in its dtype and runs on the tensor cores with an fp32 output (no fp32 copy
    of the weight chunk); everywhere else both operands are upcast. ``b`` is rounded to ``a``'s dtype there, unless
    ``split`` (``b`` holds values wider than ``a``'s dtype, e.g. fp32 adapters on a bf16 weight): then it goes in as
    a hi and a lo half-precision part side by side, one GEMM of twice the columns. Rounding fp32 ``A`` to bf16 for
    ``W·Aᵀ`` measured up to 1.1e-5 relative error in the norm on the H200 (‖s·B·A‖ = 0.1‖W‖), above the 1e-5
    contract; with the split, ≤ 1.6e-7. Several ``a`` against one ``b``: :func:`acc_operand` once, then
    :func:`matmul_operand` per ``a``.
    """
    return matmul_operand(a, acc_operand(a, b, acc, split), b.shape[1], acc)


def acc_operand(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype, split: bool = False) -> torch.Tensor:
    """``b`` as :func:`matmul_acc` multiplies it with ``a`` (or with any ``a`` of the same dtype and device): in
    ``acc`` off the tensor cores, else rounded to ``a``'s dtype, or with ``split`` its hi and lo parts side by side."""
    if not _on_tensor_cores(a):
        return b.to(acc)
    return hi_lo(b, a.dtype, 1) if split else b.to(a.dtype)


def matmul_operand(
    a: torch.Tensor, operand: torch.Tensor, n: int, acc: torch.dtype, out: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """``a @ b`` in ``acc`` from ``b``'s :func:`acc_operand` (``n``: ``b``'s columns), into ``out`` if given."""
    if not _on_tensor_cores(a):
        return a.to(acc) @ operand if out is None else torch.mm(a.to(acc), operand, out=out)
    product = torch.mm(a, operand, out_dtype=acc)
    if operand.shape[1] == n:
        return product if out is None else out.copy_(product)
    # [a·b_hi | a·b_lo]
    return product[:, :n].add_(product[:, n:]) if out is None else torch.add(product[:, :n], product[:, n:], out=out)


def _on_tensor_cores(a: torch.Tensor) -> bool:
    return a.is_cuda and a.dtype in (torch.float16, torch.bfloat16)


@torch.no_grad()
def row_sq_norm(weight: torch.Tensor, chunk_bytes: Optional[int] = None) -> torch.Tensor:
    """``||W||²`` per row of ``W`` [d_out, d_in] in fp32, in column chunks of the norm's budget."""
    d_out, d_in = weight.shape
    cs = _chunk_columns(d_out, 0, d_in, get_dora_norm_threshold_bytes() if chunk_bytes is None else chunk_bytes)
    acc = _acc_dtype(weight)
    w_sq = torch.zeros(d_out, device=weight.device, dtype=acc)
    for c in range(0, d_in, cs):
        w_sq += torch.linalg.vector_norm(weight[:, c : c + cs], dim=1, dtype=acc).square()
    return w_sq


def chain_shapes(weight_shape, lora_A: torch.Tensor, lora_B: torch.Tensor) -> tuple[int, int, int]:
    """(d_out, d_in, r) of ``W`` [d_out, d_in], ``A`` [r, d_in] and ``B`` [d_out, r]; a ``ValueError`` naming all three
    shapes where they do not chain."""
    d_out, d_in = weight_shape
    r = lora_A.shape[0]
    if lora_A.shape != (r, d_in) or lora_B.shape != (d_out, r):
        raise ValueError(
            f"factored norm: shapes do not chain: W {tuple(weight_shape)}, A {tuple(lora_A.shape)}, "
            f"B {tuple(lora_B.shape)} (expected A [r, {d_in}] and B [{d_out}, r])"
        )
    return d_out, d_in, r


@torch.no_grad()
def factored_row_norm(
    weight: torch.Tensor,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    scale: float,
    chunk_bytes: Optional[int] = None,
    w_sq: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``||W + scale·B·A||`` per row of ``W`` in fp32, detached, without forming ``B·A``.

    Args:
        weight: ``W``, [d_out, d_in], any float dtype and strides (a transposed view is fine).
        lora_A: ``A``, [r, d_in].
        lora_B: ``B``, [d_out, r].
        scale: the LoRA scaling ``s``; with ``s == 0`` the cross and Gram terms are skipped.
        chunk_bytes: budget for the fp32 chunk copies (default: ``PEFT_DORA_NORM_CHUNK_MB``).
        w_sq: ``||W||²_row`` if already known (a frozen weight's cached value), fp32 [d_out].
    """
    d_out, d_in, r = chain_shapes(weight.shape, lora_A, lora_B)
    if _norm_kernel_applies(weight, lora_A, lora_B):
        return dora_norm_triton.row_norm_checked(weight, lora_A, lora_B, scale)
    budget = get_dora_norm_threshold_bytes() if chunk_bytes is None else chunk_bytes
    cs = _chunk_columns(d_out, r, d_in, budget)
    scale = float(scale)
    device = weight.device
    acc = _acc_dtype(weight)
    if device.type == "meta":  # low_cpu_mem_usage: shapes only, values come with the state dict
        return torch.empty(d_out, device=device, dtype=acc)
    with torch.autocast(device_type=device.type, enabled=False):
        if scale == 0.0:
            return (row_sq_norm(weight, budget) if w_sq is None else w_sq).sqrt()
        if _split_norm_applies(weight, lora_A, lora_B):
            w_sq = row_sq_norm(weight, budget) if w_sq is None else w_sq
            return dora_norm_triton.split_row_norm(weight, lora_A, lora_B, scale, w_sq, cs)
        own_w_sq = w_sq is None
        # fp32 (or wider) adapters on a half weight: A keeps its precision in W·Aᵀ (see matmul_acc)
        split = torch.finfo(lora_A.dtype).bits > torch.finfo(weight.dtype).bits
        b_acc = _as(lora_B, device, acc)
        u = gram = None
        for c in range(0, max(d_in, 1), cs):  # one (empty) chunk for d_in == 0, so every sum exists
            w_c, a_c = (weight, lora_A) if cs >= d_in else (weight[:, c : c + cs], lora_A[:, c : c + cs])
            a_c = _as(a_c, device, acc)
            if own_w_sq:
                w_sq = _accumulate(w_sq, torch.linalg.vector_norm(w_c, dim=1, dtype=acc).square())
            gram = _accumulate(gram, a_c @ a_c.T)
            u = _accumulate(u, matmul_acc(w_c, a_c.T, acc, split))
        return combine_row_norm(w_sq, u, gram, b_acc, scale)


def combine_row_norm(
    w_sq: torch.Tensor, u: torch.Tensor, gram: torch.Tensor, lora_B: torch.Tensor, scale: float
) -> torch.Tensor:
    """The norm from its factors: ``sqrt(‖W‖² + rowsum(B ⊙ (2s·U + s²·B·G)))`` with ``U = W·Aᵀ`` and ``G = A·Aᵀ``,
    all in the accumulation dtype. 2s·cross + s²·ba_sq in one GEMM and one row-wise dot instead of two of each:
    launches, not flops, decide the norm's cost on real models (host-bound), so fewer ops is the point."""
    t = (lora_B * torch.addmm(u, lora_B, gram, beta=2.0 * scale, alpha=scale * scale)).sum(dim=1)
    return (w_sq + t).clamp_min_(0).sqrt_()  # clamp_min keeps NaN


def _as(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(device, dtype)``, without the call where it would return ``t`` (host time counts on the hot path)."""
    return t if t.dtype == dtype and t.device == device else t.to(device=device, dtype=dtype)


def hi_lo(t: torch.Tensor, dtype: torch.dtype, dim: int) -> torch.Tensor:
    """``t`` (fp32) as ``hi`` and ``lo`` in ``dtype`` concatenated along ``dim``: ``hi`` is ``t`` rounded, ``lo`` the
    rounded remainder, so ``hi + lo`` keeps about 16 of fp32's 24 mantissa bits (bf16) instead of 8."""
    n = t.shape[dim]
    out = torch.empty(t.shape[:dim] + (2 * n,) + t.shape[dim + 1 :], dtype=dtype, device=t.device)
    hi, lo = out.narrow(dim, 0, n), out.narrow(dim, n, n)
    hi.copy_(t)
    torch.sub(t, hi, out=lo)
    return out


# The one-pass kernel's largest ranks on auto: half adapters of W's dtype, and fp32 (or mixed) adapters, PEFT's
# autocast default. It reads W once; its products cost r FLOP per byte of W read (three bf16 hi/lo products for fp32
# adapters), so at small ranks reading W bounds it, where the split path reads W for ``W·Aᵀ`` and again for
# ``||W||²`` unless a frozen W's is kept. Per Llama-3.1-8B decoder layer on the H200 (``benchmarks/bench_norm.py``,
# ``results/bench_norm.json``, CUDA-graph replays), kernel / split with ``||W||²`` kept / split computing it, µs: fp32
# adapters 202/261/453 (r = 16), 267/274/470 (32), 449/303/506 (64); bf16 adapters 161/235/424 (16), 184/258/452 (64),
# 548/297/495 (128).
_KERNEL_MAX_RANK = 64
_KERNEL_MAX_RANK_MIXED = 32
# Inside ``eager_norms()``: norms computed as launches every time, never captured into a CUDA graph (FSDP2's sharded
# rows, whose gathered W and A move every step; ZeRO-3's and FSDP1's gathered weights; eval forwards). There a
# launch's host time is paid on every forward, and on the H200 machines' hosts the split path's seven launches took
# ~0.45 ms per norm against ~0.11 ms for the one-pass kernel (2× H200, FSDP2, 4 Llama-8B layers, r = 128 / 16,
# ``benchmarks/results/profile/fsdp2_host_timers/``), while the kernel's extra GPU time at r = 128 is ~36 µs per
# module of full rows (above), 1/N of it on N ranks' rows.
_KERNEL_MAX_RANK_EAGER = 128


class _EagerDepth(threading.local):
    depth = 0  # of ``eager_norms()`` in this thread (DataParallel runs replicas in threads)


_eager = _EagerDepth()


class eager_norms:
    """``with eager_norms():`` the norms computed inside are launched as they are, every time (not captured into a
    CUDA graph): the one-pass kernel takes them up to rank ``_KERNEL_MAX_RANK_EAGER`` (half adapters of W's dtype).
    Callers that keep a ``||W||²`` for the norm ask ``w_sq_reusable`` inside it too, so both see the same path."""

    __slots__ = ()

    def __enter__(self) -> None:
        _eager.depth += 1

    def __exit__(self, *_exc) -> None:
        _eager.depth -= 1


def _norm_kernel_applies(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor) -> bool:
    """Whether the one-pass Triton norm (``dora_norm_triton``) computes this norm instead of the forms below.

    Auto (PEFT_DORA_NORM_KERNEL unset): a half weight with adapters of the same half dtype at rank ≤
    ``_KERNEL_MAX_RANK`` (``_KERNEL_MAX_RANK_EAGER`` inside :class:`eager_norms`), or fp32 adapters (either or both,
    the other of W's dtype) at rank ≤ ``_KERNEL_MAX_RANK_MIXED``, where it is faster than the split path's cuBLAS
    GEMMs even with a kept ``||W||²`` and at least as precise (~1e-7 relative); larger ranks take
    ``_split_norm_applies``'s GEMMs (the kernel's products took ~4x their time at r = 384). PEFT_DORA_NORM_KERNEL=1
    takes the kernel wherever it runs, 0 never (the PyTorch form), and PEFT_DORA_FUSED=0 turns it off with the other
    kernels.
    """
    env = settings()
    if env.fused is False or env.norm_kernel is False:
        return False
    if env.norm_kernel is None:  # decided by dtypes and rank first: the support check costs host time every forward
        if weight.dtype not in (torch.bfloat16, torch.float16):
            return False
        if lora_A.dtype == lora_B.dtype == weight.dtype:
            if lora_A.shape[0] > (_KERNEL_MAX_RANK_EAGER if _eager.depth else _KERNEL_MAX_RANK):
                return False
        elif lora_A.shape[0] > _KERNEL_MAX_RANK_MIXED or any(
            t.dtype not in (torch.float32, weight.dtype) for t in (lora_A, lora_B)
        ):
            return False
    return dora_norm_triton.row_norm_supported(weight, lora_A, lora_B)


def _split_norm_applies(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor) -> bool:
    """Whether ``dora_norm_triton.split_row_norm`` computes the norm on a half weight of fp32 adapters (PEFT's
    autocast default) above ``_KERNEL_MAX_RANK_MIXED`` or of half adapters above ``_KERNEL_MAX_RANK``: seven
    launches (three hi/lo splits, three GEMMs, the row-wise epilogue; six for half adapters, whose A is not split;
    one graph launch in training) where the PyTorch form below takes eleven, and the Gram and ``B·G`` on the tensor
    cores instead of fp32 SIMT GEMMs. Off with PEFT_DORA_FUSED=0 or PEFT_DORA_NORM_KERNEL=0 (the PyTorch form), and
    with PEFT_DORA_NORM_KERNEL=1 (the one-pass kernel takes every norm it can)."""
    env = settings()
    if env.fused is False or env.norm_kernel is not None:
        return False
    return dora_norm_triton.split_norm_supported(weight, lora_A, lora_B)


def norm_graph_applies(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor) -> bool:
    """Whether a training norm is replayed as a CUDA graph (``dora_graph``): CUDA tensors of one device whose
    identity PyTorch tracks (not sharded, quantized or inference tensors, nor FSDP1's views of its gathered flat
    parameters, new in every forward: ``dora_cache.regathered``), outside torch.compile's tracing (the
    compiled graph's norm op replays graphs when it runs) and outside a graph capture of the caller's own; off with
    PEFT_DORA_NORM_GRAPH=0 or PEFT_DORA_FUSED=0."""
    env = settings()
    if env.norm_graph is False or env.fused is False or INTERPRET or not weight.is_cuda:
        return False
    if lora_A.device != weight.device or lora_B.device != weight.device or torch.compiler.is_compiling():
        return False
    sources = (weight, lora_A, lora_B)
    return identity_tracked(sources) and not capturing(sources) and not regathered(sources)


def graph_key(tensors: tuple, w_sq: Optional[torch.Tensor], scale) -> tuple[tuple, tuple]:
    """(tensors, extra) of a norm graph (``dora_graph.NormGraph.run``): the tensors it reads (``‖W‖²`` too where it is
    kept) and what else its computation depends on: the scaling, the settings and the norm threshold."""
    return tensors + (() if w_sq is None else (w_sq,)), (float(scale), settings(), get_dora_norm_threshold_bytes())


def _accumulate(total: Optional[torch.Tensor], part: torch.Tensor) -> torch.Tensor:
    """``total + part`` in place into ``total`` (our own buffer), or ``part`` itself for the first chunk."""
    return part if total is None else total.add_(part)


@torch.no_grad()
def factored_conv_norm(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scale: float) -> torch.Tensor:
    """Per-output-channel norm of ``W + s·ΔW`` for a conv weight, [d_out] fp32.

    ``ΔW`` is upstream's ``(B.view(-1, r) @ A.view(r, -1)).reshape(W.shape)``. With ``groups`` > 1 (B has
    ``r / groups`` input channels) row ``j`` of that reshaped product is row ``j // groups`` of ``B.view(-1, r)``
    times column block ``j % groups`` of ``A.view(r, -1)``, so each block is its own factored norm.
    """
    d_out = weight.shape[0]
    r = lora_A.shape[0]
    w2 = weight.reshape(d_out, -1)
    b2 = lora_B.reshape(-1, r)
    a2 = lora_A.reshape(r, -1)
    groups = d_out // b2.shape[0]
    if groups == 1:
        return factored_row_norm(w2, a2, b2, scale)
    width = w2.shape[1]
    norm = torch.empty(d_out, device=weight.device, dtype=_acc_dtype(weight))
    for q in range(groups):
        norm[q::groups] = factored_row_norm(w2[q::groups], a2[:, q * width : (q + 1) * width], b2, scale)
    return norm


def magnitude_scale(magnitude: torch.Tensor, weight_norm: torch.Tensor, weight_dtype: torch.dtype) -> torch.Tensor:
    """g = m / max(w_norm, eps) in fp32 (or wider), differentiable in m; eps depends on the weight's dtype."""
    return magnitude / weight_norm.clamp_min(eps_for(weight_dtype))


def reuse_mode(layer: nn.Module, factors=()) -> Optional[str]:
    """``"any"``: reuse norms across forwards; ``"recompute"``: only in a gradient-checkpoint recompute; None: never.

    With PEFT_DORA_NORM_CACHE unset, an eval-mode forward that autograd does not record through ``factors`` (W, A, B:
    generation, evaluation) reuses across forwards; a training forward reuses only in its own recompute.
    """
    mode = settings().norm_cache
    if mode is False:
        return None
    if mode or not (layer.training or records_grad(*factors)):
        return "any"
    return "recompute"


_REUSE_MODES = (None, "recompute", "any")  # the op's int argument: an index into this
_REUSE_CODES = {mode: code for code, mode in enumerate(_REUSE_MODES)}


def w_sq_reusable(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor) -> bool:
    """Whether a frozen ``W`` (optimizers skip it) keeps its ``||W||²_row`` across forwards: not with
    PEFT_DORA_NORM_CACHE=0, and not where the one-pass kernel reads ``W`` once for every term anyway."""
    return settings().norm_cache is not False and not _norm_kernel_applies(weight, lora_A, lora_B)


# ``peft::dora_weight_norm`` is defined through ``torch.library.Library`` rather than ``torch.library.custom_op``: a
# compiled DoRA Linear calls it in every forward, and ``custom_op``'s Python autograd and dispatch layers cost host
# time in every call (on a CPU 21 vs 6 µs for an op that only copies a vector; benchmarks/host_compiled.py).
# The op takes no gradient (the norm is a constant for autograd, and its operands arrive detached), so it needs no
# autograd kernel; the fake kernel below gives its output to the tracer.
_LIB = torch.library.Library("peft", "FRAGMENT")
_LIB.define(
    "dora_weight_norm(Tensor weight, Tensor lora_A, Tensor lora_B, float scale, int reuse, bool frozen) -> Tensor"
)


def _weight_norm_op(
    weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scale: float, reuse: int, frozen: bool
) -> torch.Tensor:
    return _weight_norm(weight, lora_A, lora_B, scale, reuse, frozen, copy=True)


def _weight_norm(
    weight: torch.Tensor,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    scale: float,
    reuse: int,
    frozen: bool,
    copy: bool,
    streams: Optional[tuple] = None,
) -> torch.Tensor:
    """The factored norm as torch.compile sees it: one opaque op, run by the eager norm (Triton and split kernels,
    reuse) instead of the traced PyTorch form, which under Inductor took up to twice a compiled LoRA step (H200,
    autocast, r = 16: the split A·Wᵀ became an fp32 GEMM) and recomputed what eager DoRA reuses.

    ``reuse`` is ``reuse_mode``'s answer at trace time (0 never, 1 in a checkpoint recompute, 2 across forwards);
    ``frozen``: ``W`` takes no gradient, so its ``||W||²`` outlives optimizer steps. The graph passes aliases of the
    parameters, so values are kept by storage (``dora_cache.StorageMemo``); the op returns a copy, which the compiled
    graph may reuse as scratch space (``copy=False``: the kept value itself, for :func:`_weight_norms_op`, whose
    concatenation is the copy). Nothing is kept on a side stream (see ``_on_default_stream``). Inductor passes the
    parameters themselves, the same objects every call: those calls are answered by their :class:`_OpRecord`.
    ``streams``: (on the default stream, capturing) where the caller has asked for the device of a batch.
    """
    sources = (weight, lora_A, lora_B)
    default_stream, capture = streams if streams is not None else (_on_default_stream(weight), capturing(sources))
    record = _op_records.get((id(weight), id(lora_A), id(lora_B)))  # only for objects that pass ``keep`` below
    if record is not None and reuse and default_stream and not capture:
        out = record.answer(weight, lora_A, lora_B, scale, reuse, frozen, copy=copy)
        if out is not None:
            return out
    keep = default_stream and not any(t.is_inference() for t in sources)  # no version counters
    mode = _REUSE_MODES[reuse] if keep else None
    used = [None, None]  # the norm graph and the kept ||W||² the computation below went through, if any

    def compute() -> torch.Tensor:
        w_sq = None
        if frozen and mode is not None and w_sq_reusable(weight, lora_A, lora_B):
            w_memo = storage_memo("w_sq", (weight,), frozen=True)
            w_sq = memoised(w_memo, "any", "w_sq", (weight,), lambda: row_sq_norm(weight))

        def norm() -> torch.Tensor:
            return factored_row_norm(weight, lora_A, lora_B, scale, w_sq=w_sq)

        if mode != "recompute" or not norm_graph_applies(weight, lora_A, lora_B):
            return norm()
        # a training forward, as in eager ones (``dora_graph``): one graph launch instead of the norm's launches and
        # their Python, which in a compiled step is host time on the forward's critical path (H100, 4-layer Llama-8B
        # shape, r = 16: the compiled forward's host time went to 6x compiled LoRA's, and the step waited on it)
        graph = storage_graph(sources)
        used[:] = graph, w_sq
        return graph.run(*graph_key(sources, w_sq, scale), norm)

    if mode is None:
        return compute()
    value = memoised(storage_memo("norm", sources), mode, "norm", sources, compute, extra=scale)
    if not capture and identity_tracked(sources):
        _record(sources, scale, frozen, value, *used)
    return value.clone() if copy else value


class _OpRecord:
    """What the norm op last returned for one triple of parameter objects, and how it computed it.

    Inductor hands the op the parameters themselves, the same objects in every call. For those, the storage-keyed
    memos above (a table entry, a key of seven fields per tensor, weak references to the storages) cost more host
    time per call than the rest of a compiled DoRA Linear's forward (a CPU: ~30 of its ~40 µs over compiled LoRA's,
    ``benchmarks/host_compiled.py``). A record answers a call with the very same objects, data pointers, layout,
    dtypes and scaling from a few attribute reads, under the memos' own rules: the kept norm while the versions and
    the epoch are those it was computed at (across forwards for ``reuse`` 2, in the backward's recompute for 1),
    else, in a training forward, one replay of the norm graph the last computation went through, whose ``||W||²``
    (if it reads one) is valid while ``W``'s version and the merge epoch are unchanged. Anything else (another
    object, layout, scaling, settings or ``frozen``; no graph captured yet) takes the memos' path, which records
    again. The records live in ``_op_records``, keyed by the objects' ids and checked against weak references."""

    __slots__ = ("refs", "layout", "value", "state", "inference", "graph", "graph_state", "pins", "__weakref__")

    @staticmethod
    def _layout(weight, lora_A, lora_B, scale) -> tuple:
        # the storages too, pinned by the record (``dora_cache.storage_pins``): ``p.data = ...`` keeps the object and
        # its version counter, and a new storage may take a freed one's address
        return (
            weight.untyped_storage()._cdata,
            lora_A.untyped_storage()._cdata,
            lora_B.untyped_storage()._cdata,
            weight.data_ptr(),
            lora_A.data_ptr(),
            lora_B.data_ptr(),
            weight.shape,
            lora_A.shape,
            lora_B.shape,
            weight.stride(),
            lora_A.stride(),
            lora_B.stride(),
            weight.dtype,
            lora_A.dtype,
            lora_B.dtype,
            scale,
        )  # fmt: skip  (a move to another device is a new data pointer)

    @staticmethod
    def _state(weight, lora_A, lora_B) -> tuple:
        """What a kept norm is valid for: the three version counters and the epoch."""
        return weight._version, lora_A._version, lora_B._version, _epoch[0]

    @staticmethod
    def _w_sq_state(weight, w_sq) -> Optional[tuple]:
        """What a kept ``||W||²`` is valid for (None: the graph reads none): W's version and the merge epoch."""
        return None if w_sq is None else (weight._version, _merge_epoch[0])

    def holds(self, weight, lora_A, lora_B, scale) -> bool:
        """Whether this record is of these very objects, with the layout and scaling it was made for."""
        return (
            same_objects(self.refs, (weight, lora_A, lora_B))
            and self._layout(weight, lora_A, lora_B, scale) == self.layout
        )

    def graph_current(self, weight, frozen) -> bool:
        """Whether the record's norm graph (if captured) may be replayed now: the settings, ``frozen`` and its
        ``||W||²`` operand's validity are those it was captured under."""
        if self.graph is None:
            return False
        return (settings(), frozen, self._w_sq_state(weight, self.graph[2])) == self.graph_state

    def replayed_into(self, value: torch.Tensor, weight, lora_A, lora_B) -> None:
        """Keep ``value``, the norm a batch's graph (:class:`_BatchGraph`) has just written from these objects' current
        values, as this record's own replay would have kept its output."""
        self.value, self.state = value, self._state(weight, lora_A, lora_B)
        self.inference = torch.is_inference_mode_enabled()

    def answer(self, weight, lora_A, lora_B, scale, reuse, frozen, eager=False, copy=True) -> Optional[torch.Tensor]:
        """The norm for this call, or None where the caller's own path must answer. ``eager``: an eager training
        forward's record (:func:`eager_record`), which answers only under the settings it was made with and
        returns the value it kept itself, not a copy (nothing downstream writes into it, as with the memos').
        ``copy=False``: the kept value or the graph's output buffer itself, for a caller that copies it at once."""
        if eager and settings() is not self.graph_state[0]:
            return None
        if not self.holds(weight, lora_A, lora_B, scale):
            return None
        state = self._state(weight, lora_A, lora_B)
        if reuse == 2 or torch._C._current_graph_task_id() != -1:
            if state == self.state and (not self.inference or torch.is_inference_mode_enabled()):
                norm_counts["norm_reused"] += 1
                return self.value.clone() if copy and not eager else self.value
            if reuse == 2:
                return None
        if not self.graph_current(weight, frozen):
            return None
        graph, out, w_sq, written = self.graph
        _replay_counted(graph, w_sq)
        inference = torch.is_inference_mode_enabled()
        if eager:  # the graph's output buffer, as the layer's graph hands it out (or a copy, captured in inference)
            value = hand_out(out, written, state[:3] if w_sq is None else (*state[:3], w_sq._version))
            self.value, self.state, self.inference = value, state, inference
            return value
        # the graph's own output buffer is the kept norm: only this graph writes it, at its next replay, which
        # records the state it computed at (a replay by the memos' path, for the same storages, writes the norm of
        # their versions then: a state that differs from this one unless the values are the same)
        self.value, self.state, self.inference = out, state, inference
        return out.clone() if copy else out


def _count_replayed_norm(w_sq) -> None:
    """A norm written by a graph replay, counted as computed (and ``||W||²`` reused where the graph reads one)."""
    norm_counts["norm_computed"] += 1
    if w_sq is not None:
        norm_counts["w_sq_reused"] += 1


def _replay_counted(graph, w_sq) -> None:
    """One replay of a record's norm graph, counted as a norm computed (:func:`_count_replayed_norm`)."""
    _count_replayed_norm(w_sq)
    graph.replay()
    graph_counts["replayed"] += 1


_op_records: dict = {}  # (id(W), id(A), id(B)) -> _OpRecord; dropped when one of the three objects dies


def _record(sources: tuple, scale: float, frozen: bool, value: torch.Tensor, graph, w_sq) -> None:
    """Keep what the memos' path returned for these objects for :meth:`_OpRecord.answer`: the value, and where it
    came from a captured norm graph, that graph's CUDA graph, output buffer and ``||W||²`` operand, held here (the
    graph's table entry may capture anew for other tensors; the CUDA graph reads the addresses it captured, which
    are these objects' while their data pointers are, and the ``||W||²`` held here)."""
    weight, lora_A, lora_B = sources
    key = (id(weight), id(lora_A), id(lora_B))
    # one of the objects died: its id may be taken by a new object, with a record of its own
    drop, bind = _entry_dropper(_op_records, key)
    _op_records[key] = bind(_make_record(sources, scale, frozen, value, graph, w_sq, drop))


def _entry_dropper(table: dict, key) -> tuple:
    """``(drop, bind)``: ``drop``, a weak reference's callback, deletes ``table[key]`` while it still holds the entry
    ``bind(entry)`` named (and returned); a later entry under the same key stays. ``drop`` holds ``table`` itself, not
    the module global: an object that dies at interpreter exit may outlive this module's globals (set to None by
    then), and the callback would raise into the exit's output."""
    mine = None  # the entry's weak reference, set by bind: drop runs only once a referent dies, after that

    def drop(_ref) -> None:
        kept = mine()
        if kept is not None and table.get(key) is kept:
            del table[key]

    def bind(entry):
        nonlocal mine
        mine = weakref.ref(entry)
        return entry

    return drop, bind


def _make_record(sources: tuple, scale: float, frozen: bool, value: torch.Tensor, graph, w_sq, drop=None) -> _OpRecord:
    """An :class:`_OpRecord` of ``value`` for ``sources`` (W, A, B) and, where ``graph`` is captured, its CUDA graph;
    ``drop``: the callback of the weak references to the sources."""
    weight, lora_A, lora_B = sources
    record = _OpRecord()
    record.refs = tuple(weakref.ref(t, drop) for t in sources)
    record.layout = _OpRecord._layout(weight, lora_A, lora_B, scale)
    record.pins = storage_pins(sources)
    record.value, record.inference = value, value.is_inference()
    record.state = _OpRecord._state(weight, lora_A, lora_B)
    captured = graph is not None and graph.graph is not None and not graph.failed
    record.graph = (graph.graph, graph.out, w_sq, graph.written) if captured else None
    record.graph_state = (settings(), frozen, _OpRecord._w_sq_state(weight, w_sq))
    return record


def eager_record(graph, weight, lora_A, lora_B, scale, w_sq, value) -> Optional[_OpRecord]:
    """A DoRA Linear's record of the training norm it has just taken from its norm graph (``dora_graph.NormGraph``,
    captured for these very ``W``, ``A``, ``B`` and ``||W||²`` operand): its next training forwards replay that graph
    after :meth:`_OpRecord.answer`'s few attribute reads, and its checkpoint recompute takes ``value`` back while
    the versions and the epoch hold, instead of the memos' keys and the graph's own checks (host time in every
    forward of a host-bound step). None where the graph is not captured or was not keyed on these tensors, and
    under ``PEFT_DORA_NORM_CACHE`` (whose reuse rules the record does not follow) or ``PEFT_DORA_NORM_BATCH``
    (whose batch computes the norms)."""
    env = settings()
    if graph.graph is None or graph.failed or env.norm_cache is not None or env.norm_batch:
        return None
    tensors = (weight, lora_A, lora_B) if w_sq is None else (weight, lora_A, lora_B, w_sq)
    if not same_objects(graph.refs, tensors):
        return None
    return _make_record((weight, lora_A, lora_B), float(scale), not weight.requires_grad, value, graph, w_sq)


class _QuantRecord:
    """:func:`eager_record` for a bitsandbytes quantized W (``dora_quant.QuantizedWeight``, a new wrapper in every
    forward): keyed on the tensors the wrapper stands for, the packed parameter and its scales (``sources``, objects
    the layer keeps until a requantization or merge replaces them), with A and B. A training forward replays the norm
    graph after one pass of checks, and its checkpoint recompute takes the forward's norm back, where the memos' path
    keys those five or six tensors three times per forward (the norm's memo, the kept ``||W||²``'s, the graph's) and
    once per recompute, each read of the packed parameter going through its Python ``__torch_function__``.

    The same rules as :class:`_OpRecord`'s eager record: the very objects, storages, data pointers, layout and
    dtypes, the scaling, the norm threshold and the settings it was made under; the kept norm while every version
    and the epoch hold (in the recompute only); a replay while the sources' versions and the merge epoch are those
    the graph's ``||W||²`` was computed at. Not made under FSDP2 (sharded sources, ``QuantizedWeight.versions``)."""

    __slots__ = ("refs", "layout", "value", "state", "inference", "graph", "graph_state", "pins")

    @staticmethod
    def _read(tensors: tuple, weight, scale) -> tuple:
        """(layout, state): what the graph was captured for, and the versions and epoch a kept norm is valid for."""
        with _NO_TORCH_FUNCTION():  # Params4bit's Python __torch_function__: a call per read
            layout = [(t.untyped_storage()._cdata, t.data_ptr(), t.shape, t.stride(), t.dtype) for t in tensors]
            state = (*versions(tensors), _epoch[0])
        return (layout, weight.shape, weight.dtype, scale, get_dora_norm_threshold_bytes()), state

    @staticmethod
    def _w_sq_state(state: tuple, sources: int, w_sq) -> Optional[tuple]:
        """What a kept ``||W||²`` is valid for (None: the graph reads none): the versions of the ``sources`` first
        tensors of ``state`` (W's packed parameter and scales) and the merge epoch."""
        return None if w_sq is None else (state[:sources], _merge_epoch[0])

    def answer(self, weight, lora_A, lora_B, scale, reuse, frozen, eager=True) -> Optional[torch.Tensor]:
        """The norm for this training forward or recompute, or None where the memos' path must answer (``reuse`` and
        ``frozen`` as :meth:`_OpRecord.answer` takes them: a quantized W never trains)."""
        if settings() is not self.graph_state[0] or type(weight).__name__ != "QuantizedWeight" or weight.versions:
            return None
        tensors = (*weight.sources, lora_A, lora_B)
        if not same_objects(self.refs, tensors):
            return None
        layout, state = self._read(tensors, weight, scale)
        if layout != self.layout:
            return None
        if torch._C._current_graph_task_id() != -1 and state == self.state:
            if not self.inference or torch.is_inference_mode_enabled():
                norm_counts["norm_reused"] += 1
                return self.value
        graph, out, w_sq, written = self.graph
        if self.graph_state[1:] != (frozen, self._w_sq_state(state, len(weight.sources), w_sq)):
            return None
        _replay_counted(graph, w_sq)
        value = hand_out(out, written, state[:-1] if w_sq is None else (*state[:-1], w_sq._version))
        self.value, self.state, self.inference = value, state, torch.is_inference_mode_enabled()
        return value


def eager_quant_record(graph, weight, lora_A, lora_B, scale, w_sq, value) -> Optional[_QuantRecord]:
    """:func:`eager_record` for a bitsandbytes quantized W (:class:`_QuantRecord`): None where the graph is not
    captured or not keyed on these tensors, under FSDP2, ``PEFT_DORA_NORM_CACHE`` or ``PEFT_DORA_NORM_BATCH``."""
    env = settings()
    if graph.graph is None or graph.failed or env.norm_cache is not None or env.norm_batch or weight.versions:
        return None
    tensors = (*weight.sources, lora_A, lora_B)
    if not same_objects(graph.refs, tensors if w_sq is None else (*tensors, w_sq)):
        return None
    record = _QuantRecord()
    record.refs = tuple(weakref.ref(t) for t in tensors)
    record.layout, record.state = _QuantRecord._read(tensors, weight, float(scale))
    record.pins = storage_pins(tensors)
    record.value, record.inference = value, value.is_inference()
    record.graph = (graph.graph, graph.out, w_sq, graph.written)
    record.graph_state = (env, True, _QuantRecord._w_sq_state(record.state, len(weight.sources), w_sq))
    return record


def _on_default_stream(t: torch.Tensor) -> bool:
    """Whether ``t``'s device runs on its default stream. Inductor's CUDA-graph trees (``mode="reduce-overhead"``)
    run a graph's first calls on a stream of their own with every allocation routed to their private pool, which
    must hold nothing but the graph's outputs afterwards, and replays do not run the op at all: a value kept there
    would break the pool and never be read."""
    if not t.is_cuda:
        return True
    index = t.get_device()
    # the streams' ids, without building two torch.cuda.Stream objects per call (a compiled step calls this op twice
    # per DoRA Linear, on the host's critical path of the forward)
    return torch._C._cuda_getCurrentStream(index)[0] == torch._C._cuda_getDefaultStream(index)[0]


def _weight_norm_op_fake(weight, lora_A, lora_B, scale, reuse, frozen):
    return weight.new_empty(weight.shape[0], dtype=_acc_dtype(weight))


_LIB.impl("dora_weight_norm", _weight_norm_op, "CompositeExplicitAutograd")
torch.library.register_fake("peft::dora_weight_norm", _weight_norm_op_fake, lib=_LIB)

# The norms of one compiled graph's DoRA Linears in one call (``batch_norm_ops`` puts it in place of their
# ``dora_weight_norm`` calls): the norms concatenated, each module's ``d_out`` floats in the order of the lists.
_LIB.define(
    "dora_weight_norms(Tensor[] weights, Tensor[] lora_As, Tensor[] lora_Bs, float[] scales, int[] reuse, "
    "bool[] frozen) -> Tensor"
)


def _check_batch(weights) -> None:
    if not weights:
        raise ValueError("peft::dora_weight_norms takes at least one (weight, lora_A, lora_B) triple")


def _weight_norms_op(weights, lora_As, lora_Bs, scales, reuse, frozen) -> torch.Tensor:
    """``dora_weight_norm`` for every triple, each computed, reused or replayed as that op does it, and one
    concatenation for the copies it would make: one op call, one allocation and one copy kernel per compiled graph
    instead of one of each per DoRA Linear (host time on a short step's critical path). The batch is on one device
    (``batch_norm_ops`` groups by it): its stream and capture state are asked once (per triple where a direct call
    mixes devices)."""
    _check_batch(weights)
    reusable = reuse.count(_REUSE_CODES["any"]) == len(reuse)
    first = (_on_default_stream(weights[0]), capturing(weights))
    # a kept batch first: its checks imply one device (storages and data pointers as kept, on one device)
    if reusable and first == (True, False):
        out = _KeptBatch.answer_for(weights, lora_As, lora_Bs, scales, frozen)
        if out is not None:
            return out
    streams = first if all(w.device == weights[0].device for w in weights) else None
    kept = reusable and streams == (True, False)
    if not kept and streams == (True, False) and weights[0].is_cuda:
        out = _BatchGraph.replay_for(weights, lora_As, lora_Bs, scales, reuse, frozen)
        if out is not None:
            return out
    out = torch.cat(
        [
            _weight_norm(*args, copy=False, streams=streams)
            for args in zip(weights, lora_As, lora_Bs, scales, reuse, frozen)
        ]
    )
    if kept:
        _KeptBatch.keep(weights, lora_As, lora_Bs, scales, frozen, out)
    return out


class _KeptBatch:
    """The norms a ``dora_weight_norms`` call returned where every triple may be reused across forwards (``reuse``
    2: eval forwards, frozen adapters), kept for the next call with the very same objects: one pass of checks over
    the batch's tensors instead of one :meth:`_OpRecord.answer` per triple (its lookup, ``holds``, ``_state`` and
    the concatenation of the kept values). On one H200 (8-layer Llama-8B shape, r = 16, 512 tokens, compiled under
    ``reduce-overhead``) the per-triple answers took 1.1 ms of host time per eval forward, ahead of the graph's
    launch (``benchmarks/results/profile/probe_compiled_pairs_ro_infer_18fd108.json``); on a CPU, DoRA's extra host
    time per module and compiled eval forward went from 22–42 to 17–30 µs (``benchmarks/host_compiled.py``, four
    alternating pairs, ``benchmarks/results/profile/host_compiled_kept_batch/``).

    The checks are the records' own, for every tensor: the same object, storage (pinned, so its address names it),
    data pointer, shape, strides and dtype; the same scales and ``frozen`` flags; the same version counters and
    optimizer-step/merge epoch; a value kept in inference mode is handed out only in inference mode. A change of
    any keeps the batch aside: the triples answer one by one, and the batch is kept anew from their answer.
    Callers get a copy (the compiled graph may write into the op's output)."""

    __slots__ = ("refs", "layout", "scales", "frozen", "state", "inference", "value", "pins", "__weakref__")

    @staticmethod
    def _layout(flat: list) -> list:
        return [(t.untyped_storage()._cdata, t.data_ptr(), t.shape, t.stride(), t.dtype) for t in flat]

    @staticmethod
    def _state(flat: list) -> tuple:
        return versions(flat), _epoch[0]

    @staticmethod
    def _key(weights, lora_Bs) -> tuple:
        return id(weights[0]), id(lora_Bs[-1]), len(weights)

    @staticmethod
    def answer_for(weights, lora_As, lora_Bs, scales, frozen) -> Optional[torch.Tensor]:
        """The kept norms of exactly these triples, as a new tensor, or None (the caller's triples answer)."""
        batch = _kept_batches.get(_KeptBatch._key(weights, lora_Bs))
        if batch is None:
            return None
        flat = [*weights, *lora_As, *lora_Bs]
        if not same_objects(batch.refs, flat) or batch.scales != scales or batch.frozen != frozen:
            return None
        if batch._state(flat) != batch.state or batch._layout(flat) != batch.layout:
            return None
        if batch.inference and not torch.is_inference_mode_enabled():
            return None
        norm_counts["norm_reused"] += len(weights)
        return batch.value.clone()

    @staticmethod
    def keep(weights, lora_As, lora_Bs, scales, frozen, out: torch.Tensor) -> None:
        """Keep ``out``, the triples' own answer just now, for the next call with these objects (a copy: the caller's
        may be written to). Only for plain tensors and parameters, whose every change shows in the checks."""
        flat = [*weights, *lora_As, *lora_Bs]
        if not all(type(t) in (torch.Tensor, nn.Parameter) and not t.is_inference() for t in flat):
            return
        key = _KeptBatch._key(weights, lora_Bs)
        drop, bind = _entry_dropper(_kept_batches, key)
        batch = _KeptBatch()
        batch.refs = tuple(weakref.ref(t, drop) for t in flat)
        batch.pins = storage_pins(flat)
        batch.layout, batch.state = _KeptBatch._layout(flat), _KeptBatch._state(flat)
        batch.scales, batch.frozen = scales[:], frozen[:]  # as the op receives them (lists), compared as such
        batch.value = out.clone()
        batch.inference = batch.value.is_inference()
        _kept_batches[key] = bind(batch)


_kept_batches: dict = {}  # (id of the first W, id of the last B, triples) -> _KeptBatch


class _BatchGraph:
    """One CUDA graph for the training norms of a ``dora_weight_norms`` call whose every triple would replay its own
    record's norm graph (:meth:`_OpRecord.answer`): one graph launch per compiled forward instead of one per DoRA
    Linear (each a ``cudaGraphLaunch`` and the Python around it, on a short compiled step's critical path).

    It is captured, on the first such call, from the records themselves: each triple's norm computed as its graph
    computes it (``factored_row_norm`` with the record's ``||W||²`` operand, under the settings the record checks),
    written into its slice of one output buffer (the caching allocator's; temporaries go to the device's shared norm
    pool, as the layers' graphs do, see ``dora_graph``). It is replayed only while every triple's record is the very
    record it was captured from (weak references: a record made anew, after a change of object, storage, layout,
    scaling, settings or ``||W||²``, is another object, and the batch captures again) and would replay now
    (:meth:`_OpRecord.holds`, :meth:`_OpRecord.graph_current`). The records then keep their slices, as their own
    replays keep their graphs' outputs, for a checkpoint's recompute. Callers get a copy of the buffer."""

    __slots__ = ("refs", "graph", "views", "__weakref__")

    def __init__(self, records: list, drop) -> None:
        self.refs = tuple(weakref.ref(record, drop) for record in records)
        self.graph, self.views = NormGraph(), None

    def current(self, records: list) -> bool:
        return len(self.refs) == len(records) and all(ref() is r for ref, r in zip(self.refs, records))

    @staticmethod
    def replay_for(weights, lora_As, lora_Bs, scales, reuse, frozen) -> Optional[torch.Tensor]:
        """The batch's norms from one graph launch, or None where any triple would not replay its record's graph
        (no record, reuse other than a training forward's, the backward, a change the record does not match) or the
        capture failed: the caller then answers triple by triple."""
        if len(weights) < 2 or torch._C._current_graph_task_id() != -1:
            return None
        records = []
        for weight, lora_A, lora_B, scale, code, grad_free in zip(weights, lora_As, lora_Bs, scales, reuse, frozen):
            record = _op_records.get((id(weight), id(lora_A), id(lora_B)))
            if code != _REUSE_CODES["recompute"] or record is None:
                return None
            if not record.holds(weight, lora_A, lora_B, scale) or not record.graph_current(weight, grad_free):
                return None
            records.append(record)
        key = tuple(map(id, records))
        batch = _batch_graphs.get(key)
        if batch is None or not batch.current(records):
            batch = _BatchGraph._made(key, records)
            if not batch._capture(records, weights, lora_As, lora_Bs, scales):
                return None
        elif batch.graph.failed:
            return None
        else:
            batch.graph.graph.replay()
            graph_counts["replayed"] += 1
        graph_counts["batch_replayed"] += 1
        for record, view, weight, lora_A, lora_B in zip(records, batch.views, weights, lora_As, lora_Bs):
            _count_replayed_norm(record.graph[2])
            record.replayed_into(view, weight, lora_A, lora_B)
        return batch.graph.out.clone()

    @staticmethod
    def _made(key: tuple, records: list) -> _BatchGraph:
        """A new batch for ``records`` in ``_batch_graphs``, dropped from there once one of them dies."""
        drop, bind = _entry_dropper(_batch_graphs, key)
        batch = _batch_graphs[key] = bind(_BatchGraph(records, drop))
        return batch

    def _capture(self, records, weights, lora_As, lora_Bs, scales) -> bool:
        operands = [
            (weight, lora_A, lora_B, float(scale), record.graph[2])
            for record, weight, lora_A, lora_B, scale in zip(records, weights, lora_As, lora_Bs, scales)
        ]

        def compute() -> torch.Tensor:
            return torch.cat(
                [
                    factored_row_norm(weight, lora_A, lora_B, scale, w_sq=w_sq)
                    for weight, lora_A, lora_B, scale, w_sq in operands
                ]
            )

        out = self.graph._capture(weights[0].device, compute)  # captured, and replayed once
        if out is None:
            return False
        sizes = [weight.shape[0] for weight in weights]
        self.views = out.split(sizes)
        return True


_batch_graphs: dict = {}  # the ids of a batch's records, in order -> _BatchGraph


def _weight_norms_op_fake(weights, lora_As, lora_Bs, scales, reuse, frozen):
    _check_batch(weights)
    return weights[0].new_empty(sum(w.shape[0] for w in weights), dtype=_acc_dtype(weights[0]))


_LIB.impl("dora_weight_norms", _weight_norms_op, "CompositeExplicitAutograd")
torch.library.register_fake("peft::dora_weight_norms", _weight_norms_op_fake, lib=_LIB)

# The same op, tagged for Inductor to run outside its CUDA graphs (``mode="reduce-overhead"``): ``batch_norm_ops``
# puts it in place of ``dora_weight_norms`` where Inductor cuts a graph's CUDA graphs around such ops
# (``graph_partition``). Inside a CUDA graph every replay recomputes every norm, reading every ``W``; outside, the op
# answers from its records as under ``mode="default"``: the kept norms in eval forwards, one batch graph launch in
# training ones. Where Inductor does not partition, a tagged op would take CUDA graphs off the whole graph instead.
_UNCAPTURED_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else None
if _UNCAPTURED_TAGS:
    _LIB.define(
        "dora_weight_norms_uncaptured(Tensor[] weights, Tensor[] lora_As, Tensor[] lora_Bs, float[] scales, "
        "int[] reuse, bool[] frozen) -> Tensor",
        tags=_UNCAPTURED_TAGS,
    )
    _LIB.impl("dora_weight_norms_uncaptured", _weight_norms_op, "CompositeExplicitAutograd")
    torch.library.register_fake("peft::dora_weight_norms_uncaptured", _weight_norms_op_fake, lib=_LIB)


def _batched_norms_op(inductor_config):
    """The op ``batch_norm_ops`` puts in a graph: the one Inductor runs outside its CUDA graphs where it compiles
    with them and cuts them around such ops, else ``dora_weight_norms``."""
    partitioned = getattr(inductor_config.triton, "cudagraphs", False) and getattr(
        inductor_config, "graph_partition", False
    )
    if partitioned and _UNCAPTURED_TAGS:
        return torch.ops.peft.dora_weight_norms_uncaptured.default
    return torch.ops.peft.dora_weight_norms.default


def compiled_weight_norm(layer: nn.Module, weight, lora_A, lora_B, scale) -> torch.Tensor:
    """Under torch.compile: the norm of ``weight + scale·lora_B·lora_A`` (2-D operands as ``factored_row_norm``
    takes them) through ``peft::dora_weight_norm``, with the reuse ``layer`` allows in this forward (none for
    sharded, quantized or inference tensors, as in eager forwards)."""
    sources = (weight, lora_A, lora_B)
    reuse = _REUSE_CODES[reuse_mode(layer, sources)] if identity_tracked(sources, inference=False) else 0
    return torch.ops.peft.dora_weight_norm.default(
        weight.detach(), lora_A.detach(), lora_B.detach(), float(scale), reuse, not weight.requires_grad
    )


_SAVE_NORM_PASS_ID = "peft-dora-save-norm-v1"


def save_norm_in_checkpoints(graph) -> None:
    """A joint-graph pass: the norm op's output is saved for the backward where a checkpointed region only *prefers*
    recomputing it (plain activation checkpointing; a selective policy's own choice for the op stands). Inductor's
    partitioner otherwise recomputes everything in such a region in the backward, the norm op too: a second call
    per DoRA Linear and step for a vector the forward has just computed (Python on the host's critical path under
    ``mode="default"``; under ``"reduce-overhead"`` the whole norm again, ``W`` read and all, inside the captured
    graph). Saved instead: ``d_out`` floats per module from the forward to the backward, the value the recompute
    would have returned (its op call answers from the forward's memo)."""
    from torch.utils.checkpoint import CheckpointPolicy

    op = torch.ops.peft.dora_weight_norm.default
    for node in graph.nodes:
        if node.op == "call_function" and node.target is op:
            if node.meta.get("recompute") == CheckpointPolicy.PREFER_RECOMPUTE:
                node.meta["recompute"] = CheckpointPolicy.MUST_SAVE


_BATCH_NORMS_PASS_ID = "peft-dora-batch-norms-v1"


def batch_norm_ops(graph) -> None:
    """A post-grad pass: a compiled graph's ``dora_weight_norm`` calls whose tensors are the graph's inputs (the
    parameters, as Inductor passes them; not, say, weights gathered inside the graph) become one
    ``dora_weight_norms`` call per device and output dtype, at the first of them, and each former output a slice of
    its result. Each norm is computed as before, by the same rules; in a short compiled step the per-module op
    calls, allocations and copies were host time on the critical path (one H200, 8-layer Llama-8B shape, r = 16,
    512 tokens: ~40 µs per module and eval forward under cProfile). The graph's norms are then all computed
    before its first layer runs: they read parameters only. Where Inductor compiles CUDA graphs and cuts them around
    ops tagged for it (``mode="reduce-overhead"``, ``graph_partition``), the batch, even of one call, is
    ``dora_weight_norms_uncaptured``, right after the graph's inputs: it runs ahead of the graph's one CUDA graph, not
    inside it (:func:`_batched_norms_op`)."""
    from torch._guards import detect_fake_mode
    from torch._inductor import config as inductor_config

    op = torch.ops.peft.dora_weight_norm.default
    batched_op = _batched_norms_op(inductor_config)
    single = batched_op is not torch.ops.peft.dora_weight_norms.default  # a batch of one is worth it
    groups: dict = {}
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not op or len(node.args) != 6 or node.kwargs:
            continue
        value = node.meta.get("val")
        tensors = node.args[:3]
        if not isinstance(value, torch.Tensor) or not isinstance(value.shape[0], int):
            continue  # no fake value to build the batch's from, or a symbolic size (parameters have none)
        if all(getattr(t, "op", None) == "placeholder" for t in tensors):
            groups.setdefault((value.device, value.dtype), []).append(node)
    first = next(node for node in graph.nodes if node.op != "placeholder")  # the graph's first node past its inputs
    for nodes in groups.values():
        values = [node.meta["val"] for node in nodes]
        fake_mode = detect_fake_mode(values)
        if len(nodes) < (1 if single else 2) or fake_mode is None:
            continue
        with fake_mode:
            batched_value = torch.cat(values)
            offsets = [0]
            for value in values:
                offsets.append(offsets[-1] + value.shape[0])
            pieces = [batched_value[start:end] for start, end in zip(offsets, offsets[1:])]
        with graph.inserting_before(first):  # right after the graph's inputs, the only nodes it reads
            columns = tuple(list(column) for column in zip(*(node.args for node in nodes)))
            batched = graph.call_function(batched_op, columns)
            batched.meta["val"] = batched_value
            for node, start, end, piece_value in zip(nodes, offsets, offsets[1:], pieces):
                piece = graph.call_function(torch.ops.aten.slice.Tensor, (batched, 0, start, end))
                piece.meta["val"] = piece_value
                node.replace_all_uses_with(piece)
        for node in nodes:
            graph.erase_node(node)


def set_norm_passes() -> None:
    """Set Inductor's passes for the norm op where none is set: :func:`save_norm_in_checkpoints` as the joint-graph
    pass (``joint_custom_pre_pass``, run before the partitioner) and :func:`batch_norm_ops` as the post-grad one
    (``post_grad_custom_post_pass``, run on each partitioned graph). When a DoRA layer is made, in eager code (Dynamo
    would trace this, not run it). The passes touch only the norm op's nodes; a backend other than Inductor never
    reads these settings. A pass the user has set in either place stays alone (the op is then recomputed in
    checkpointed regions, or called once per module, as before), and one the user sets later replaces ours."""
    try:
        from torch._inductor import config as inductor_config

        missing = [
            name
            for name in ("joint_custom_pre_pass", "post_grad_custom_post_pass")
            if getattr(inductor_config, name) is None
        ]
    except (ImportError, AttributeError):  # an optional speed-up: making a DoRA layer never fails for it
        return
    passes = _norm_pass_types()
    if passes is None:
        return
    for name in missing:
        setattr(inductor_config, name, passes[name]())


@functools.cache
def _norm_pass_types():
    """:func:`save_norm_in_checkpoints` and :func:`batch_norm_ops` as Inductor ``CustomGraphPass`` types (with ids
    for Inductor's caches), by the setting each goes to, or None where this Inductor has none."""
    try:
        from torch._inductor.custom_graph_pass import CustomGraphPass
    except ImportError:
        return None

    class SaveNormPass(CustomGraphPass):
        def __call__(self, graph) -> None:
            save_norm_in_checkpoints(graph)

        def uuid(self) -> str:
            return _SAVE_NORM_PASS_ID

    class BatchNormsPass(CustomGraphPass):
        def __call__(self, graph) -> None:
            batch_norm_ops(graph)

        def uuid(self) -> str:
            return _BATCH_NORMS_PASS_ID

    return {"joint_custom_pre_pass": SaveNormPass, "post_grad_custom_post_pass": BatchNormsPass}
