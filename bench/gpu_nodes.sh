#!/usr/bin/env bash
# Issue 32's node benches on the GPU machine (16 idle host cores; the device tool's machine):
# tests/test_cuda.py first (the GPU paths still work), then the recovery after a node loss at
# 390 MB per rank (training on the CPU), then a save at every step on two "nodes" against none
# and dcp.async_save with both nodes' ranks training on the GPU (DDP over gloo): steps on the
# GPU and idle host cores for the background work, the premise of the < 5% target.
#
#     bash bench/gpu_nodes.sh OUT_DIR
#
# That machine's Python (3.12, its own torch) lacks pydantic, obstore, moto and boto3: wheels of
# them and their needs, for cp312 manylinux, in .whl/ (pip download --no-deps ... -d .whl) are
# installed into it first.
set -u
out=${1:-bench/out/gpu-nodes}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl || exit 1
fi
export PYTHONPATH=$PWD:$PWD/bench PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false BENCH_OUT=/tmp/bench-out
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import sys, torch, transformers, moto, obstore, pydantic; print(sys.version.split()[0], torch.__version__, transformers.__version__, moto.__version__, obstore.__version__, pydantic.__version__)"
nproc; free -g | head -2; df -h /dev/shm /tmp | tail -2
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$out/tests.log"
uptime
timeout 170 python3 bench/bench_nodes.py --only recovery --restores 2 --layers 8 --hidden 512 --steps 2 --every 3 \
    2>&1 | tee "$out/recovery.log"
uptime
# Both nodes' ranks train on the GPU (DDP over gloo): steps on the GPU, the host's cores idle.
timeout 280 python3 bench/bench_nodes.py --device cuda --layers 8 --hidden 768 --seq 1024 --batch 16 \
    --steps 8 --rounds 2 --restores 1 --every 10 2>&1 | tee "$out/saves-cuda.log"
uptime
