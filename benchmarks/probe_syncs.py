"""Where the host waits on the GPU in a warmed-up QDoRA step: every host-device sync of one training step and one
eval forward, with the Python frames that made it, for a QDoRA adapter and its QLoRA twin on one quantized
Llama-8B-shaped base (``qdora_worker``'s model and seeding).

A sync in a host-bound step stalls the issue of everything after it until the GPU has drained, so one sync more than
QLoRA's can cost more than its own microseconds. ``probe_qdora_infer_host.py`` counted one more in an unwarmed eval
forward; this takes each side's fourth step (three warm-ups) under ``torch.cuda.set_sync_debug_mode("warn")`` and
keeps each warning's stack (frames of peft, bitsandbytes, transformers and torch's nn modules).

    PYTHONPATH=<ours> python benchmarks/probe_syncs.py --quant nf4 --seq 1024 --out $OUT/probe_syncs.json
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
import warnings
from pathlib import Path

import torch


sys.path.insert(0, str(Path(__file__).resolve().parent))
import qdora_worker as qw  # noqa: E402
from profile_qdora import quantized_base  # noqa: E402


KEEP = ("/peft/", "/bitsandbytes/", "/transformers/", "/torch/nn/", "/benchmarks/")


def frames() -> list:
    """The caller's stack as ``package/file.py:line(function)``, innermost last, our and the libraries' frames only."""
    out = []
    for f in traceback.extract_stack()[:-2]:
        path = f.filename.replace("\\", "/")
        hit = next((k for k in KEEP if k in path), None)
        if hit is not None:
            out.append(f"{path[path.rindex(hit) + 1 :]}:{f.lineno}({f.name})")
    return out[-8:]


def synced(step) -> list:
    """The syncs of one call of ``step``: each warning's message head and the frames that made it."""
    found = []

    def keep(message, category, filename, lineno, file=None, line=None):
        if "called a synchronizing" in str(message):  # not the mode's one-time "prototype feature" notice
            found.append({"message": str(message).splitlines()[0][:120], "frames": frames()})

    with warnings.catch_warnings():  # restores warnings.showwarning on the way out
        warnings.simplefilter("always")
        warnings.showwarning = keep
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quant", default="nf4")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    import peft

    device = torch.device("cuda")
    base, ids = quantized_base(args.quant, args.layers, args.seq, device)
    result = {
        "peft": Path(peft.__file__).parent.parent.name,
        "gpu": torch.cuda.get_device_name(),
        "args": {k: v for k, v in vars(args).items() if k != "out"},  # no machine folders in a committed result
    }
    for kind in ("qdora", "qlora"):
        model = qw.wrap(base, args.rank, kind == "qdora")
        qw.seed_adapters(model, 0, 1.0)
        opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-5)

        def train():
            model.train()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        def infer():
            model.eval()
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                model(input_ids=ids, use_cache=False)

        result[kind] = {}
        for name, step in (("train", train), ("infer", infer)):
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            found = synced(step)
            result[kind][name] = {"syncs": len(found), "where": found}
            print(kind, name, "syncs", len(found))
            for s in found:
                print("   ", s["message"], "|", " <- ".join(reversed(s["frames"][-4:])))
        base = model.unload()
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
