#!/usr/bin/env bash
# The GPU half of the checks, on a machine with one CUDA device (the device tool's GPU machine):
# tests/test_cuda.py (async copies on a side stream into pinned buffers, restores onto the device,
# a bit-for-bit resume, LoRA with frozen units, FSDP2 on NCCL), then bench_async.py on the GPU.
#
#     bash bench/gpu_check.sh OUT_DIR [LAYERS HIDDEN]
#
# That machine's Python (3.12, its own torch) lacks pydantic: wheels of it and its needs, for
# cp312 manylinux, in .whl/ are installed first to /tmp/site (pip download ... -d .whl).
set -u
out=${1:-bench/out/gpu}
layers=${2:-8}
hidden=${3:-1024}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__, torch.cuda.get_device_name())"
nproc; free -g | head -2; df -h /tmp | tail -1
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$out/tests.log"
timeout 330 python3 bench/bench_async.py --device cuda --threads all --layers "$layers" --hidden "$hidden" \
    --steps-between 10 --saves 2 --out /tmp/bench-async 2>&1 | tee "$out/bench_async.log"
