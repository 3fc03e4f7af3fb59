"""QDoRA: the QLoRA recipe with ``use_dora=True`` – a 4-bit (NF4, double quantization, bf16 compute) or 8-bit base,
``prepare_model_for_kbit_training``, DoRA adapters on every linear layer, gradient checkpointing, AdamW, autocast.

The base is a small Llama-architecture model built from a config and saved locally, so nothing is downloaded; pass
``--model NAME_OR_PATH`` for a real checkpoint. The task is generated (sequences counting up by a fixed stride), so
the loss falls within a few dozen steps. Needs ``pip install bitsandbytes`` (``pip install ".[bnb]"`` pins it); runs
on a CUDA GPU, or slowly on bitsandbytes' CPU backend.

    python examples/qdora.py                       # 4-bit NF4, tiny model
    python examples/qdora.py --quant int8 --steps 40
    python examples/qdora.py --model meta-llama/Llama-3.2-1B --seq-len 512 --rank 16
"""

import argparse
import tempfile

import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from peft.tuners.lora import dora


def quantization(kind: str) -> BitsAndBytesConfig:
    if kind == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=kind, bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.bfloat16)  # fmt: skip


def tiny_model(path: str, vocab: int) -> None:
    config = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a checkpoint (default: a tiny Llama built from a config)")
    parser.add_argument("--quant", default="nf4", choices=("nf4", "fp4", "int8"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if path is None:
            path = tmp
            tiny_model(path, vocab=256)
        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=quantization(args.quant),
                                                     device_map=device)  # fmt: skip
    model = prepare_model_for_kbit_training(model)  # fp32 norms and embeddings, gradient checkpointing
    config = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules="all-linear", use_dora=True,
                        task_type="CAUSAL_LM")  # fmt: skip
    model = get_peft_model(model, config)
    model.print_trainable_parameters()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    model.train()
    for step in range(args.steps):
        start = torch.randint(0, vocab, (args.batch, 1), generator=generator)
        stride = torch.randint(1, 4, (args.batch, 1), generator=generator)
        ids = ((start + stride * torch.arange(args.seq_len)) % vocab).to(device)
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss.item():.4f}")
    print(dora.summary(model))


if __name__ == "__main__":
    main()
