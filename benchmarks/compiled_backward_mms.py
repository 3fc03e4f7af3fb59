"""The matmuls of a compiled, gradient-checkpointed training step's backward graph: LoRA against DoRA.

A tiny Llama (``--layers`` decoder layers, hidden 64, intermediate 176) with LoRA or DoRA on all seven projections,
``gradient_checkpointing_enable(use_reentrant=False)``, compiled through AOTAutograd with the partitioner Inductor
uses (``min_cut_rematerialization_partition``); the compilers only record the graphs. Every ``mm``/``addmm``/``bmm``
of the forward and backward graphs is listed by its operand and output shapes, and the record keeps the shapes whose
count differs between LoRA and DoRA: what a compiled DoRA step multiplies that a compiled LoRA step does not. On CPU
in seconds; the shapes, not the times, are the result.

    python benchmarks/compiled_backward_mms.py --out benchmarks/results/profile/compiled_backward_mms.json
"""

from __future__ import annotations

import argparse
import collections
import json

import torch


HIDDEN, INTERMEDIATE, TOKENS = 64, 176, 32
MATMULS = ("aten.mm.default", "aten.addmm.default", "aten.bmm.default")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _recorder(graphs: dict, kind: str):
    def compiler(gm, example_inputs):
        found = []
        for node in gm.graph.nodes:
            if node.op == "call_function" and str(node.target) in MATMULS:
                shapes = [tuple(a.meta["val"].shape) for a in node.args if hasattr(a, "meta") and "val" in a.meta]
                found.append(f"{' x '.join(map(str, shapes))} -> {tuple(node.meta['val'].shape)}")
        graphs[kind].append(found)
        return gm.forward

    return compiler


def graph_mms(dora: bool, layers: int) -> dict:
    """{"forward": Counter, "backward": Counter} of the matmul shapes in the compiled step's graphs."""
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from transformers import LlamaConfig, LlamaForCausalLM

    from peft import LoraConfig, get_peft_model

    torch._dynamo.reset()
    graphs = {"forward": [], "backward": []}
    backend = aot_autograd(
        fw_compiler=_recorder(graphs, "forward"),
        bw_compiler=_recorder(graphs, "backward"),
        partition_fn=min_cut_rematerialization_partition,
    )
    config = LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, num_hidden_layers=layers, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    base = LlamaForCausalLM(config)
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(base, LoraConfig(r=8, target_modules=TARGETS, use_dora=dora)).train()
    ids = torch.randint(0, 128, (1, TOKENS))
    torch.compile(model, backend=backend)(input_ids=ids, labels=ids).loss.backward()
    return {kind: collections.Counter(mm for graph in found for mm in graph) for kind, found in graphs.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--out")
    args = p.parse_args(argv)
    found = {"lora": graph_mms(False, args.layers), "dora": graph_mms(True, args.layers)}
    diff = {}
    for kind in ("forward", "backward"):
        lora, dora = found["lora"][kind], found["dora"][kind]
        diff[kind] = {mm: [lora[mm], dora[mm]] for mm in sorted(set(lora) | set(dora)) if lora[mm] != dora[mm]}
        print(f"{kind}: {sum(lora.values())} matmuls with LoRA, {sum(dora.values())} with DoRA")
        for mm, (n_lora, n_dora) in diff[kind].items():
            print(f"  {mm}: LoRA {n_lora}, DoRA {n_dora}")
    record = {
        "torch": torch.__version__,
        "layers": args.layers,
        "shape": {"hidden": HIDDEN, "intermediate": INTERMEDIATE, "tokens": TOKENS, "rank": 8},
        "totals": {impl: {kind: sum(c.values()) for kind, c in v.items()} for impl, v in found.items()},
        "differing_lora_dora": diff,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
