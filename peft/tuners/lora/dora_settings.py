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
"""DoRA's runtime switches: the ``PEFT_DORA_*`` environment variables, read once into one frozen snapshot
(``current()``); ``_invalidate_fused_cache()`` is the one reset (tests, or after changing a variable at run time)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from dataclasses import dataclass
from typing import Optional


MB = 1 << 20
DROPOUT_MODES = ("exact", "branch")  # PEFT_DORA_DROPOUT; the first is the default
_NORM_CHUNK_MB_RANGE = (16, 65536)


def _parse_tristate(name: str) -> Optional[bool]:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    value = raw.strip().lower()
    if value in ("1", "true"):
        return True
    if value in ("0", "false"):
        return False
    raise ValueError(f"{name}={raw!r} is not valid: use 1/true (force on), 0/false (off), or leave it unset (auto)")


def _parse_choice(name: str, choices: tuple) -> str:
    """The variable's value among ``choices`` (case-insensitive); unset or empty is the first choice."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return choices[0]
    value = raw.strip().lower()
    if value not in choices:
        raise ValueError(f"{name}={raw!r} is not valid: use one of {', '.join(choices)} (unset: {choices[0]})")
    return value


def _parse_mb(name: str, default: int, low: int, high: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer number of MB") from None
    if not low <= value <= high:
        raise ValueError(f"{name}={value} is out of range: it must lie in [{low}, {high}] MB")
    return value


@dataclass(frozen=True)
class _DoraEnv:
    fused: Optional[bool]  # PEFT_DORA_FUSED: None = auto (Triton kernels when available)
    fused_backward: Optional[bool]  # PEFT_DORA_FUSED_BACKWARD: None = auto (above the crossover)
    norm_cache: Optional[bool]  # PEFT_DORA_NORM_CACHE: None = in checkpoint recompute only, True = across forwards
    norm_kernel: Optional[bool]  # PEFT_DORA_NORM_KERNEL: None = auto (where it is faster), True = wherever it runs
    norm_graph: Optional[bool]  # PEFT_DORA_NORM_GRAPH: None/True = training norms replayed as CUDA graphs, False = not
    norm_batch: Optional[bool]  # PEFT_DORA_NORM_BATCH: True = a device's training norms computed together per pass
    sharded_norm: Optional[bool]  # PEFT_DORA_SHARDED_NORM: None/True = FSDP2 ranks compute their rows, False = whole
    step_norms: Optional[bool]  # PEFT_DORA_STEP_NORMS: True = FSDP2 sharded norms computed in the optimizer-step hook
    norm_chunk_mb: int  # PEFT_DORA_NORM_CHUNK_MB
    fwd_chunk_mb: int  # PEFT_DORA_FWD_CHUNK_MB
    dropout: str  # PEFT_DORA_DROPOUT: "exact" (upstream's semantics) or "branch" (on the LoRA branch only)
    # not environment variables: tests switch these off (``override``) to compare with the paths they replace
    one_node_branch: bool = True  # lora_B inside the training output's node; off: separate LoRA-branch nodes
    decode_kernels: bool = True  # the decode launches; off: the small forward's matmuls and PyTorch ops

    @classmethod
    def from_environ(cls) -> "_DoraEnv":
        return cls(
            fused=_parse_tristate("PEFT_DORA_FUSED"),
            fused_backward=_parse_tristate("PEFT_DORA_FUSED_BACKWARD"),
            norm_cache=_parse_tristate("PEFT_DORA_NORM_CACHE"),
            norm_kernel=_parse_tristate("PEFT_DORA_NORM_KERNEL"),
            norm_graph=_parse_tristate("PEFT_DORA_NORM_GRAPH"),
            norm_batch=_parse_tristate("PEFT_DORA_NORM_BATCH"),
            sharded_norm=_parse_tristate("PEFT_DORA_SHARDED_NORM"),
            step_norms=_parse_tristate("PEFT_DORA_STEP_NORMS"),
            norm_chunk_mb=_parse_mb("PEFT_DORA_NORM_CHUNK_MB", 256, *_NORM_CHUNK_MB_RANGE),
            fwd_chunk_mb=_parse_mb("PEFT_DORA_FWD_CHUNK_MB", 256, 1, 1 << 20),
            dropout=_parse_choice("PEFT_DORA_DROPOUT", DROPOUT_MODES),
        )


_env_snapshot: Optional[_DoraEnv] = None
_env_lock = threading.Lock()
_overrides: dict = {}  # fields set by `override`, over what the environment says


_PLAIN_FIELDS = {"fused": False, "norm_cache": False, "norm_kernel": False, "norm_graph": False, "norm_batch": False}
_plain = [0, None]  # how many ``plain()`` blocks are running, and their snapshot


def current() -> _DoraEnv:
    """The settings in force: the snapshot of ``PEFT_DORA_*`` (and ``override`` fields), read on first use; inside
    ``plain()``, that snapshot with DoRA's kernels and reuse off."""
    if _plain[0]:
        return _plain[1]
    snapshot = _env_snapshot  # one read of the global: the hot path takes no lock
    if snapshot is None:
        snapshot = _load_env()
    return snapshot


def _load_env() -> _DoraEnv:
    global _env_snapshot
    with _env_lock:
        if _env_snapshot is None:
            _env_snapshot = dataclasses.replace(_DoraEnv.from_environ(), **_overrides)
        return _env_snapshot


def _invalidate_fused_cache() -> None:
    """Forget the cached environment (tests, or after changing ``PEFT_DORA_*`` at run time)."""
    global _env_snapshot
    with _env_lock:
        _env_snapshot = None


@contextlib.contextmanager
def override(**fields):
    """Set snapshot fields (e.g. ``decode_kernels=False``) for the duration of a block, over the environment; every
    snapshot taken inside it carries them, also after ``_invalidate_fused_cache()``. For tests."""
    unknown = set(fields) - {f.name for f in dataclasses.fields(_DoraEnv)}
    if unknown:
        raise TypeError(f"no DoRA settings named {sorted(unknown)}")
    global _overrides
    before = _overrides
    _overrides = {**before, **fields}
    _invalidate_fused_cache()
    try:
        yield
    finally:
        _overrides = before
        _invalidate_fused_cache()


@contextlib.contextmanager
def plain():
    """DoRA's Triton kernels, norm graphs and norm reuse off for the block, whatever the environment says: each
    forward computes its norm afresh with PyTorch ops and composes eagerly, upstream's path. For forwards under
    ``torch.func`` transforms (``grad``, ``vmap``, ``functional_call`` inside them), whose wrapped tensors have no
    storage for a memo's key or a kernel's pointer. A count, not per thread: another thread's forwards meanwhile take
    the same path (slower, never wrong)."""
    snapshot = dataclasses.replace(current(), **_PLAIN_FIELDS)
    with _env_lock:
        if _plain[0] == 0:
            _plain[1] = snapshot
        _plain[0] += 1
    try:
        yield
    finally:
        with _env_lock:
            _plain[0] -= 1


def set_dora_norm_threshold_mb(mb: int) -> None:
    """Set the norm's working-set budget (``PEFT_DORA_NORM_CHUNK_MB``), an integer number of MB in [16, 65536]."""
    low, high = _NORM_CHUNK_MB_RANGE
    if isinstance(mb, bool) or not isinstance(mb, int):
        raise ValueError(f"the DoRA norm threshold must be an integer number of MB, got {mb!r}")
    if not low <= mb <= high:
        raise ValueError(f"the DoRA norm threshold must lie in [{low}, {high}] MB, got {mb}")
    os.environ["PEFT_DORA_NORM_CHUNK_MB"] = str(mb)
    _invalidate_fused_cache()


def get_dora_norm_threshold_mb() -> int:
    """The norm's working-set budget in MB."""
    return current().norm_chunk_mb


def get_dora_norm_threshold_bytes() -> int:
    """The norm's working-set budget in bytes."""
    return current().norm_chunk_mb * MB
