"""Profile one QDoRA and one QLoRA training step (``--measure infer``: an eval forward without autograd) on a 4-bit
Llama-8B-shaped model: the CUDA kernels by total time and the host's busiest frames, to find what QDoRA adds per
step.

    PYTHONPATH=<ours> python benchmarks/profile_qdora.py --out $OUT/profile_qdora.json

Uses ``qdora_worker``'s model, quantization and adapter seeding; the model is built (random, seeded) in ``--dir``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch


sys.path.insert(0, str(Path(__file__).resolve().parent))
import qdora_worker as qw  # noqa: E402
from timing import python_hotspots  # noqa: E402


def model_spec(layers: int) -> dict:
    return dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
    )  # fmt: skip


def quantized_base(quant: str, layers: int, seq: int, device: torch.device) -> tuple:
    """(quantized Llama-8B-shaped base with ``layers`` decoder layers, one ``[1, seq]`` batch of token ids): the model
    built (random, seeded) in a temporary folder and loaded back quantized, as ``qdora_worker`` does."""
    with tempfile.TemporaryDirectory() as d:
        qw.build_model({"model": model_spec(layers), "seed": 0, "device": "cuda", "dir": d})
        base = qw.load_quantized(d, quant, device)
    ids = torch.randint(0, 128256, (1, seq), generator=torch.Generator().manual_seed(1)).to(device)
    return base, ids


def table(prof, top: int) -> list:
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0 and e.device_type.name == "CUDA":
            rows.append((e.key[:90], e.count, t / 1000.0))
    return sorted(rows, key=lambda r: -r[2])[:top]


def cpu_table(prof, top: int) -> list:
    rows = [(e.key[:90], e.count, e.self_cpu_time_total / 1000.0) for e in prof.key_averages()]
    return sorted(rows, key=lambda r: -r[2])[:top]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--quant", default="nf4")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--measure", default="train", choices=("train", "infer"))
    p.add_argument("--out", required=True)
    args = p.parse_args()
    device = torch.device("cuda")
    import peft

    result = {
        "peft": Path(peft.__file__).parent.parent.name,
        "rank": args.rank,
        "quant": args.quant,
        "seq": args.seq,
        "measure": args.measure,
    }
    base, ids = quantized_base(args.quant, args.layers, args.seq, device)
    for kind in ("qdora", "qlora"):
        model = qw.wrap(base, args.rank, kind == "qdora")
        qw.seed_adapters(model, 0, 1.0)
        model.train(args.measure == "train")
        opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-5)

        def step():
            if args.measure == "infer":
                with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                    model(input_ids=ids, use_cache=False)
                return
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(2):
                step()
            torch.cuda.synchronize()
        events = [e for e in prof.events() if e.device_type.name == "CUDA"]
        gpu_ms = sum(e.device_time for e in events) / 1000.0 / 2
        start = min(e.time_range.start for e in prof.events())
        end = max(e.time_range.end for e in prof.events())
        result[kind] = {
            "gpu_busy_ms_per_step": gpu_ms,
            "wall_ms_per_step": (end - start) / 1000.0 / 2,
            "kernels": table(prof, 30),
            "cpu_ops": cpu_table(prof, 30),
            "python": python_hotspots(step, calls=2, under="peft"),  # the host's Python time by function
        }
        print(kind, "gpu busy ms/step", round(gpu_ms, 2), "wall", round(result[kind]["wall_ms_per_step"], 2))
        for row in result[kind]["kernels"][:18]:
            print(f"  {row[2]:9.2f} ms  x{row[1]:5d}  {row[0]}")
        base = model.unload()
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
