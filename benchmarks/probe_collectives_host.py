"""Host time per call of the small collectives and ops the FSDP2 sharded norm issues, on the GPU machine's host.

Under FSDP2 every unit (decoder layer) of a DoRA model issues per step one all-gather of its DoRA Linears' norm rows
(``dora_dist.gather_rows``: a ``cat`` of the rows, the output buffer, ``all_gather_into_tensor``, one
``split_with_sizes_copy`` into a buffer per norm), and the optimizer step hook one scalar all-reduce (the magnitudes'
zero test). cProfile puts those calls at several hundred µs each, which would make them a large part of DoRA's extra
host time at the FSDP2 benchmark's host-bound point; cProfile inflates small calls, so this times them plainly:
``--calls`` calls of each, one ``perf_counter`` pair per call, no sync inside the loop, the GPU kept busy behind the
host (a few large GEMMs queued every 50 calls, as in a step's middle), median µs per call on the first process.
The same for a small ``mm`` (a launch the training node makes) and the allocations, for scale.

    torchrun --nproc_per_node 2 benchmarks/probe_collectives_host.py --out $OUT/probe_collectives_host.json

``--device cpu`` runs it with gloo on CPU tensors (a smoke run: the numbers are not the GPU host's).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist


NORMS = 7  # a Llama decoder layer's DoRA Linears: one unit's norms in one all-gather
ROWS = 2048  # rows of each norm per process (d_out 4096 over two processes)


def probes(device: torch.device, world: int) -> dict:
    """name -> the call to time."""
    group = dist.group.WORLD
    send = torch.randn(NORMS * ROWS, device=device)
    out = torch.empty(world * send.numel(), device=device)
    flag = torch.zeros((), device=device)
    chunks = [ROWS] * NORMS
    rows = [out.new_empty(world, c) for c in chunks]
    one = out.new_empty(world * sum(chunks))
    small = torch.randn(64, 64, device=device)
    calls = {
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(out, send, group=group),
        "all_reduce_scalar_max": lambda: dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group),
        f"split_with_sizes_copy_{NORMS}": lambda: torch.split_with_sizes_copy(
            out.view(world, -1), chunks, dim=1, out=rows
        ),
        f"new_empty_x{NORMS}": lambda: [out.new_empty(world, c) for c in chunks],
        "new_empty_x1": lambda: out.new_empty(world * sum(chunks)),
        "views_of_one_buffer": lambda: [
            one[i * world * ROWS : (i + 1) * world * ROWS].view(world, ROWS) for i in range(NORMS)
        ],
        f"cat_{NORMS}": lambda: torch.cat([send[:ROWS]] * NORMS),
        "mm_64": lambda: torch.mm(small, small),
    }
    if device.type == "cuda":
        calls["empty_pinned_scalar"] = lambda: torch.empty((), dtype=torch.bool, pin_memory=True)
    return calls


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def time_calls(fn, calls: int, device: torch.device, busy=None) -> float:
    """Median host µs of one call of ``fn`` over ``calls`` calls (after 10 untimed), the GPU kept busy behind."""
    for _ in range(10):
        fn()
    _sync(device)
    samples = []
    for i in range(calls):
        if busy is not None and i % 50 == 0:
            busy()
        t = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t) * 1e6)
    _sync(device)
    return round(statistics.median(samples), 1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = torch.device("cuda", torch.cuda.current_device())
        big = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)

        def busy():
            for _ in range(20):
                big @ big
    else:
        device, busy = torch.device("cpu"), None
    medians = {name: time_calls(fn, args.calls, device, busy) for name, fn in probes(device, world).items()}
    if rank == 0:
        doc = {
            "kind": "probe_collectives_host",
            "env": {
                "device": args.device,
                "gpu": torch.cuda.get_device_name(device) if cuda else None,
                "torch": torch.__version__,
                "python": platform.python_version(),
                "world": world,
            },
            "config": {"calls": args.calls, "norms": NORMS, "rows_per_process": ROWS},
            "host_us_per_call_median": medians,
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        print(json.dumps(medians))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
