"""Load an adapter that ``train.py`` saved (under any engine) into the same base model on one device and print the
logits of a fixed batch: run it once with this package and once with upstream PEFT first on ``PYTHONPATH``; the two
lines must agree (``--size``, ``--layers``, ``--rank`` and ``--seed`` as for the training run).

    python examples/multi_gpu/load_check.py --adapter dora-multi-gpu-out --size 1b --layers 2
"""

import argparse
import sys
from pathlib import Path

import torch


sys.path.insert(0, str(Path(__file__).resolve().parent))
from train import CountingTask, build  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--adapter", required=True)
    p.add_argument("--model")
    p.add_argument("--size", default="1b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    import peft
    from peft import PeftModel

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = PeftModel.from_pretrained(build(args), args.adapter).to(device).eval()
    ids = CountingTask(2, args.seq_len, model.config.vocab_size, args.seed + 1).ids.to(device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    ours = hasattr(sys.modules.get("peft.tuners.lora.dora"), "factored_row_norm")
    name = "ours" if ours else "upstream"
    print(f"peft {peft.__version__} ({name}): logits sum {logits.sum().item():.6e} "
          f"abs-sum {logits.abs().sum().item():.6e} first {logits[0, -1, :4].tolist()}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
