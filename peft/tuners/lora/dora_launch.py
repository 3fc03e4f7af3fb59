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
"""Whether Triton runs here (``HAS_TRITON``, ``INTERPRET``), and kernel launches at about half of
``kernel[grid](...)``'s host time (:class:`Launcher`); also the device switch for tensors off the current GPU.

A DoRA layer launches a few small kernels per forward and backward, and on real models the step is host-bound, so
launch overhead is step time. ``JITFunction.run`` spends 13–21 µs of host time per launch on the H200 machines
(Triton 3.6): it binds and specialises every argument, hashes a cache key and builds launch metadata, around a
~6 µs driver launch. :class:`Launcher` keeps, per launch signature, the compiled kernel that Triton's own first
launch returned, and calls it directly afterwards (9 µs per launch measured).

The signature is everything Triton specialises on, or more: every integer argument by value (Triton keys on
``== 1``, divisibility by 16 and the integer width), every tensor by dtype and its pointer's alignment to 16 bytes,
the device, and the constexpr and launch options (keyword arguments). Float arguments are always fp32 to Triton, so
only their type enters the key. A signature the cache has not seen goes through ``kernel[grid](...)``, which compiles
or finds the kernel and launches it; so does every launch under ``TRITON_INTERPRET=1``, while a launch hook is set
(profilers such as Proton), or after the direct call has failed once (a Triton whose launcher API differs).

Call sites pass the kernel's runtime parameters positionally and its constexpr parameters by keyword, all of them,
in the kernel's own order: the direct call needs the complete argument list.
"""

from __future__ import annotations

import importlib.util
import os

import torch


HAS_TRITON = importlib.util.find_spec("triton") is not None
# Triton decides at decoration time whether a kernel is interpreted, so the variable is read once, at import; the
# kernel modules (dora_fused, dora_norm_triton) take both flags from here.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_MAX_ENTRIES = 4096  # signatures kept per kernel; the cache is cleared (not evicted one by one) past this

_direct = [HAS_TRITON and not INTERPRET]  # switched off for the process when a direct call fails

_TRITON_VERSION: tuple = ()
if _direct[0]:
    try:
        import triton
        from triton import knobs

        _TRITON_VERSION = tuple(int(p) for p in triton.__version__.split(".")[:2] if p.isdigit())
    except ImportError:  # a Triton without `knobs` (before 3.4) keeps its own launch path
        _direct[0] = False


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for launch grids (``triton.cdiv`` is a constexpr function: slower to call from the host)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``): block sizes and launch-policy buckets."""
    return 1 << max(0, n - 1).bit_length()


def device_switch(t: torch.Tensor):
    """``torch.cuda.device`` of ``t`` where ``t`` is a CUDA tensor off the current device, else None: Triton launches
    on the current device and its current stream (a model split over GPUs runs layers on cuda:1 while cuda:0 is
    current). None rather than a null context, so a hot path enters nothing where no switch is needed."""
    if t.is_cuda:
        index = t.get_device()
        if index != torch.cuda.current_device():
            return torch.cuda.device(index)
    return None


def _idle(hook) -> bool:
    """Whether a launch hook does nothing: unset, or a ``HookChain`` with no hook in it (Triton 3.5+ always has
    one). Anything else counts as a hook to honour, through Triton's own launch."""
    return hook is None or (type(hook).__name__ == "HookChain" and not getattr(hook, "calls", True))


def _signature(args: tuple, _tensor=torch.Tensor) -> tuple:
    """What the runtime arguments contribute to the cache key: integers by value, tensors by dtype and pointer
    alignment, anything else (floats, None) by type. (A plain loop: a quarter faster than a generator here.)"""
    key = []
    add = key.append
    for a in args:
        kind = type(a)
        if kind is int:
            add(a)
        elif isinstance(a, _tensor):
            add(a.dtype)
            add(a.data_ptr() & 15)
        else:
            add(kind)
    return tuple(key)


def _entry(kernel, tail: tuple) -> tuple:
    """(call, function, leading arguments, constexpr tail) for launching a compiled kernel.

    Triton 3.6's ``kernel.run`` is a Python ``CudaLauncher`` whose ``__call__`` allocates no scratch memory for
    kernels that need none and forwards everything to the compiled C ``launch``; for those kernels that function is
    called directly (verified bitwise against Triton's own launches, ``test_dora_launch_gpu.py``). Other versions and
    kernels with scratch memory go through ``kernel.run``."""
    run = kernel.run
    if (
        _TRITON_VERSION[:2] == (3, 6) and type(run).__name__ == "CudaLauncher"
        and getattr(run, "global_scratch_size", 1) == 0 and getattr(run, "profile_scratch_size", 1) == 0
        and callable(getattr(run, "launch", None))
    ):  # fmt: skip
        lead = (run.launch_cooperative_grid, run.launch_pdl, None, None, kernel.packed_metadata, None, None, None)
        return run.launch, kernel.function, lead, tail
    return run, kernel.function, (kernel.packed_metadata, None, None, None), tail


def _goes_direct() -> bool:
    """Whether a launch may call the compiled kernel directly: direct calls work in this process and no launch
    hook is set."""
    return _direct[0] and _idle(knobs.runtime.launch_enter_hook) and _idle(knobs.runtime.launch_exit_hook)


class Launcher:
    """``Launcher(jit_fn)[grid](*runtime_args, **constexprs_and_options)``, launched directly where it can be."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self._cache: dict = {}
        params = getattr(fn, "params", None)
        self._names = None if params is None else tuple(p.name for p in params)

    def __getitem__(self, grid):
        return lambda *args, **meta: self.launch(grid, args, meta)

    def launch(self, grid: tuple, args: tuple, meta: dict):
        """Launch; return the token for :meth:`repeat` of this signature, or None where launches do not go direct."""
        if not _goes_direct():
            self.fn[grid](*args, **meta)
            return None
        device = torch.cuda.current_device()
        key = (device, _signature(args), *meta.items())
        entry = self._cache.get(key)
        if entry is None:
            kernel = self.fn[grid](*args, **meta)
            tail = self._constexpr_tail(len(args), meta)
            if kernel is None or tail is None:
                return None
            if len(self._cache) >= _MAX_ENTRIES:
                self._cache.clear()
            entry = self._cache[key] = _entry(kernel, tail)
        else:
            self._call(entry, grid, device, args, meta)
        return (entry, device) if _direct[0] else None

    def _call(self, entry, grid: tuple, device: int, args: tuple, meta: dict) -> None:
        call, function, lead, tail = entry
        n = len(grid)
        try:
            call(
                grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1,
                torch._C._cuda_getCurrentRawStream(device), function, *lead, *args, *tail,
            )  # fmt: skip
        except TypeError:
            # The launcher's calling convention is not the one this module knows: Triton's own path from now on.
            _direct[0] = False
            self.fn[grid](*args, **meta)

    def repeat(self, token, grid: tuple, args: tuple, meta: dict) -> None:
        """Launch ``args`` whose signature is the one ``token`` (from :meth:`launch`) was made for: every integer
        argument equal, every tensor of the same dtype and 16-byte alignment, on the same device (the caller's
        guarantee: nothing is checked here). Launch hooks and a failed direct call take Triton's own path, as in
        :meth:`launch`."""
        if token is None or not _goes_direct():
            self.fn[grid](*args, **meta)
        elif torch.cuda.current_device() != token[1]:
            self.launch(grid, args, meta)
        else:
            self._call(token[0], grid, token[1], args, meta)

    def _constexpr_tail(self, n_args: int, meta: dict):
        """The values of the parameters after the positional ones, in the kernel's order, or None if one is missing
        (a parameter left to its default: then every launch of this signature takes Triton's path)."""
        if self._names is None:
            return None
        rest = self._names[n_args:]
        if any(name not in meta for name in rest):
            return None
        return tuple(meta[name] for name in rest)
