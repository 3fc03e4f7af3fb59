"""Quickstart: DoRA fine-tuning of a small Llama-architecture model, built from a config (no downloads).

The task is generated: every sequence counts up by a fixed stride modulo the vocabulary, so the next token is
predictable from the previous two and the loss falls within a few dozen steps. Nothing here is specific to this
fork: it is an ordinary PEFT script with ``LoraConfig(use_dora=True)``; the fork makes the DoRA layers faster.

    python examples/quickstart.py            # CPU: about half a minute on 2 cores
    python examples/quickstart.py --steps 60 --hidden 512 --layers 4
"""

import argparse
import importlib.metadata
import resource
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import peft
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import dora


def make_batch(batch, seq_len, vocab, generator, device):
    start = torch.randint(0, vocab, (batch, 1), generator=generator)
    stride = torch.randint(1, 4, (batch, 1), generator=generator)
    ids = (start + stride * torch.arange(seq_len)) % vocab
    return ids.to(device)


def peak_memory_mb(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # CPU: the process's peak resident set size (Linux reports KiB)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    vocab = 256
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=args.hidden,
        intermediate_size=int(args.hidden * 2.75),
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 128),
        max_position_embeddings=args.seq_len,
    )
    # On a GPU the base model is bf16 and the adapters fp32 under bf16 autocast (PEFT's default precision).
    base_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = LlamaForCausalLM(config).to(device=device, dtype=base_dtype)
    lora_config = LoraConfig(
        r=args.rank,
        lora_alpha=args.rank / 2,
        use_rslora=True,
        use_dora=True,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    model = get_peft_model(model, lora_config, autocast_adapter_dtype=True)
    model.print_trainable_parameters()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    generator = torch.Generator().manual_seed(args.seed)

    dora.tier_counts.clear()
    dora.norm_counts.clear()
    losses = []
    start = time.perf_counter()
    for step in range(args.steps):
        ids = make_batch(args.batch, args.seq_len, vocab, generator, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {losses[-1]:.4f}")
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start

    print(f"peft {importlib.metadata.version('peft')} from {peft.__file__}")
    print(f"device {device}, {args.steps} steps in {elapsed:.1f} s: {args.steps / elapsed:.2f} steps/s")
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    print(f"peak memory {peak_memory_mb(device):.0f} MB ({'CUDA allocated' if device.type == 'cuda' else 'RSS'})")
    print(dora.summary(model))  # on a CUDA GPU with Triton: fused_backward, not eager
    if not losses[-1] < losses[0]:
        print("the loss did not fall", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
