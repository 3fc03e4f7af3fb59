"""Which part of a DoRA layer's per-step host work costs what, on a GPU machine's host, at host-bound grid points.

At the grid's small points a training step is host-bound and DoRA/LoRA is a ratio of host times. ``profile_step.py``
shows where Python time goes under cProfile (which inflates small calls) and ``host_eager.py`` measures a CPU
stand-in (where the norm is eager ops, not a CUDA-graph replay). This probe removes one part at a time on the real
host and times what is left: the DoRA adapter against a plain-LoRA twin on the same base model, in ABBA pairs of
training steps (``model_worker.train_pairs``: forward with non-reentrant checkpointing, backward, AdamW), each probe
applied only around its own pairs, the probes interleaved over ``--rounds`` rounds so that the host's drift falls on
all of them alike. The probes are wrong on purpose (their steps compute nonsense); the DoRA adapter's tensors are
restored after each probe, so the next one starts from the same values:

* ``none``: nothing removed (the reference);
* ``norm-once``: each layer keeps the first norm it computed under the probe and returns it from then on (no memo
  checks, no graph replay, no copy): what computing the norm less often could save at most;
* ``zero-known``: the training node's zero test of m answers "no zero" without asking its memo;
* ``no-triton``: every Triton launch of ours skipped (the output node's and the backward's kernels, the norm's where
  it launches any): the launches' host cost;
* ``all``: the three together: what is left is the Python glue, the autograd node and the extra PyTorch ops;
* ``norm-batch``: not a removal but ``PEFT_DORA_NORM_BATCH=1`` (``dora_batch``: a device's training norms computed
  together once per forward pass), what it saves against ``none``;
* ``two-stage``: not a removal but the backward's d_m always summed in two stages (``SINGLE_BAND_NUMEL = 0``: the
  backward kernel over row bands, then the column-sum kernel), as before the one-band backward: what that saves.

    PYTHONPATH=<ours> python benchmarks/probe_host.py --points "llama3b bf16 r16 seq512 b1 all drop0" \\
        --out $OUT/probe_host.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path

import torch


sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_model as bm  # noqa: E402
import model_worker as mw  # noqa: E402
from host_eager import first_norm_kept  # noqa: E402
from profile_step import point_spec  # noqa: E402


PROBES = ("none", "norm-once", "zero-known", "no-triton", "all", "norm-batch", "two-stage")


@contextlib.contextmanager
def _patched(owner, name: str, value):
    old = owner.__dict__[name]
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


def _norm_once():
    from peft.tuners.lora.dora import DoraLinearLayer

    return _patched(DoraLinearLayer, "_forward_norm", first_norm_kept(DoraLinearLayer._forward_norm))


def _zero_known():
    from peft.tuners.lora import dora_fused

    return _patched(dora_fused, "output_saves_itself", lambda magnitude, known: True)


def _no_triton():
    from peft.tuners.lora import dora_launch

    stack = contextlib.ExitStack()
    stack.enter_context(_patched(dora_launch.Launcher, "launch", lambda self, grid, args, meta: None))
    stack.enter_context(_patched(dora_launch.Launcher, "repeat", lambda self, token, grid, args, meta: None))
    return stack


def probe(name: str):
    from peft.tuners.lora import dora_settings

    stack = contextlib.ExitStack()
    if name == "norm-batch":  # PEFT_DORA_NORM_BATCH=1 for this probe's pairs only
        stack.enter_context(dora_settings.override(norm_batch=True))
    if name == "two-stage":
        from peft.tuners.lora import dora_fused

        stack.enter_context(_patched(dora_fused, "SINGLE_BAND_NUMEL", 0))
    if name in ("norm-once", "all"):
        stack.enter_context(_norm_once())
    if name in ("zero-known", "all"):
        stack.enter_context(_zero_known())
    if name in ("no-triton", "all"):
        stack.enter_context(_no_triton())
    return stack


def run_point(label: str, device, rounds: int, pairs: int, layers=None, probes=PROBES) -> dict:
    cfg, point = point_spec(label)
    if layers:
        cfg["config_kwargs"]["num_hidden_layers"] = layers
    point["modules"] = list(bm.GRID_TARGETS[point["targets"]])
    base = mw.build_base(cfg, device, torch.bfloat16)
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = mw.wrap(base, cfg, point["rank"], {"name": "ours", "dora": True}, point["mode"], point["modules"],
                    point["dropout"])  # fmt: skip
    mw.seed_adapters(model, 0, cfg["config_kwargs"]["initializer_range"])
    mw.add_lora_twin(model, cfg, point)
    ids, labels = mw.make_inputs(cfg, device)
    saved = {n: p.detach().clone() for n, p in model.named_parameters() if ".default" in n or "magnitude" in n}

    def loss():
        with mw.precision_ctx(point["mode"], device):
            return model(input_ids=ids, labels=labels, use_cache=False).loss

    out: dict = {name: {"ratios": [], "dora_ms": [], "lora_ms": [], "tiers": {}} for name in probes}
    for r in range(rounds):
        order = probes[r % len(probes) :] + probes[: r % len(probes)]
        for name in order:
            for layer in model.modules():
                layer.__dict__.pop("_probe_norm", None)
            with probe(name):
                rec, _ = mw.train_pairs(model, {"dora": "default", "lora": mw.TWIN}, loss, device, pairs, 2, 1e-6,
                                        f"probe_{name}")  # fmt: skip
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if n in saved:
                        p.copy_(saved[n])
            out[name]["ratios"].append(round(rec["ratio_median"], 4))
            out[name]["dora_ms"].append(round(rec["median_ms"], 3))
            out[name]["lora_ms"].append(round(rec["lora_median_ms"], 3))
            for tier, n in rec["tiers"].items():
                out[name]["tiers"][tier] = out[name]["tiers"].get(tier, 0) + n
    for name in probes:
        out[name]["ratio_median"] = statistics.median(out[name]["ratios"])
    ref = out["none"]["ratio_median"]
    out["extra_removed_share"] = {
        name: round((ref - out[name]["ratio_median"]) / (ref - 1.0), 3) if ref > 1.0 else None for name in probes[1:]
    }
    out["modules"] = sum(1 for m in model.modules() if hasattr(m, "lora_magnitude_vector"))
    mw.release(model, base)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--points", required=True, help="';'-separated grid point labels")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pairs", type=int, default=4, help="ABBA pairs per probe and round")
    p.add_argument("--device", default="cuda", help="cuda; cpu runs every code path (a smoke test, no timings)")
    p.add_argument("--layers", type=int, help="override the shape's decoder layers (a CPU smoke: 1)")
    p.add_argument("--probes", default=",".join(PROBES), help="','-separated subset of the probes; 'none' always runs")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    unknown = set(args.probes.split(",")) - set(PROBES)
    if unknown:
        p.error(f"unknown probes {sorted(unknown)}; known: {', '.join(PROBES)}")
    probes = ("none",) + tuple(n for n in PROBES[1:] if n in args.probes.split(","))
    import peft

    device = torch.device(args.device)
    env = {"peft": str(Path(peft.__file__).parent.parent.name), "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None}  # fmt: skip
    result = {"env": env, "points": {}}
    for label in [s.strip() for s in args.points.split(";") if s.strip()]:
        res = run_point(label, device, args.rounds, args.pairs, args.layers, probes)
        result["points"][label] = res
        print(label, {n: res[n]["ratio_median"] for n in probes}, "removed", res["extra_removed_share"], flush=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
