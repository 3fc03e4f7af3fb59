"""DoRA's training step with and without its per-layer training record, interleaved step by step in one process.

``ab_builds.py`` alternates two builds in separate processes; on the GPU machines' hosts a small training step's
host time moves by up to 2× between processes seconds apart (LoRA's own step 33–70 ms at one point within one call),
so a change worth 20–30 % of DoRA's extra host time does not show there. This times it inside one process instead:
per grid point, a LoRA twin and one DoRA model (each on its own base with the same seeded weights), and per round one
training step each of LoRA, DoRA with the record (``DoraLinearLayer.recorded_training_output`` and the training
nodes' direct C++ apply, ``dora_fused.linear_node``) and DoRA without them (both switched off: the full path of
every forward, through ``Function.apply``), in a rotating order; every step as ``profile_step.py`` runs it (forward
under non-reentrant checkpointing, or reentrant with ``--reentrant``: transformers' and
``prepare_model_for_kbit_training``'s default, whose first pass runs without autograd; backward, AdamW), timed from an
empty queue to its end (CUDA events). The first step of each model checks that every adapter got a gradient. The record
keeps each round's three times, the per-round ratios and their medians, and how often the record answered.

    PYTHONPATH=<ours> python benchmarks/probe_train_record.py --points "llama1b bf16 r16 seq512 b1 all drop0.05" \
        --rounds 30 --out $OUT/probe_train_record.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch


sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_model as bm  # noqa: E402
import model_worker as mw  # noqa: E402
from profile_step import point_arguments, point_spec  # noqa: E402


def _switch(on: bool, saved: dict) -> None:
    """The record and the direct apply on (as shipped) or off (the full path, ``Function.apply``)."""
    from peft.tuners.lora import dora, dora_fused

    dora.DoraLinearLayer.recorded_training_output = saved["record"] if on else _no_record
    dora_fused.linear_node = saved["node"] if on else dora_fused.FusedDoRALinearFunction.apply


def _no_record(self, *args, **kwargs):
    return None


def _model(cfg, point, dora: bool, device, reentrant: bool = False):
    base = mw.build_base(cfg, device, torch.bfloat16)
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    if reentrant:  # a reentrant checkpoint passes gradients on only where its input requires one
        base.enable_input_require_grads()
    impl = {"name": "dora" if dora else "lora", "dora": dora}
    model = mw.wrap(base, cfg, point["rank"], impl, point["mode"], list(bm.GRID_TARGETS[point["targets"]]),
                    point["dropout"])  # fmt: skip
    mw.seed_adapters(model, 0, cfg["config_kwargs"]["initializer_range"])
    return model.train()


def _stepper(model, cfg, point, device):
    ids, labels = mw.make_inputs(cfg, device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6, foreach=True)
    proof = [mw.GradProof(model)]

    def step():
        with mw.precision_ctx(point["mode"], device):
            loss = model(input_ids=ids, labels=labels, use_cache=False).loss
        loss.backward()
        if proof:  # a step that trains nothing would time nothing of the adapters' backward: the first one is proved
            proof[0]()
            result = proof.pop().result()
            if not result["ok"]:
                raise RuntimeError(f"{result['bad_tensors']} of {result['tensors']} trainable tensors got no finite, "
                                   f"non-zero gradient: {result['bad_names']}")  # fmt: skip
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def probe(label: str, rounds: int, device, layers=None, reentrant: bool = False) -> dict:
    from peft.tuners.lora import dora, dora_fused

    saved = {"record": dora.DoraLinearLayer.recorded_training_output, "node": dora_fused.linear_node}
    answered = {"yes": 0, "no": 0}

    def counted(self, *args, **kwargs):
        out = saved["record"](self, *args, **kwargs)
        answered["yes" if out is not None else "no"] += 1
        return out

    saved_counting = {"record": counted, "node": saved["node"]}
    cfg, point = point_spec(label)
    if layers:
        cfg["config_kwargs"]["num_hidden_layers"] = layers
    steps = {
        "lora": _stepper(_model(cfg, point, False, device, reentrant), cfg, point, device),
        "dora": _stepper(_model(cfg, point, True, device, reentrant), cfg, point, device),
    }
    runs = {"lora": ("lora", True), "record": ("dora", True), "full": ("dora", False)}
    for name, (kind, on) in runs.items():  # warm-up: captures, records, optimizer state
        _switch(on, saved_counting)
        for _ in range(3):
            steps[kind]()
    timer = mw.Timer(device)
    times: dict = {name: [] for name in runs}
    answered.update(yes=0, no=0)
    order = list(runs)
    try:
        for r in range(rounds):
            for name in order[r % 3 :] + order[: r % 3]:  # rotating: no run always follows the same one
                kind, on = runs[name]
                _switch(on, saved_counting)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                with timer.region(times[name]):
                    steps[kind]()
    finally:
        _switch(True, saved)
    ratios = {
        "record_over_lora": [a / b for a, b in zip(times["record"], times["lora"])],
        "full_over_lora": [a / b for a, b in zip(times["full"], times["lora"])],
        "record_over_full": [a / b for a, b in zip(times["record"], times["full"])],
    }
    out = {
        "rounds": rounds,
        "checkpointing": "reentrant" if reentrant else "non-reentrant",
        "ms": {k: [round(t, 3) for t in v] for k, v in times.items()},
        "median_ms": {k: round(statistics.median(v), 3) for k, v in times.items()},
        "median_ratio": {k: round(statistics.median(v), 4) for k, v in ratios.items()},
        "record_answered": dict(answered),  # DoRA forwards (and recomputes) of the timed steps with the record on
    }
    lora_ms, record_ms, full_ms = (out["median_ms"][k] for k in ("lora", "record", "full"))
    out["dora_extra_ms"] = {"record": round(record_ms - lora_ms, 3), "full": round(full_ms - lora_ms, 3)}
    mw.release()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    point_arguments(p)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--reentrant", action="store_true", help="reentrant gradient checkpointing (transformers' default)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    import transformers

    import peft

    device = torch.device(args.device)
    env = {"peft": Path(peft.__file__).parent.parent.name, "torch": torch.__version__,
           "transformers": transformers.__version__,
           "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None}  # fmt: skip
    result = {"env": env, "points": {}}
    for label in [s.strip() for s in args.points.split(";") if s.strip()]:
        out = probe(label, args.rounds, device, args.layers, args.reentrant)
        result["points"][label] = out
        print(f"{label}: median ms {out['median_ms']}, ratios {out['median_ratio']}, record answered "
              f"{out['record_answered']}", flush=True)  # fmt: skip
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
