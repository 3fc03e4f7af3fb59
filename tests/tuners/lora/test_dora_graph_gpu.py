"""Training norms replayed as CUDA graphs (``dora_graph``): bitwise the norm that an eager computation gives, through
optimizer steps, in-place edits, new tensors, scaling changes, device moves and the caller's own graph capture."""

import pytest
import torch

from peft import LoraConfig, get_peft_model
from peft.tuners.lora import dora, dora_graph


pytestmark = pytest.mark.gpu


@pytest.fixture
def graph_env(monkeypatch):
    def set_env(value):
        if value is None:
            monkeypatch.delenv("PEFT_DORA_NORM_GRAPH", raising=False)
        else:
            monkeypatch.setenv("PEFT_DORA_NORM_GRAPH", value)
        dora._invalidate_fused_cache()

    yield set_env
    monkeypatch.delenv("PEFT_DORA_NORM_GRAPH", raising=False)
    dora._invalidate_fused_cache()


def _model(adapter_dtype, seed=0, d_in=1024, d_out=3072, r=64):
    torch.manual_seed(seed)
    base = torch.nn.Sequential(torch.nn.Linear(d_in, d_out, bias=False)).to("cuda", torch.bfloat16)
    config = LoraConfig(r=r, lora_alpha=r // 2, target_modules=["0"], use_dora=True, init_lora_weights=False)
    model = get_peft_model(base, config)
    return model.to(adapter_dtype) if adapter_dtype == torch.bfloat16 else model


def _layer(model):
    return model.base_model.model[0]


def _eager_norm(model):
    layer = _layer(model)
    w = layer.base_layer.weight
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    w_sq = dora.dora_norm.row_sq_norm(w) if dora.dora_norm.w_sq_reusable(w, a, b) else None  # as the layer keeps it
    return dora.factored_row_norm(w, a, b, layer.scaling["default"], w_sq=w_sq)


def _train(model, steps, autocast, x, gy, edit=None):
    """``steps`` optimizer steps; after each, the norm the next forward used against an eager one."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    seen = []
    for i in range(steps):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            y = model(x)
        y.backward(gy)
        norm = _layer(model).lora_magnitude_vector["default"]._last_norm
        seen.append((norm, _eager_norm(model)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if edit is not None:
            edit(i)
    return seen


@pytest.fixture
def record_norm(monkeypatch):
    """Keep the norm each forward used on the DoRA layer (``_last_norm``): the one ``_forward_norm`` returned on the
    full path, or, where the layer's training record answered (``recorded_training_output``, which asks its norm
    record directly), the one it handed its training node."""
    original = dora.DoraLinearLayer._forward_norm
    recorded_output, node = dora.DoraLinearLayer.recorded_training_output, dora.dora_fused.linear_node
    handed = []

    def recorded(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        self._last_norm = out.clone()
        return out

    def node_kept(result, a, weight_b, magnitude, base, consts):
        handed[:] = [consts[0].clone()]
        return node(result, a, weight_b, magnitude, base, consts)

    def from_record(self, *args, **kwargs):
        handed.clear()
        out = recorded_output(self, *args, **kwargs)
        if out is not None:
            self._last_norm = handed[0]
        return out

    monkeypatch.setattr(dora.DoraLinearLayer, "_forward_norm", recorded)
    monkeypatch.setattr(dora.dora_fused, "linear_node", node_kept)
    monkeypatch.setattr(dora.DoraLinearLayer, "recorded_training_output", from_record)


@pytest.mark.parametrize("adapters", ["fp32_autocast", "bf16"])
def test_replayed_norm_is_the_eager_norm_through_optimizer_steps(graph_env, record_norm, adapters):
    graph_env(None)
    autocast = adapters == "fp32_autocast"
    model = _model(torch.float32 if autocast else torch.bfloat16)
    x = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    gy = torch.randn(512, 3072, device="cuda", dtype=torch.bfloat16)
    dora_graph.graph_counts.clear()
    seen = _train(model, 5, autocast, x, gy)
    # step 1 eager, step 2 captured (and replayed once), steps 3-5 replayed: the graph reads the updated A and B
    assert dora_graph.graph_counts["captured"] == 1 and dora_graph.graph_counts["replayed"] == 4
    assert dora_graph.graph_counts["failed"] == 0
    for used, eager in seen:
        assert torch.equal(used, eager)
    assert not torch.equal(seen[0][0], seen[-1][0])  # the optimizer did change the norm


def test_graph_follows_in_place_edits_new_tensors_and_scaling(graph_env, record_norm):
    graph_env(None)
    model = _model(torch.float32)
    layer = _layer(model)
    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
    gy = torch.randn(256, 3072, device="cuda", dtype=torch.bfloat16)

    def edit(i):
        with torch.no_grad():
            if i == 1:
                layer.base_layer.weight.mul_(1.5)  # a frozen W edited in place (its ||W||² memo follows the version)
            elif i == 2:
                layer.lora_A["default"].weight = torch.nn.Parameter(layer.lora_A["default"].weight.detach() * 2)
            elif i == 3:
                layer.scaling["default"] *= 3.0
            elif i == 4:
                layer.lora_B["default"].weight.data.add_(0.01)  # a .data write: invisible to versions, not to a replay

    seen = _train(model, 7, True, x, gy, edit)
    for used, eager in seen:
        torch.testing.assert_close(used, eager, rtol=0, atol=0)


def test_off_switch_and_eval_do_not_capture(graph_env, record_norm):
    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
    gy = torch.randn(256, 3072, device="cuda", dtype=torch.bfloat16)
    graph_env("0")
    model = _model(torch.float32)
    dora_graph.graph_counts.clear()
    _train(model, 3, True, x, gy)
    assert sum(dora_graph.graph_counts.values()) == 0
    graph_env(None)
    _train(model, 3, True, x, gy)
    assert dora_graph.graph_counts["captured"] == 1
    model.eval()
    assert _layer(model).lora_magnitude_vector["default"]._reuse.graph.graph is None  # released on eval()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        for _ in range(3):
            model(x)
    assert dora_graph.graph_counts["captured"] == 1


def test_callers_own_capture_and_device_moves(graph_env, record_norm):
    graph_env(None)
    model = _model(torch.float32)
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    gy = torch.randn(64, 3072, device="cuda", dtype=torch.bfloat16)
    _train(model, 3, True, x, gy)  # captured and replayed
    dora_graph.graph_counts.clear()
    # a training forward inside the caller's capture computes its norm in that capture (no nested capture)
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        model(static_x)
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g), torch.no_grad():
        out = model(static_x)
    g.replay()
    with torch.no_grad():
        ref = model(static_x)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert dora_graph.graph_counts["captured"] == 0
    # moved to the CPU and back: new storage (or the old addresses again, which the graph then reads correctly)
    model.cpu()
    model.cuda()
    for used, eager in _train(model, 3, True, x, gy):
        assert torch.equal(used, eager)


def _steps(model, x, n=2):
    for _ in range(n):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            model(x).float().sum().backward()


def test_graphs_share_one_pool_and_release_it(graph_env):
    graph_env(None)
    import gc

    x = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)
    _steps(_model(torch.float32, seed=9, d_in=2048, d_out=8192, r=256), x)  # side-stream workspace, kernels
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    models = [_model(torch.float32, seed=i, d_in=2048, d_out=8192, r=256) for i in range(4)]
    _steps(models[0], x)
    torch.cuda.synchronize()
    one = torch.cuda.memory_reserved()
    for model in models[1:]:
        _steps(model, x)
    torch.cuda.synchronize()
    four = torch.cuda.memory_reserved()
    # one norm's temporaries hold U alone (8192 x 512 fp32 = 16 MiB): three more graphs in pools of their own
    # would add at least that much each on top of the three models' gradients
    grads = sum(p.numel() * p.element_size() for m in models[1:] for p in m.parameters() if p.requires_grad)
    assert four - one < grads + 16 * 2**20, (four - one - grads) / 2**20
    del models, model
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() <= before + 4 * 2**20, (torch.cuda.memory_reserved() - before) / 2**20
    # PyTorch freed the pool with its last graph: the next capture takes a new pool instead of the dead one
    dora_graph.graph_counts.clear()
    _steps(_model(torch.float32, seed=5), torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16), n=3)
    assert dora_graph.graph_counts["captured"] == 1 and dora_graph.graph_counts["failed"] == 0


class _Chain(torch.nn.Module):
    """Four bf16 Linears; ``skip`` leaves some out of a forward (as MoE routing leaves experts out)."""

    def __init__(self, d=512):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d, bias=False) for _ in range(4))
        self.skip = set()

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            if i not in self.skip:
                x = torch.tanh(layer(x))
        return x


def _chain_model(seed=0):
    torch.manual_seed(seed)
    config = LoraConfig(r=16, target_modules=[f"layers.{i}" for i in range(4)], use_dora=True,
                        init_lora_weights=False)  # fmt: skip
    return get_peft_model(_Chain().to("cuda", torch.bfloat16), config).train()


@pytest.mark.parametrize("updates", ("adamw", "data_writes"))
def test_norm_batch_trains_as_each_layer_alone(monkeypatch, updates):
    """``PEFT_DORA_NORM_BATCH=1``: one CUDA graph per device computes every member's norm in the first member's
    forward; the others take theirs. Equal to each layer's own graph through AdamW steps, and through hand-written
    updates through ``.data`` with the leader skipped in some passes (nothing moves a version counter or runs an
    optimizer hook there); no host sync once captured."""
    from torch.utils.checkpoint import checkpoint

    def train(batch: bool):
        if batch:
            monkeypatch.setenv("PEFT_DORA_NORM_BATCH", "1")
        else:
            monkeypatch.delenv("PEFT_DORA_NORM_BATCH", raising=False)
        dora._invalidate_fused_cache()
        dora.norm_counts.clear()
        model = _chain_model()
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-3)
        gen = torch.Generator(device="cuda").manual_seed(1)
        outs = []
        for step in range(8):
            model.get_base_model().skip = {0} if updates == "data_writes" and step % 3 == 2 else set()
            x = torch.randn(64, 512, device="cuda", generator=gen, dtype=torch.bfloat16)
            torch.cuda.set_sync_debug_mode("error" if step >= 3 and updates == "adamw" else "default")
            try:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    y = checkpoint(model, x, use_reentrant=False)
                y.float().square().mean().backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            outs.append(y.detach().float())
            if updates == "adamw":
                opt.step()
            else:
                with torch.no_grad():
                    for p in params:
                        if p.grad is not None:  # a skipped layer's parameters got no gradient
                            p.data -= 1e-2 * p.grad
            opt.zero_grad()
        return torch.cat(outs), dora.norm_counts.get("norm_batched", 0)

    ref, none = train(False)
    captured = dora_graph.graph_counts["captured"]
    out, batched = train(True)
    monkeypatch.delenv("PEFT_DORA_NORM_BATCH", raising=False)
    dora._invalidate_fused_cache()
    assert none == 0 and batched > 0
    assert dora_graph.graph_counts["captured"] > captured
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.parametrize("adapters", ["fp32_autocast", "bf16"])
def test_training_record_under_checkpointing_is_the_eager_norm(graph_env, adapters):
    """After its norm graph is captured, a layer's training forwards take the norm from its record
    (``dora_norm.eager_record``: one replay after a few attribute reads) and the non-reentrant checkpoint's
    recompute takes the forward's norm back: gradients bitwise those of eager norms (``PEFT_DORA_NORM_GRAPH=0``),
    through AdamW steps, an in-place edit of the frozen W, a new A and a new scaling, and the record is dropped
    on ``eval()``."""
    from torch.utils.checkpoint import checkpoint

    autocast = adapters == "fp32_autocast"
    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(256, 3072, device="cuda", dtype=torch.bfloat16)

    def run(graph):
        graph_env(None if graph else "0")
        model = _model(torch.float32 if autocast else torch.bfloat16, seed=3)
        layer = _layer(model)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        grads, answered = [], 0
        for i in range(8):
            with torch.no_grad():
                if i == 4:
                    layer.base_layer.weight.mul_(1.25)
                elif i == 5:
                    layer.lora_A["default"].weight = torch.nn.Parameter(layer.lora_A["default"].weight.detach() * 2)
                    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
                elif i == 6:
                    layer.scaling["default"] *= 0.5
            dora.norm_counts.clear()
            dora_graph.graph_counts.clear()
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                y = checkpoint(model, x, use_reentrant=False)
            y.backward(gy)
            answered += layer.lora_magnitude_vector["default"]._reuse.record is not None
            grads.append([p.grad.clone() for p in model.parameters() if p.requires_grad] + [x.grad.clone()])
            assert dora.norm_counts["norm_computed"] == 1 and dora.norm_counts["norm_reused"] == 1
            opt.step()
            opt.zero_grad(set_to_none=True)
            x.grad = None
        model.eval()
        assert layer.lora_magnitude_vector["default"]._reuse.record is None
        return grads, answered

    with_graph, answered = run(True)
    eager, none = run(False)
    assert none == 0 and answered >= 4  # recorded after each capture: steps 2-4, and again after the edits
    for got, want in zip(with_graph, eager):
        for g, w in zip(got, want):
            assert torch.equal(g, w)


@pytest.mark.parametrize("adapters", ["fp32_autocast", "bf16"])
def test_norm_buffer_is_handed_out_only_while_its_weights_hold(graph_env, adapters):
    """A layer's norm graph hands its training node the graph's output buffer itself, not a copy: two forwards of
    unchanged weights before one backward give bitwise the gradients of eager norms (``PEFT_DORA_NORM_GRAPH=0``);
    after an in-place edit of A that autograd does not see (the input takes no gradient, so A is not saved) a second
    forward rewrites the buffer, and the first forward's backward fails as autograd fails on an edited saved tensor
    instead of reading the new norm."""
    autocast = adapters == "fp32_autocast"
    x1, x2 = (torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    g1, g2 = (torch.randn(256, 3072, device="cuda", dtype=torch.bfloat16) for _ in range(2))

    def forward(model, x):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            return model(x)

    def run(graph):
        graph_env(None if graph else "0")
        model = _model(torch.float32 if autocast else torch.bfloat16, seed=5)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        for _ in range(3):  # eager, captured, replayed from the layer's record
            forward(model, x1).backward(g1)
            opt.step()
            opt.zero_grad(set_to_none=True)
        dora_graph.graph_counts.clear()
        ((forward(model, x1) * g1).sum() + (forward(model, x2) * g2).sum()).backward()
        assert dora_graph.graph_counts["replayed"] == (2 if graph else 0)
        grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
        if graph:  # under the settings the record was made with
            model.zero_grad(set_to_none=True)
            y1 = forward(model, x1)
            with torch.no_grad():
                _layer(model).lora_A["default"].weight.mul_(1.5)
            forward(model, x2)
            assert dora_graph.graph_counts["replayed"] == 4
            with pytest.raises(RuntimeError, match="weight norm"):
                y1.backward(g1)
        return grads

    with_graph = run(True)
    eager = run(False)
    for got, want in zip(with_graph, eager):
        assert torch.equal(got, want)


def test_graph_captured_under_inference_mode_then_trained(graph_env):
    """A training-mode model called under torch.inference_mode first (an evaluation without ``eval()``) captures its
    norm graph there, so the graph's buffer is an inference tensor; the training steps after it take ordinary copies
    of it and give bitwise the gradients of eager norms (``PEFT_DORA_NORM_GRAPH=0``)."""
    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
    gy = torch.randn(256, 3072, device="cuda", dtype=torch.bfloat16)

    def run(graph):
        graph_env(None if graph else "0")
        model = _model(torch.bfloat16, seed=7)
        with torch.inference_mode():
            for _ in range(3):  # eager, captured, replayed
                model(x)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        grads = []
        for _ in range(3):
            model(x).backward(gy)
            grads.append([p.grad.clone() for p in model.parameters() if p.requires_grad])
            opt.step()
            opt.zero_grad(set_to_none=True)
        return grads

    dora_graph.graph_counts.clear()
    with_graph = run(True)
    assert dora_graph.graph_counts["captured"] >= 1
    for got, want in zip(with_graph, run(False)):
        for g, w in zip(got, want):
            assert torch.equal(g, w)


def test_fsdp1_views_take_no_graph():
    """FSDP1's views of its gathered flat parameter (new in every forward) never key a norm graph: each forward would
    take the graph's first-sight eager path under the graphed kernel rule (at r = 128 the split path's seven launches
    instead of the eager norms' one-pass kernel). The same tensors as parameters do."""
    from test_dora_norm_reuse import _flat_views

    from peft.tuners.lora import dora_norm

    views = _flat_views("cuda")
    assert not dora_norm.norm_graph_applies(*views)
    assert dora_norm.norm_graph_applies(*(torch.nn.Parameter(v.detach().clone()) for v in views))
