"""Test-wide setup. ``tests/`` holds shared helpers (``import dora_testing``) for test modules in sub-folders; the
package under test is always the installed ``peft``, never the repository's overlay folder."""

import os
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
# Unit tests must see the defaults, whatever the developer's shell exports.
for _name in (
    "PEFT_DORA_FUSED",
    "PEFT_DORA_FUSED_BACKWARD",
    "PEFT_DORA_NORM_CACHE",
    "PEFT_DORA_NORM_CHUNK_MB",
    "PEFT_DORA_FWD_CHUNK_MB",
):
    os.environ.pop(_name, None)
