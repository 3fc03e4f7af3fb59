"""DoRA fine-tuning with the transformers Trainer on several GPUs (accelerate: FSDP2, FSDP1, DeepSpeed ZeRO-2/3).

An ordinary PEFT + Trainer script: ``LoraConfig(use_dora=True)`` on all linear layers, gradient checkpointing, AdamW.
The engine comes from the accelerate config, one per file next to this script:

    accelerate launch --config_file examples/multi_gpu/fsdp2.yaml examples/multi_gpu/train.py
    accelerate launch --config_file examples/multi_gpu/fsdp1.yaml examples/multi_gpu/train.py
    accelerate launch --config_file examples/multi_gpu/zero3.yaml examples/multi_gpu/train.py   # also zero2.yaml

The model is a Llama built from a config (random weights, no downloads; ``--size`` 1b, 8b or tiny) or any causal LM
by name (``--model``). The task is generated (sequences that count up by a fixed stride), so the loss falls within a
few dozen steps. At the end rank 0 prints the losses and saves the adapter, which loads in upstream PEFT too.
accelerate's FSDP and DeepSpeed engines need CUDA GPUs (with ``--cpu`` accelerate runs each process unsharded, which
the ``engine:`` line at the end shows); DoRA under FSDP2 on CPU is ``tests/tuners/lora/test_dora_fsdp2_cpu.py``.
"""

import argparse

import torch
from torch.utils.data import Dataset
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from peft import LoraConfig, get_peft_model


SIZES = {  # Llama-3.2-1B- and Llama-3.1-8B-shaped layers; tiny for a CPU check
    "tiny": dict(hidden_size=64, intermediate_size=176, num_attention_heads=4, num_key_value_heads=2, vocab_size=256),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8),
}


class CountingTask(Dataset):
    """Sequences ``start + stride·t`` modulo the vocabulary: the next token follows from the previous two."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        stride = torch.randint(1, 4, (n, 1), generator=g)
        self.ids = (start + stride * torch.arange(seq_len)) % vocab

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def build(args):
    if args.model:
        return AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    config = LlamaConfig(num_hidden_layers=args.layers, max_position_embeddings=max(256, args.seq_len),
                         **SIZES[args.size])  # fmt: skip
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(config)


def parameters_sharded(model) -> bool:
    """Whether the engine keeps each parameter in pieces across processes: FSDP2's DTensors, ZeRO-3's partitions
    (``ds_id``), or FSDP1 units that shard their flat parameter (any strategy but NO_SHARD, on several ranks)."""
    for module in model.modules():
        if type(module).__name__ == "FullyShardedDataParallel":
            if module.sharding_strategy.name != "NO_SHARD" and module.world_size > 1:
                return True
    return any(type(q).__name__ == "DTensor" or hasattr(q, "ds_id") for q in model.parameters())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a causal LM on the Hub or on disk (default: a Llama built from --size)")
    p.add_argument("--size", choices=sorted(SIZES), default="1b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=1, help="per device")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dora", type=int, default=1, help="0: plain LoRA, the same engine's baseline")
    p.add_argument("--bf16", type=int, default=-1, help="bf16 autocast (default: on a GPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="dora-multi-gpu-out")
    args = p.parse_args(argv)

    model = build(args)
    lora = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules="all-linear", use_dora=bool(args.dora),
                      task_type="CAUSAL_LM")  # fmt: skip
    model = get_peft_model(model, lora)
    vocab = model.config.vocab_size
    train = CountingTask(args.steps * args.batch * 8, args.seq_len, vocab, args.seed)
    bf16 = torch.cuda.is_available() if args.bf16 < 0 else bool(args.bf16)
    training = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        bf16=bf16,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=args.seed,
        ddp_find_unused_parameters=False,
    )
    trainer = Trainer(model=model, args=training, train_dataset=train)
    trainer.train()
    losses = [round(h["loss"], 4) for h in trainer.state.log_history if "loss" in h]
    sharded = parameters_sharded(trainer.model_wrapped)
    if trainer.is_world_process_zero():
        print(f"engine: {trainer.accelerator.distributed_type}, {trainer.accelerator.num_processes} processes, "
              f"parameters sharded: {sharded}")  # fmt: skip
        print(f"losses: {losses}")
    if trainer.is_fsdp_enabled:  # a sharded state dict saves as shards: the adapter itself needs the full one
        trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
    trainer.save_model(args.output_dir)  # the adapter; under FSDP/ZeRO-3 the Trainer gathers it first
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
