#!/usr/bin/env bash
# The GPU check, run on the `device` machine from the repository root (pieces staged by
# benchmarks/gpu/stage.sh, one per call):
#
#   bash benchmarks/gpu/on_device.sh receive   # keeps this call's piece in /tmp/sits-gpu
#   bash benchmarks/gpu/on_device.sh run       # the last piece; unpack, then the checks below into $OUT
#   bash benchmarks/gpu/on_device.sh cores     # the last piece; unpack, then only the core count's effect
#
# `cores` needs no GPU: it runs the online MLP load of benchmarks/online_profile.py on 2, 3 and 4 of the
# machine's cores (SITS_CORES), CPU workers only, alternating, two rounds, into $OUT/cores.md: what one
# more core changes, which a two-core machine cannot measure (docs/benchmarks.md).
#
# `run` stops early, with a message, when a piece is missing (the machine went back between calls:
# start over) or ONNX Runtime cannot run a session on the CUDA provider. Then, each step only if the
# time it needs is left of SITS_GPU_BUDGET seconds (default 540, inside a call's 600):
#   1. tests/gpu and the device tests (a worker pinned to the GPU serves a job and requests)
#   2. benchmarks/policies.py, device-bound and memory-bound configs (issue 3's policy table)
#   3. benchmarks/online_serving.py --quick: ceiling, naive vs SITS, idle latency on the GPU
#   4. benchmarks/offline_job.py --quick: a job against the bare loop on the GPU
#   5. the whole test suite with workers on the GPU (the Stack picks it up through NVML)
set -uo pipefail
mode=${1:?usage: on_device.sh receive|run|cores}
STAGE=/tmp/sits-gpu
OUT=${OUT:-/tmp/sits-gpu/out}
mkdir -p "$STAGE/pieces" "$OUT"
cp .gpu/carry*/piece.* "$STAGE/pieces/" 2>/dev/null
manifest=$(cat .gpu/carry*/manifest 2>/dev/null | head -1)
[ -n "$manifest" ] || { echo "no piece in this call: name one .gpu/carry<K> folder in carry" >&2; exit 2; }
read -r count total <<< "$manifest"
have=$(ls "$STAGE/pieces" | wc -l)
echo "pieces on this machine: $have of $count"
[ "$mode" = receive ] && exit 0

started=$(date +%s)
budget=${SITS_GPU_BUDGET:-540}
left() { echo $((budget - ($(date +%s) - started))); }
if [ "$have" -lt "$count" ]; then
    echo "missing pieces: the machine was given back between calls; send every piece again" >&2
    exit 3
fi
cat "$STAGE"/pieces/piece.* > "$STAGE/site.tar.xz"
if [ "$(sha256sum "$STAGE/site.tar.xz" | cut -d' ' -f1)" != "$total" ]; then
    echo "the pieces do not add up to the staged archive (sha256); stage and send them again" >&2
    exit 3
fi
rm -rf "$STAGE/site" && python3 -c "import tarfile,sys; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" \
    "$STAGE/site.tar.xz" "$STAGE" || exit 3
export PYTHONPATH="$STAGE/site:$PWD" PYTHONUNBUFFERED=1
# CUDA 13 and cuDNN from the image's nvidia-* packages; exported, so the stack's workers inherit it.
nvidia_libs=$(python3 -c "import glob,nvidia,os; print(':'.join(sorted({os.path.dirname(p) for d in nvidia.__path__ for p in glob.glob(d + '/**/lib*.so*', recursive=True)})))" 2>/dev/null)
export LD_LIBRARY_PATH="${nvidia_libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

if [ "$mode" = cores ]; then
    for round in 1 2; do
        for n in ${SITS_CORES:-2 3 4}; do
            if [ "$(left)" -lt 60 ]; then echo "stopped: $(left) s left" | tee -a "$OUT/cores.md"; break 2; fi
            echo "== round $round, $n cores ($(left) s left)" | tee -a "$OUT/cores.md"
            CUDA_VISIBLE_DEVICES= timeout "$(( $(left) - 5 ))" python3 benchmarks/online_profile.py --tuned \
                --server granian --no-spy --seconds 8 --cores "$n" >> "$OUT/cores.md" 2>&1
        done
    done
    cat "$OUT/cores.md"
    exit 0
fi

{ nvidia-smi; python3 -V; python3 -c "import onnxruntime as o; print('onnxruntime', o.__version__, o.get_available_providers())"; } \
    > "$OUT/env.txt" 2>&1
python3 - > "$OUT/cuda.txt" 2>&1 <<'PYTHON'
import tempfile, time
from pathlib import Path
import numpy as np
from sits_worker.device.pinning import Device, gpu_count
from sits_worker.model.zoo import build_zoo
from sits_worker.device.runtime import build_session
print("NVML GPUs:", gpu_count())
model = build_zoo(Path(tempfile.mkdtemp()))["convnet"]
session = build_session(model, Device("gpu", 0), 1)
print("providers:", session.get_providers())
assert session.get_providers()[0] == "CUDAExecutionProvider", "no CUDA provider: see env.txt"
rows = np.zeros((256, 3, 32, 32), np.float32)
session.run(None, {"pixels": rows})
began = time.perf_counter(); [session.run(None, {"pixels": rows}) for _ in range(20)]
print(f"convnet on the GPU: {20 * 256 / (time.perf_counter() - began):,.0f} rows/s at batch 256")
PYTHON
status=$?
cat "$OUT/env.txt" "$OUT/cuda.txt"
if [ $status -ne 0 ] && [ "${SITS_GPU_DRY_RUN:-0}" != 1 ]; then
    echo "ONNX Runtime cannot run on the CUDA provider here (cuda.txt)" >&2; exit 4
fi  # SITS_GPU_DRY_RUN=1: go on without a GPU, to try this script on a CPU machine

step() {  # step NAME SECONDS_NEEDED COMMAND...: run it within the budget, output into $OUT/NAME
    local name=$1 need=$2; shift 2
    if [ "$(left)" -lt "$need" ]; then echo "skipped $name: $(left) s left, it needs $need" | tee "$OUT/$name"; return; fi
    echo "== $name ($(left) s left)"
    timeout "$(( $(left) - 5 ))" "$@" > "$OUT/$name" 2>&1
    echo "   exit $? after $(( $(date +%s) - started )) s"; tail -n 25 "$OUT/$name"
}
step gpu-tests.log 60 python3 -m pytest -q -p no:cacheprovider tests/gpu tests/worker/device/test_devices.py tests/worker/device/test_runtime.py
step policies.md 150 python3 benchmarks/policies.py --configs device-bound,memory-bound --quick
step online.md 150 python3 benchmarks/online_serving.py --quick --parts ceiling,load,idle
step offline.md 60 python3 benchmarks/offline_job.py --quick --chunk-size default
step suite.log 120 python3 -m pytest -q --maxfail=10 -p no:cacheprovider --timeout 120
echo "done in $(( $(date +%s) - started )) s"
