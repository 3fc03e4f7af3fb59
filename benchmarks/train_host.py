"""Is the training step host-bound? Wall time against the time the host takes to issue the step, synchronizing ops,
the same for an inference forward, and a cProfile of the training forward (main thread only). Model: bench_model's
Llama default (8 layers, 4096/14336, seq 4096, r = 384, checkpointing); DoRA is whichever peft is importable.

    PYTHONPATH=<peft install> python benchmarks/train_host.py dora autocast  # $OUT/train_host_dora_autocast.json
"""

import cProfile
import io
import json
import os
import pstats
import sys
import time
import warnings

import torch


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_model  # noqa: E402
import model_worker as mw  # noqa: E402


impl_name, mode = sys.argv[1], sys.argv[2]
args = bench_model.parse_args(["--ranks", "384"])
cfg = bench_model.resolve_config(args)["model"]
dev = torch.device("cuda")
base = mw.build_base(cfg, dev, torch.bfloat16)
base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
impl = {"dora": impl_name == "dora"}
model = mw.wrap(base, cfg, 384, impl, mode)
mw.seed_adapters(model, cfg["seed"], cfg["config_kwargs"]["initializer_range"])
ids, labels = mw.make_inputs(cfg, dev)
model.train()


def step():
    model.zero_grad(set_to_none=True)
    with mw.precision_ctx(mode, dev):
        loss = model(input_ids=ids, labels=labels, use_cache=False).loss
    loss.backward()


for _ in range(3):
    step()
torch.cuda.synchronize()
res = {"impl": impl_name, "mode": mode}
walls, issues, fwd_issue = [], [], []
for _ in range(5):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.zero_grad(set_to_none=True)
    with mw.precision_ctx(mode, dev):
        loss = model(input_ids=ids, labels=labels, use_cache=False).loss
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    walls.append((t3 - t0) * 1e3)
    issues.append((t2 - t0) * 1e3)
    fwd_issue.append((t1 - t0) * 1e3)
res.update(wall_ms=sorted(walls)[2], issue_ms=sorted(issues)[2], fwd_issue_ms=sorted(fwd_issue)[2])
# synchronizing ops during one step
torch.cuda.set_sync_debug_mode("warn")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    step()
torch.cuda.set_sync_debug_mode(0)
syncs = [str(w.message)[:200] for w in caught if "synchroniz" in str(w.message).lower()]
res["sync_warnings"] = len(syncs)
res["sync_examples"] = syncs[:5]
# same, eval forward
model.eval()
with torch.no_grad(), mw.precision_ctx(mode, dev):
    for _ in range(2):
        model(input_ids=ids, use_cache=False)
    torch.cuda.synchronize()
    iw, ii = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        model(input_ids=ids, use_cache=False)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        iw.append((time.perf_counter() - t0) * 1e3)
        ii.append((t1 - t0) * 1e3)
res.update(infer_wall_ms=sorted(iw)[2], infer_issue_ms=sorted(ii)[2])
print(json.dumps(res))
with open(os.path.join(os.environ.get("OUT", "/tmp"), f"train_host_{impl_name}_{mode}.json"), "w") as f:
    json.dump(res, f)
# where the forward's host time goes (main thread only: backward's Python runs on the autograd thread)


model.train()
pr = cProfile.Profile()
for i in range(4):
    model.zero_grad(set_to_none=True)
    with mw.precision_ctx(mode, dev):
        if i >= 1:
            pr.enable()
        loss = model(input_ids=ids, labels=labels, use_cache=False).loss
        if i >= 1:
            pr.disable()
    loss.backward()
torch.cuda.synchronize()
for key in ("tottime", "cumulative"):
    s = io.StringIO()
    pstats.Stats(pr, stream=s).strip_dirs().sort_stats(key).print_stats(40)
    print(f"== forward cProfile by {key} (3 forwards) ==")
    print(s.getvalue()[-9000:])
