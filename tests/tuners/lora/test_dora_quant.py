"""QDoRA on bitsandbytes 4-bit (NF4, FP4) and 8-bit (LLM.int8) bases, on bitsandbytes' CPU backend.

The norm read in chunks of dequantized rows against the dense norm of upstream's dequantized weight; whole models
against upstream's DoRA (the in-process oracle) with and without autocast and LoRA dropout; no dense weight saved for
the backward (upstream's dropout path saves one, which shows the check can fail); the norm and ‖W‖² kept exactly while
the quantized storage holds and recomputed when it is replaced; merge_and_unload as upstream's. Under
TRITON_INTERPRET=1 (``test_quant_under_interpreter``) the same tests run the fused tiers.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dora_testing import (
    TOL,
    BnbNet,
    assert_close,
    assert_initial_magnitude_is_upstreams,
    bnb_linear,
    edit_scales_in_place,
    perturb_magnitudes,
    to_upstream,
)
from torch import nn

from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from peft.tuners.lora import dora, dora_quant
from peft.tuners.lora.dora_launch import INTERPRET
from peft.utils.integrations import dequantize_module_weight


bnb = pytest.importorskip("bitsandbytes", reason="QDoRA needs bitsandbytes (pip install bitsandbytes)")

HERE = Path(__file__).resolve().parent
KINDS = ("nf4", "fp4", "int8")


def adapted(kind: str, dropout: float = 0.0, bias: bool = False) -> nn.Module:
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["up", "down"], use_dora=True, lora_dropout=dropout,
                        init_lora_weights=False)  # fmt: skip
    torch.manual_seed(3)
    return perturb_magnitudes(get_peft_model(BnbNet(kind, bias=bias), config))


def dora_layers(model):
    return [m for m in model.modules() if isinstance(m, dora.DoraLinearLayer)]


def expected_tier(training: bool) -> str:
    if not INTERPRET:
        return dora.TIER_EAGER
    return dora.TIER_FUSED_BACKWARD if training else dora.TIER_FUSED_FORWARD


# ---------------------------------------------------------------------------------------------------------------
# The norm, chunk by chunk.
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d_in", (128, 100))
@pytest.mark.parametrize("kind", KINDS)
def test_chunked_norm_matches_dense_norm_of_upstream_dequantization(kind, d_in, monkeypatch):
    layer = bnb_linear(kind, d_in, 72)
    dense = dequantize_module_weight(layer).float()  # upstream's dequantization, whole
    weight = dora_quant.quantized_weight(layer)
    assert weight.shape == dense.shape and weight.dtype == (torch.float32 if kind == "int8" else torch.bfloat16)
    monkeypatch.setattr(dora_quant, "CHUNK_BYTES", 4 * d_in * 2)  # a few rows per chunk: many chunks, odd sizes
    assert weight.chunk_rows() < 72
    torch.manual_seed(0)
    lora_A, lora_B = torch.randn(8, d_in) * 0.1, torch.randn(72, 8) * 0.1
    expected = dora.factored_row_norm(dense, lora_A, lora_B, 1.5)
    torch.testing.assert_close(dora_quant.row_norm(weight, lora_A, lora_B, 1.5), expected, atol=0, rtol=2e-6)
    torch.testing.assert_close(dora_quant.row_sq_norm(weight), dense.square().sum(1), atol=0, rtol=2e-6)
    if kind != "int8":  # 4-bit rows dequantize bitwise as the whole weight does
        assert torch.equal(weight.dequantize(), dequantize_module_weight(layer))
    with pytest.raises(ValueError, match="shapes do not chain"):
        dora_quant.row_norm(weight, lora_A[:, :-1], lora_B, 1.5)


def test_quantized_weight_keeps_no_scales_between_norms():
    """Every norm of a :class:`QuantizedWeight` reads the layer's current quantization state: nothing is kept on the
    object from one computation to the next. A norm CUDA graph runs its computation once before capturing it, and
    NF4's nested scales kept from that run were read by every replay from a buffer freed with the forward's
    ``QuantizedWeight`` (training on one GPU drifted from the eager norm's losses once the allocator reused it). The
    nested state's tensors are among the sources that key the norm's memos and graphs."""
    layer = bnb_linear("nf4", 128, 72)
    state = layer.weight.quant_state
    assert state.nested
    weight = dora_quant.quantized_weight(layer)
    torch.manual_seed(0)
    lora_A, lora_B = torch.randn(8, 128) * 0.1, torch.randn(72, 8) * 0.1
    first = dora_quant.row_norm(weight, lora_A, lora_B, 1.5)
    state.state2.absmax.mul_(3)  # the block scales' spread around their mean triples
    again = dora_quant.row_norm(weight, lora_A, lora_B, 1.5)
    fresh = dora_quant.row_norm(dora_quant.quantized_weight(layer), lora_A, lora_B, 1.5)
    torch.testing.assert_close(again, fresh, atol=0, rtol=0)
    assert (again - first).abs().max() > 1e-3 * first.abs().max()
    expected_sq = dora_quant.row_sq_norm(dora_quant.quantized_weight(layer))
    torch.testing.assert_close(dora_quant.row_sq_norm(weight), expected_sq)
    assert {id(state.state2.absmax), id(state.state2.code)} <= {id(t) for t in weight.sources}


def _repack_for_cpu(layer) -> None:
    """What ``Linear4bit.forward`` does to its weight in CPU inference on an AVX512-BF16 CPU (in place)."""
    weight = layer.weight
    weight.data, weight.quant_state = bnb.functional._convert_weight_packed_for_cpu(weight.data, weight.quant_state)
    assert weight.quant_state.packing_format_for_cpu


@pytest.mark.parametrize("kind", ("nf4", "fp4"))
def test_cpu_repacked_weight_reads_as_its_kernel_computes(kind):
    """bitsandbytes repacks a 4-bit weight in place for its CPU kernel (other byte order, the block scales rounded
    to bf16 and transposed): the norm reads it as that kernel computes with it, the rows of the standard layout with
    bf16-rounded scales, bit for bit (read as the standard layout, it would be other numbers altogether)."""
    layer = bnb_linear(kind, 128, 96)
    before = dora_quant.quantized_weight(layer)
    packed, scales = before.storage()
    state = layer.weight.quant_state
    expected = torch.ops.bitsandbytes.dequantize_4bit.default(
        packed, scales.bfloat16().float(), state.blocksize, state.quant_type, [96, 128], before.dtype
    )
    torch.manual_seed(0)
    lora_A, lora_B = torch.randn(8, 128) * 0.1, torch.randn(96, 8) * 0.1
    _repack_for_cpu(layer)
    after = dora_quant.quantized_weight(layer)
    assert after.dtype == before.dtype and after.shape == before.shape
    assert torch.equal(after.dequantize(), expected)
    assert not torch.equal(layer.weight.data.reshape(-1).view(torch.uint8), packed)  # other bytes: read as before?
    norm = dora.factored_row_norm(expected.float(), lora_A, lora_B, 1.5)
    torch.testing.assert_close(dora_quant.row_norm(after, lora_A, lora_B, 1.5), norm, atol=0, rtol=2e-6)
    torch.testing.assert_close(dora_quant.row_sq_norm(after), expected.float().square().sum(1), atol=0, rtol=2e-6)


@pytest.mark.skipif(not bnb.functional.has_avx512bf16(), reason="bitsandbytes repacks only on AVX512-BF16 CPUs")
def test_cpu_repacked_model_infers_as_before():
    """Eval on an AVX512-BF16 CPU: bitsandbytes' forward repacks the weights at the first call; the DoRA output
    then is the one from before the repacking up to its bf16-rounded scales."""
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["up", "down"], use_dora=True, init_lora_weights=False)
    torch.manual_seed(3)
    # within bitsandbytes' limits for the repacking: 32 | d_out and 64 | d_in
    model = perturb_magnitudes(get_peft_model(BnbNet("nf4", dims=(64, 128, 64)), config)).eval()
    x = torch.randn(3, 5, 64)
    with torch.no_grad():
        before = model(x)
        for layer in (model.base_model.model.up.base_layer, model.base_model.model.down.base_layer):
            layer.support_avx512bf16_for_cpu = True
        after = model(x)
        assert model.base_model.model.up.base_layer.weight.quant_state.packing_format_for_cpu
        torch.testing.assert_close(after, before, rtol=2e-2, atol=2e-2)
        assert torch.equal(model(x), after)


def test_quantized_weight_needs_a_quantized_layer():
    layer = bnb.nn.Linear4bit(64, 32, compute_dtype=torch.bfloat16, quant_type="nf4")  # not quantized until .to()
    layer.weight.quant_state = None
    with pytest.raises(RuntimeError, match="no quant_state"):
        dora_quant.quantized_weight(layer)
    assert dora_quant.quantized_weight(nn.Linear(4, 4)) is None


# ---------------------------------------------------------------------------------------------------------------
# Whole models against upstream's DoRA.
# ---------------------------------------------------------------------------------------------------------------


def _step(model, x, autocast: bool):
    torch.manual_seed(11)  # the same dropout masks on both sides
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(x)
    out.float().square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    return out.detach(), grads


@pytest.mark.parametrize("autocast", (False, True), ids=("fp32_hidden", "autocast"))
@pytest.mark.parametrize("dropout", (0.0, 0.1))
@pytest.mark.parametrize("kind", KINDS)
def test_training_matches_upstream(kind, dropout, autocast):
    model = adapted(kind, dropout=dropout, bias=True).train()
    theirs = to_upstream(model)
    x = torch.randn(3, 5, 64)
    dora.tier_counts.clear()
    out, grads = _step(model, x, autocast)
    out_up, grads_up = _step(theirs, x, autocast)
    scale = 1.0 if not autocast else 1.0  # outputs are O(1); the bf16 tolerance already covers autocast's rounding
    dtype = torch.bfloat16 if autocast else torch.float32
    assert out.dtype == out_up.dtype
    assert_close(out, out_up, dtype=dtype, scale=scale)
    assert grads.keys() == grads_up.keys() and any("magnitude" in n for n in grads)
    for name in grads:
        ref = grads_up[name]
        assert_close(grads[name], ref, dtype=dtype, scale=max(1.0, ref.abs().max().item()))
    # with dropout too: under the interpreter the output's node takes W·dropout(x) through the quantized matmul
    assert set(dora.tier_counts) == {expected_tier(training=True)}, dict(dora.tier_counts)


@pytest.mark.parametrize("autocast", (False, True), ids=("fp32_hidden", "autocast"))
@pytest.mark.parametrize("kind", KINDS)
def test_eval_matches_upstream_and_reuses_the_norm(kind, autocast):
    model = adapted(kind, bias=True).eval()
    theirs = to_upstream(model)
    x = torch.randn(2, 7, 64)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        expected = theirs(x)
        dora.norm_counts.clear()
        dora.tier_counts.clear()
        first, second = model(x), model(x)
    assert first.dtype == expected.dtype
    assert_close(first, expected, dtype=torch.bfloat16 if autocast else torch.float32)
    if INTERPRET:  # fp32 results beside bf16 LoRA outputs under autocast: the fused tiers still take them
        assert dora.TIER_EAGER not in dora.tier_counts, dict(dora.tier_counts)
    assert torch.equal(first, second)
    counts = dict(dora.norm_counts)
    # the second forward computes no norm: it reuses the norm, or (small outputs, fused tiers) the scale built from it
    assert counts["norm_computed"] == 2 and counts.get("norm_reused", 0) + counts.get("scale_reused", 0) >= 2, counts


@pytest.mark.parametrize("hidden", (torch.bfloat16, torch.float32), ids=("bf16_hidden", "fp32_hidden"))
@pytest.mark.parametrize("kind", KINDS)
def test_eval_record_of_a_quantized_layer_follows_its_storage(kind, hidden):
    """Under autocast a bitsandbytes layer returns its input's dtype: a bf16 result takes the small tier's folded
    path, an fp32 one (the QLoRA recipe's fp32 hidden states) its fp32 composition beside the bf16 branch (under the
    interpreter), and each keeps a record
    (``dora_cache.SmallRecord``, keyed on the packed weight and its scales, or LLM.int8's weight and row scales)
    answers the next forwards; an in-place edit of the scales and a requantized weight each give upstream's fresh
    output, never the record's stale one."""
    model = adapted(kind).eval()
    # bitsandbytes returns its input's dtype: a bf16 input makes a bf16 result. The second layer (96 inputs): its
    # quantization blocks of 64 straddle rows, so a block's scale changes a row's direction, not only its length
    # (DoRA's output is nearly blind to a row's length)
    x = torch.randn(2, 7, 96, dtype=hidden)
    down = model.base_model.model.down

    def forward_against_upstream():
        """The layer's output twice, against upstream's."""
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            expected = to_upstream(model).base_model.model.down(x)
            dora.tier_counts.clear(), dora.norm_counts.clear()
            first, second = down(x), down(x)
        assert first.dtype == hidden
        assert_close(first, expected, dtype=torch.bfloat16)
        assert torch.equal(first, second)
        return first

    before = forward_against_upstream()
    if INTERPRET:
        kept = down.lora_magnitude_vector["default"]._reuse.small
        assert kept is not None and (kept.scaled_b is None) is (hidden == torch.float32)
        assert dora.tier_counts == {dora.TIER_SMALL_FORWARD: 2} and dora.norm_counts["scale_reused"] == 1
    with torch.no_grad():
        if kind == "int8":  # the row scales, in place
            edit_scales_in_place(down.base_layer)
        else:
            state = down.base_layer.weight.quant_state
            # the scales, in place, so that rows get other norms: under double quantization the scales of the
            # scales (the scales themselves are uint8 codes around an offset), else the first block's
            if state.nested:
                state.state2.absmax.mul_(10)
            else:
                state.absmax[:1].mul_(1.5)
    scaled = forward_against_upstream()
    assert not torch.allclose(before, scaled)
    replacement = bnb_linear(kind, 96, 40, seed=7)
    down.base_layer.weight = replacement.weight  # requantized: a new packed weight
    if kind == "int8":
        down.base_layer.state = replacement.state
    requantized = forward_against_upstream()
    assert not torch.allclose(scaled, requantized)


@pytest.mark.parametrize("autocast", (False, True), ids=("fp32_hidden", "autocast"))
@pytest.mark.parametrize("kind", KINDS)
def test_eval_decode_steps_match_upstream(kind, autocast):
    """Decode-sized forwards (2 rows, then 6): under the interpreter the decode and small tiers, which take the fp32
    result of a bitsandbytes layer beside the bf16 branch under autocast."""
    model = adapted(kind, bias=True).eval()
    dora.tier_counts.clear()
    for rows in (1, 3):
        x = torch.randn(2, rows, 64)
        # a fresh upstream copy per forward: upstream's dequantization of an 8-bit weight on the CPU re-wraps the
        # parameter without its row scales (bitsandbytes 0.50.2), so its second forward would fail
        theirs = to_upstream(model)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            ours_up, expected_up = model.base_model.model.up(x), to_upstream(model).base_model.model.up(x)
            ours, expected = model(x), theirs(x)
            again = model(x)
        assert ours.dtype == expected.dtype
        # the first layer at the precision of the mode; the whole net within bf16's: the second quantized layer
        # rounds its input to bf16 (bitsandbytes' compute dtype), where an fp32-level difference can flip a rounding
        assert_close(ours_up, expected_up, dtype=torch.bfloat16 if autocast else torch.float32)
        assert_close(ours, expected, dtype=torch.bfloat16)
        assert torch.equal(ours, again)
    if INTERPRET:
        assert dora.TIER_EAGER not in dora.tier_counts and dora.TIER_FUSED_FORWARD not in dora.tier_counts, dict(
            dora.tier_counts
        )


@pytest.mark.parametrize("kind", KINDS)
def test_initial_magnitude_is_upstreams(kind):
    """The magnitude is the checkpoint's content: the same values and dtype as upstream's initialisation."""
    assert_initial_magnitude_is_upstreams(bnb_linear(kind, 64, 48), 64, 48)


# ---------------------------------------------------------------------------------------------------------------
# Memory: no dense weight between forward and backward.
# ---------------------------------------------------------------------------------------------------------------


def _saved_float_numels(model, x) -> list:
    saved = []

    def pack(t):
        if t.is_floating_point():
            saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).float().sum().backward()
    return saved


@pytest.mark.parametrize("dropout", (0.0, 0.1))
@pytest.mark.parametrize("kind", ("nf4", "int8"))
def test_no_dense_weight_is_saved_for_backward(kind, dropout):
    model = adapted(kind, dropout=dropout).train()
    x = torch.randn(2, 3, 64)  # fewer elements than either weight (64·96, 96·40)
    weights = {64 * 96, 96 * 40}
    assert not weights & set(_saved_float_numels(model, x))
    if dropout:  # upstream's dropout path saves the dense dequantized weight: the check sees it
        assert weights & set(_saved_float_numels(to_upstream(model), x))


# ---------------------------------------------------------------------------------------------------------------
# Reuse: exact while the quantized storage holds, recomputed when it changes.
# ---------------------------------------------------------------------------------------------------------------


def test_recompute_reuses_the_norm_and_w_sq_survives_optimizer_steps():
    model = adapted("nf4").train()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    layers = 2
    x = torch.randn(2, 3, 64, requires_grad=True)
    dora.norm_counts.clear()
    for _ in range(2):
        y = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)
        y.float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    counts = dict(dora.norm_counts)
    # per step: one norm per layer, reused by the checkpoint's recompute; ||W||² once over both steps
    assert counts["norm_computed"] == 2 * layers and counts["norm_reused"] == 2 * layers, counts
    assert counts["w_sq_computed"] == layers and counts["w_sq_reused"] == layers, counts


class _ReplayComputes:
    """A captured norm graph on the CPU whose replay writes ``compute()`` of the tensors' current values into the
    graph's output buffer, as a CUDA graph's replay reads its captured addresses."""

    def __init__(self, out, compute):
        self.out, self.compute, self.replays = out, compute, 0

    def replay(self):
        self.replays += 1
        self.out.data.copy_(self.compute())


@pytest.mark.parametrize("kind", ("nf4", "int8"))
def test_training_record_of_a_quantized_layer_replays_and_is_never_stale(kind, monkeypatch):
    """``dora_norm.eager_quant_record`` (made on a GPU once a quantized layer's norm graph is captured; here with a
    CPU stand-in graph): training forwards replay the graph after one pass of checks and the checkpoint recompute
    takes the forward's norm back. In-place edits of the scales, a requantized weight, optimizer steps, a new scaling
    and new settings never get a stale norm; the gradients equal those of a model whose norms take the memos' path."""
    from peft.tuners.lora import dora_graph, dora_norm

    graphs = [True]
    monkeypatch.setattr(dora_norm, "norm_graph_applies", lambda w, a, b: graphs[0])

    def capture(self, device, compute):
        out = compute()
        self.graph, self.out = _ReplayComputes(out, compute), out
        return out

    monkeypatch.setattr(dora_graph.NormGraph, "_capture", capture)
    models = [adapted(kind).train() for _ in range(2)]  # ours with records, the reference without graphs
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in models]
    gen = torch.Generator().manual_seed(0)
    up_records = []  # the edited layer's record after each step (held: ids of dead objects are reused)
    for step in range(7):
        if step in (4, 5):
            for m in models:
                base = m.base_model.model.up.base_layer
                if step == 4:  # the scales edited in place: the graph's kept ||W||² is stale
                    edit_scales_in_place(base)
                else:  # requantized: new objects the record does not hold
                    replacement = bnb_linear(kind, 64, 96, seed=7)
                    base.weight = replacement.weight
                    if kind == "int8":
                        base.state = replacement.state
        x = torch.randn(2, 3, 64, generator=gen)
        grads = []
        for m, opt, with_graphs in zip(models, opts, (True, False)):
            graphs[0] = with_graphs
            dora.norm_counts.clear()
            y = torch.utils.checkpoint.checkpoint(m, x, use_reentrant=False)
            y.float().square().mean().backward()
            grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad})
            opt.step()
            opt.zero_grad()
            if with_graphs:
                counts = dict(dora.norm_counts)
        for name, g in grads[0].items():
            torch.testing.assert_close(g, grads[1][name], rtol=1e-6, atol=1e-7)
        recs = [layer._reuse.record for layer in dora_layers(models[0])]
        if step >= 2 and step not in (4, 5):  # captured at step 1; made again once the edits' memos took over
            assert all(type(r) is dora_norm._QuantRecord for r in recs), step
            assert counts["norm_reused"] == 2 and counts.get("w_sq_computed", 0) == 0, (step, counts)
        up_records.append(recs[0])
    # one record from the second step on, none while the edits' memos recompute, a new one after them
    assert up_records[1] is up_records[3] is not None and up_records[6] is not None
    assert up_records[4] is None and up_records[6] is not up_records[3]
    layer, lin = dora_layers(models[0])[0], models[0].base_model.model.up
    record, weight = layer._reuse.record, dora._forward_weight(lin.base_layer)
    a, b, s = lin.lora_A["default"].weight, lin.lora_B["default"].weight, lin.scaling["default"]
    assert record.answer(weight, a, b, s, 1, True) is not None  # what a training forward gets now
    assert record.answer(weight, a, b, 2 * s, 1, True) is None  # another scaling
    assert record.answer(weight, b, a, s, 1, True) is None  # other tensors
    dora._invalidate_fused_cache()  # new settings: it answers under those it was made with only
    assert record.answer(weight, a, b, s, 1, True) is None
    models[0].eval()
    assert layer._reuse.record is None


@pytest.mark.parametrize("kind", ("nf4", "int8"))
def test_requantized_weight_is_never_served_a_stale_norm(kind):
    """Replacing the quantized weight (what requantizing and upstream's bnb merge do) must end every kept value."""
    model = adapted(kind).eval()
    x = torch.randn(2, 3, 64)
    with torch.no_grad():
        before = model(x)
        lora_layer = model.base_model.model.up
        replacement = bnb_linear(kind, 64, 96, seed=7)
        lora_layer.base_layer.weight = replacement.weight
        if kind == "int8":
            lora_layer.base_layer.state = replacement.state
        after = model(x)
        fresh = to_upstream(model)(x)
    assert not torch.allclose(before, after)
    assert_close(after, fresh)


@pytest.mark.parametrize("kind", ("nf4", "int8"))
def test_merge_and_unload_as_upstream(kind):
    model = adapted(kind, bias=True).eval()
    theirs = to_upstream(model)
    x = torch.randn(2, 3, 64)
    with torch.no_grad():
        adapted_out = model(x)
        ours_merged = model.merge_and_unload()(x)
        theirs_merged = theirs.merge_and_unload()(x)
    # requantizing the merged weight rounds it to 4 (8) bits: judged against the adapted output's scale
    assert torch.equal(ours_merged, theirs_merged) or (ours_merged - theirs_merged).abs().max() <= 0.02 * (
        adapted_out.abs().max()
    )


# ---------------------------------------------------------------------------------------------------------------
# The QLoRA recipe end to end, and the fused tiers under the interpreter.
# ---------------------------------------------------------------------------------------------------------------


def test_qlora_recipe_trains_like_upstream(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128)  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path)
    quant = transformers.BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    base = transformers.LlamaForCausalLM.from_pretrained(tmp_path, quantization_config=quant, device_map="cpu")
    base = prepare_model_for_kbit_training(base)
    model = get_peft_model(base, LoraConfig(r=8, target_modules="all-linear", use_dora=True, init_lora_weights=False))
    model.train()
    theirs = to_upstream(model)
    ids = torch.randint(0, 128, (2, 16))
    losses = {}
    for name, m in (("ours", model), ("upstream", theirs)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        losses[name] = loss.item()
    atol, _ = TOL[torch.bfloat16]
    assert abs(losses["ours"] - losses["upstream"]) <= atol * abs(losses["upstream"]), losses
    for (name, p), (_, q) in zip(model.named_parameters(), theirs.named_parameters()):
        if p.requires_grad:
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
            assert_close(p.grad, q.grad, dtype=torch.bfloat16, scale=max(1.0, q.grad.abs().max().item()))


@pytest.mark.skipif(INTERPRET, reason="this test starts the interpreter run itself")
def test_quant_under_interpreter():
    """This file again with TRITON_INTERPRET=1: the fused training and inference tiers on quantized bases (the tier
    assertions above then require them), including the fp32 result beside a bf16 LoRA branch under autocast."""
    pytest.importorskip("triton", reason="the fused kernels need Triton (pip install triton)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PEFT_DORA_")}
    env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, "-m", "pytest", str(Path(__file__)), "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           "--rootdir", str(HERE.parents[1]), "-k", "training or eval or recompute or dense"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=HERE.parents[1], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]
