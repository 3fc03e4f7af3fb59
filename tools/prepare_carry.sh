#!/usr/bin/env bash
# Fill .carry-bench/ (git-ignored; pass it as `carry` to the device tool) with what the GPU machine cannot fetch:
# our wheel built from this tree, the pinned upstream wheel, DeepSpeed and bitsandbytes with their pure-Python or
# Python 3.12 dependencies (the GPU machine's python3 is 3.12), and setup.sh, which installs them there.
#
#   bash tools/prepare_carry.sh            # here, in the repository root, with the dev venv active
#   . .carry-bench/setup.sh                # there, first in every device command
set -euo pipefail
cd "$(dirname "$0")/.."
CB=.carry-bench
mkdir -p "$CB"
rm -f "$CB"/peft-0.21.2+dora*.whl
python -m pip wheel -q --no-deps --no-build-isolation -w "$CB" .
cp "$(python tools/upstream.py wheel)" "$CB"/
DS_BUILD_OPS=0 python -m pip wheel -q --no-deps -w "$CB" deepspeed==0.19.8 hjson py-cpuinfo ninja einops pydantic \
    annotated_types typing_inspection
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d "$CB" \
    --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64 msgpack "pydantic_core==$(
    python -c 'import pydantic_core; print(pydantic_core.__version__)' 2>/dev/null || echo 2.50.5)" bitsandbytes==0.50.2
# bitsandbytes' wheel holds a native library per CUDA and ROCm version (~43 MB): keep the CUDA 13 ones the GPU
# machine's torch (cu130) loads, or the wheels and the tree pass the device tool's 64 MiB carry limit
python - "$CB"/bitsandbytes-*.whl <<'SLIM'
import re, sys, zipfile
from pathlib import Path
path = Path(sys.argv[1])
drop = re.compile(r"bitsandbytes/libbitsandbytes_(cuda(?!13)\d+|rocm\d+)\.so$")
with zipfile.ZipFile(path) as z:
    items = [(i, z.read(i)) for i in z.infolist() if not drop.search(i.filename)]
slim = path.with_suffix(".slim")
with zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as out:
    for info, data in items:
        if info.filename.endswith(".dist-info/RECORD"):  # the dropped files' lines go too
            data = "".join(l for l in data.decode().splitlines(True) if not drop.search(l.split(",")[0])).encode()
        out.writestr(info, data)
slim.replace(path)
SLIM
cat > "$CB/setup.sh" <<'SETUP'
# source me on the GPU machine, in the repository root: ours into /tmp/ours (first on PYTHONPATH), upstream into
# /tmp/upstream, DeepSpeed and bitsandbytes into python3's site-packages; NVLink multicast stays off.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
CB=$PWD/.carry-bench
# a warm machine keeps /tmp from the last call, and pip --target leaves an existing package in place: start clean,
# or a rebuilt wheel is silently not the one that runs
rm -rf /tmp/ours /tmp/upstream
python3 -m pip install -q --no-deps --no-index --target /tmp/ours "$CB"/peft-0.21.2+dora*.whl >/dev/null 2>&1
python3 -m pip install -q --no-deps --no-index --target /tmp/upstream "$CB"/peft-0.21.2-py3-none-any.whl >/dev/null 2>&1
python3 -m pip install -q --no-deps --no-index "$CB"/bitsandbytes-*.whl "$CB"/deepspeed-*.whl "$CB"/hjson-*.whl \
    "$CB"/msgpack-*.whl "$CB"/py_cpuinfo-*.whl "$CB"/ninja-*.whl "$CB"/einops-*.whl 2>&1 | tail -2
python3 -c "import pydantic" 2>/dev/null || python3 -m pip install -q --no-deps --no-index "$CB"/pydantic-*.whl \
    "$CB"/pydantic_core-*.whl "$CB"/annotated_types-*.whl "$CB"/typing_inspection-*.whl 2>&1 | tail -2
PEFT_UPSTREAM_WHEEL=$(ls "$CB"/peft-0.21.2-py3-none-any.whl)
export PEFT_UPSTREAM_WHEEL PEFT_OURS=/tmp/ours PEFT_UPSTREAM=/tmp/upstream
export PYTHONPATH=/tmp/ours${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import peft, torch; print('peft', peft.__version__, peft.__file__, 'torch', torch.__version__, torch.cuda.device_count(), 'gpus')"
SETUP
ls "$CB"
