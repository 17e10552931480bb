#!/usr/bin/env bash
# Downloads here, into .whl/ (ignored by git), the wheels the GPU check needs beyond what the NVIDIA
# PyTorch image has (Python 3.12, torch, torchvision, onnx, onnxruntime, numpy, PIL, pytest, yaml,
# psutil, sklearn, matplotlib; no DVC, DVCLive or pydantic), at the versions of this project's
# venv. tools/gpu_check.sh installs them there with `pip install --no-index --no-deps --target`,
# each one only when the image lacks it (so the image's own builds are never shadowed).
#
#     tools/gpu_wheels.sh [VENV_PIP]      # default .venv/bin/pip
#
# WHEELS (default .whl) and PY_VERSION (default 3.12, the image's) serve tools/gpu_bare_try.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
pip=${1:-.venv/bin/pip}
wheels=${WHEELS:-.whl}
# DVC and DVCLive with what they import (the list that ran `dvc repro` on an H200, 2026-12-04),
# pygit2 (and its cffi, which the image lacks) for `dvc metrics show`, onnxscript and onnx-ir
# for the dynamo ONNX export, and the few small ones the stages and tests import that such an
# image may lack.
packages=(
    annotated-types atpublic configobj diskcache dpath dulwich dvc dvc-data dvc-http dvc-objects
    dvc-render dvc-studio-client dvclive flatten-dict flufl.lock funcy orjson platformdirs
    pydantic pydantic_core pydot pygtrie ruamel.yaml scmrepo shtab sqltrie typing-inspection
    voluptuous wcwidth zc.lockfile
    pygit2 onnxscript onnx-ir safetensors tqdm pathspec tabulate rich Pygments markdown-it-py mdurl
    colorama attrs fsspec cffi
)
frozen=$("$pip" freeze)
pins=()
for name in "${packages[@]}"; do
    pin=$(grep -i -m1 "^${name//./\\.}==" <<<"$frozen") || { echo "not in the venv: $name" >&2; exit 1; }
    pins+=("$pin")
done
mkdir -p "$wheels"
"$pip" download --quiet --no-deps --only-binary=:all: --python-version "${PY_VERSION:-3.12}" \
    --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$wheels" "${pins[@]}"
echo "$(ls "$wheels" | wc -l) wheels in $wheels/, $(du -sh "$wheels" | cut -f1)"
