"""GPU busy time, idle time and host issue time of one training step, plain LoRA against our DoRA, in one process:
bench_model's Llama default (8 layers, 4096/14336, seq 4096, r = 384, checkpointing), autocast mode.

Per implementation: five timed steps (CUDA events around each; host issue time to the end of ``backward()``, and to
the end of the forward), one step for the peak memory over the allocation before it (gradients dropped, as
bench_model measures it), then one step under torch.profiler, whose kernel intervals give the GPU busy time, the idle
gaps (total per tenth of the step) and the kernel totals by name; for DoRA also ``graph_counts``, ``tier_counts``
and ``norm_counts``. Run it once per peft install to compare revisions on one machine:

    PYTHONPATH=<peft install>:. OUT_NAME=step_busy_x python benchmarks/step_busy.py   # $OUT/step_busy_x.json
"""

import collections
import json
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_model  # noqa: E402
import model_worker as mw  # noqa: E402


def busy_and_gaps(events) -> tuple:
    """(span, busy, idle per tenth of the span, largest gaps), all in µs, from CUDA kernel intervals."""
    iv = sorted((e.time_range.start, e.time_range.end) for e in events)
    t_start, t_end = iv[0][0], max(b for _, b in iv)
    busy, cur_s, cur_e, gaps = 0.0, None, None, []
    for a, b in iv:
        if cur_e is None or a > cur_e:
            if cur_e is not None:
                gaps.append((cur_e, a - cur_e))
                busy += cur_e - cur_s
            cur_s, cur_e = a, b
        else:
            cur_e = max(cur_e, b)
    busy += cur_e - cur_s
    span = t_end - t_start
    tenths = [0.0] * 10
    for at, g in gaps:
        tenths[min(9, int((at - t_start) / span * 10))] += g
    return span, busy, tenths, sorted(g for _, g in gaps)[-10:]


def run(impl: str, cfg: dict, dev: torch.device, mode: str) -> dict:
    base = mw.build_base(cfg, dev, torch.bfloat16)
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = mw.wrap(base, cfg, 384, {"dora": impl == "dora"}, mode)
    mw.seed_adapters(model, cfg["seed"], cfg["config_kwargs"]["initializer_range"])
    model.train()
    ids, labels = mw.make_inputs(cfg, dev)
    marks = {}

    def step():
        model.zero_grad(set_to_none=True)
        with mw.precision_ctx(mode, dev):
            loss = model(input_ids=ids, labels=labels, use_cache=False).loss
        marks["fwd_end"] = time.perf_counter()
        loss.backward()

    for _ in range(3):
        step()
    walls, hosts, fwd_hosts = [], [], []
    for _ in range(5):
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        e.record()
        e.synchronize()
        walls.append(round(s.elapsed_time(e), 2))
        hosts.append(round((t1 - t0) * 1e3, 2))
        fwd_hosts.append(round((marks["fwd_end"] - t0) * 1e3, 2))
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    static = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak_delta_mb = (torch.cuda.max_memory_allocated() - static) / 2**20
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as p:
        step()
        torch.cuda.synchronize()
    events = [e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    span, busy, tenths, big = busy_and_gaps(events)
    totals, counts = collections.Counter(), collections.Counter()
    for e in events:
        totals[e.name[:70]] += e.device_time
        counts[e.name[:70]] += 1
    out = {
        "wall_ms": walls, "host_ms": hosts, "fwd_host_ms": fwd_hosts, "peak_delta_mb": round(peak_delta_mb, 2),
        "prof_span_ms": span / 1e3,
        "busy_ms": busy / 1e3, "idle_by_decile_ms": [round(x / 1e3, 2) for x in tenths],
        "big_gaps": [round(g / 1e3, 3) for g in big],
        "kernels_ms": {k: (round(v / 1e3, 3), counts[k]) for k, v in totals.most_common(45)},
    }  # fmt: skip
    if impl == "dora":
        from peft.tuners.lora import dora

        out["graph_counts"], out["tiers"] = dict(dora.graph_counts), dict(dora.tier_counts)
        out["norm_counts"] = dict(dora.norm_counts)
    return out


def main() -> None:
    import peft

    dev, mode = torch.device("cuda"), "autocast"
    cfg = bench_model.resolve_config(bench_model.parse_args(["--ranks", "384"]))["model"]
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "peft": peft.__version__, "mode": mode}
    for impl in ("lora", "dora"):
        out["model_" + impl] = run(impl, cfg, dev, mode)
        mw.release()
        print(impl, json.dumps({k: v for k, v in out["model_" + impl].items() if k != "kernels_ms"}), flush=True)
    name = os.environ.get("OUT_NAME", "step_busy")
    with open(os.path.join(os.environ.get("OUT", "/tmp"), name + ".json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
