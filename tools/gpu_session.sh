#!/usr/bin/env bash
# Everything #44 asks of a GPU in one run (docs/benchmarks.md says how long), from this checkout and
# the wheels of tools/gpu_wheels.sh (.whl/, carried with the checkout): the GPU check (`make
# test-gpu`), then the benchmarks, each under its own time limit so that one that overruns leaves
# the others their time. Everything goes under OUT (default $OUT, else gpu-session/); the numbers
# land in OUT/summary.md, to copy, dated, into docs/benchmarks.md.
#
#     tools/gpu_session.sh [OUT]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-gpu-session}}
mkdir -p "$out"
py=${PYTHON:-python3}
summary="$out/summary.md"
step() {  # step SECONDS NAME COMMAND...: its output to OUT/NAME.txt and the summary
    local limit=$1 name=$2 started=$SECONDS
    shift 2
    timeout "$limit" "$@" >"$out/$name.txt" 2>&1
    local status=$?
    { echo "## $name (exit $status, $((SECONDS - started)) s of $limit)"; echo '```'; echo "\$ $*"
      tail -n 40 "$out/$name.txt"; echo '```'; } >>"$summary"
}
echo "# GPU session $(date -u +%F), $(git rev-parse --short HEAD 2>/dev/null)" >"$summary"
# 1. the check; it installs the wheels the machine lacks into /tmp/site
step 300 check tools/gpu_check.sh "$out/check"
export PYTHONPATH="$PWD/src:$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
"$py" -c "import torch; print(torch.cuda.get_device_name(), 'torch', torch.__version__)" >>"$summary"
# 2. the stage against the hand-written loop: ResNet-50, 224 px from 256, bf16, channels_last, batch 256
step 150 peer "$py" bench/gpu_peer_bench.py --images 8000 --epochs 4 --out "$out/peer"
# 3. what amp and channels_last do per model at 32 px (the rule of train.amp/channels_last: auto)
step 90 settings-32px "$py" bench/gpu_bench.py --images 20000 --epochs 2
# 4. torch.compile on ResNet-50 and EfficientNet-B0 (the warm-up epoch holds the compile time)
step 90 compile-resnet50 "$py" bench/gpu_bench.py --finetune --images 4096 --compile default
step 45 eager-efficientnet_b0 "$py" bench/gpu_bench.py --finetune --images 4096 --arch efficientnet_b0
step 120 compile-efficientnet_b0 "$py" bench/gpu_bench.py --finetune --images 4096 --arch efficientnet_b0 --compile default
cat "$summary"
