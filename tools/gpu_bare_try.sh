#!/usr/bin/env bash
# Tries the GPU check's bare-machine path here, where no GPU is: a venv holding only the packages
# of the NVIDIA PyTorch image that the project touches (no DVC, DVCLive, pydantic or cffi; the
# image's packages are listed in docs/benchmarks.md, "The GPU check"), this Python's build of tools/gpu_wheels.sh's list, and
# tools/gpu_check.sh with its smokes on the CPU. A package the list lacks shows here as the
# ImportError it would be on the GPU machine. About 3 minutes (the venv's torch comes from pip's
# cache); everything goes under DIR, never into the checkout's .whl/.
#
#     tools/gpu_bare_try.sh [DIR]      # default /tmp/gpu-bare
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-/tmp/gpu-bare}
frozen=$(.venv/bin/pip freeze)
pin() { grep -i -m1 "^$1==" <<<"$frozen"; }
# torch as this venv has it (another version is gigabytes); the ONNX stack as the image had it
# (the NVIDIA PyTorch image of 2026-11); numpy's 2.5 there needs Python 3.12
image=(
    "$(pin torch)" "$(pin torchvision)" onnx==1.23.1 onnx-ir==1.0.0 onnxruntime==1.30.0
    onnxscript==0.7.2 numpy pillow pytest pytest-xdist pyyaml psutil scikit-learn matplotlib rich
    tqdm tabulate pathspec fsspec attrs colorama pygments markdown-it-py mdurl safetensors requests
    typer click packaging networkx filelock jinja2
)
rm -rf "$dir" && python3 -m venv "$dir/venv"
"$dir/venv/bin/pip" install -q "${image[@]}"
# what the image lacks, even where one of the above pulled it in
"$dir/venv/bin/pip" uninstall -q -y pydantic pydantic_core annotated-types typing-inspection \
    cffi pycparser dvc dvclive pygit2 2>/dev/null || true
version=$("$dir/venv/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
WHEELS="$dir/wheels" PY_VERSION="$version" tools/gpu_wheels.sh
# a plain PATH: nothing of the project's venv may stand in for what the wheels must bring
env -u VIRTUAL_ENV -u PYTHONPATH PATH=/usr/local/bin:/usr/bin:/bin PYTHON="$dir/venv/bin/python" \
    WHEELS="$dir/wheels" GPU_SITE="$dir/site" GPU_SMOKE_DEVICE=cpu tools/gpu_check.sh "$dir/out"
