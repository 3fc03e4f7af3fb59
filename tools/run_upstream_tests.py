"""Run upstream PEFT 0.21.2's own DoRA tests (from the pinned sdist) against the installed `peft`, i.e. ours.

    python tools/run_upstream_tests.py [extra pytest args]

Extracts the sdist's `tests/` into a temp dir, selects the DoRA-relevant tests (SELECT), drops the ones that need
something CI does not have (EXCLUDE, each with its reason), prints the counts and exits with pytest's status.
CI has PyPI but no Hugging Face Hub, so any test that calls `from_pretrained` on a hub model id is excluded.
Upstream's test modules import `datasets`, `diffusers` and `scipy` at module level, and `peft.tuners.lora.corda`
imports `attr`; `pip install datasets diffusers scipy attrs` covers them (no torchvision needed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools import upstream  # noqa: E402


# (module, regex on the test id after "module::"): every DoRA test of that module. Case-insensitive.
SELECT = [
    # DoRA on the custom-model matrix (Linear, Embedding, Conv1d/2d/3d, groups, GPT-2 Conv1D, multi-adapter,
    # merge/unmerge, save/load, dtypes, mixed batches, ...): every test whose id names DoRA.
    ("test_custom_models.py", r"dora"),
    # DoRA init (no-op at init, not a no-op with init_lora_weights=False), error paths, conv groups, and lora_bias
    # together with use_dora, whose id does not name DoRA ([extra_kwargs0] is {"use_dora": True}).
    ("test_initialization.py", r"dora|test_lora_with_bias_incompatible_arguments\[extra_kwargs0\]"),
    # Variant resolution, which our glue in variants.py plugs into; DoRA gradients; fan_in_fan_out unmerge.
    ("test_lora_variants.py", r"^TestLoraVariants::"),
    ("test_helpers.py", r"^TestDoraCaching::"),
    ("test_riemannian_lora.py", r"dora"),
]

# (module, regex, reason): selected above but not run in CI.
EXCLUDE = [
    ("test_custom_models.py", r"::test_gpt2_dora_merge_and_unload", "hub model: from_pretrained('gpt2')"),
    ("test_custom_models.py", r"::test_dora_save_and_load_remapping",
     "hub model: from_pretrained('peft-internal-testing/opt-125m')"),
    ("test_helpers.py", r"::test_dora_caching_(linear|embedding)$",
     "hub model: from_pretrained('trl-internal-testing/tiny-random-LlamaForCausalLM')"),
]

# DoRA tests in modules this runner does not collect at all, and why (printed for the record).
NOT_COLLECTED = [
    ("test_decoder_models.py::TestDecoderModels::test_lora_embed_scale_is_applied[True]",
     "hub model: hf-internal-testing/tiny-random-Gemma3ForCausalLM"),
    ("test_torch_compile.py (dora case)", "hub model and tokenizer (tiny-random-OPTForCausalLM) and a hub dataset"),
    ("test_common_gpu.py, test_gpu_examples.py", "need a CUDA/XPU device (require_non_cpu, bitsandbytes)"),
    ("test_decoder_models.py, test_encoder_decoder_models.py, ... (generic matrices)",
     "every model there is a hub model id"),
]

# Written next to the extracted tests: checks that the `peft` under test is ours and applies SELECT/EXCLUDE.
CONFTEST = textwrap.dedent('''
    import json, os, re
    import pytest
    import peft, peft.tuners.lora.dora as dora, peft.tuners.lora.variants as variants

    RULES = json.loads(os.environ["PEFT_UPSTREAM_TEST_RULES"])


    def pytest_configure(config):
        # The whole point: upstream's tests must exercise our DoRA, routed through the glue in variants.py.
        if not (hasattr(dora, "factored_row_norm") and variants.DoraLinearVariant is dora.DoraLinearVariant):
            pytest.exit(f"the peft under test is not ours: {dora.__file__} has no factored_row_norm", returncode=3)
        print(f"peft under test: {peft.__file__} (our DoRA: {dora.__file__})")


    def pytest_collection_modifyitems(config, items):
        selected, excluded, other = [], {}, 0
        for item in items:
            module, _, rest = item.nodeid.partition("::")
            module = module.rsplit("/", 1)[-1]
            if not any(m == module and re.search(rx, rest, re.I) for m, rx in RULES["select"]):
                other += 1
                continue
            reason = next((why for m, rx, why in RULES["exclude"] if m == module and re.search(rx, "::" + rest)), None)
            if reason:
                excluded.setdefault(reason, []).append(item.nodeid)
            else:
                selected.append(item)
        keep = {id(i) for i in selected}
        config.hook.pytest_deselected(items=[i for i in items if id(i) not in keep])
        items[:] = selected
        lines = [f"upstream DoRA tests: {len(selected)} selected, {sum(map(len, excluded.values()))} excluded, "
                 f"{other} other tests of these modules not selected"]
        for reason, ids in excluded.items():
            lines.append(f"  excluded {len(ids)} ({reason}):")
            lines += [f"    {i}" for i in ids]
        for what, reason in RULES["not_collected"]:
            lines.append(f"  not collected: {what} ({reason})")
        print("\\n" + "\\n".join(lines))
        if not selected:
            pytest.exit("no upstream DoRA test selected: the selection rules no longer match the sdist", returncode=4)
''')


def main(argv: list[str]) -> int:
    rules = {"select": SELECT, "exclude": EXCLUDE, "not_collected": NOT_COLLECTED}
    modules = sorted({m for m, _ in SELECT})
    with tempfile.TemporaryDirectory(prefix="peft-upstream-tests-") as tmp:
        root = Path(tmp)
        upstream.extract_sdist(root, "tests")
        # The sdist ships tests/ without its __init__.py and conftest.py; the modules use relative imports.
        (root / "tests" / "__init__.py").write_text("")
        (root / "conftest.py").write_text(CONFTEST)
        (root / "pytest.ini").write_text("[pytest]\nmarkers =\n    single_gpu_tests\n    multi_gpu_tests\n"
                                         "    regression\n    bitsandbytes\n")
        env = {**os.environ, "PEFT_UPSTREAM_TEST_RULES": json.dumps(rules),
               # No hub in CI: fail fast instead of waiting on the network if a test still reaches for it.
               "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        env.pop("PYTHONPATH", None)
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfEs",
               *[f"tests/{m}" for m in modules], *argv]
        print("running:", " ".join(cmd), flush=True)
        return subprocess.run(cmd, cwd=root, env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
