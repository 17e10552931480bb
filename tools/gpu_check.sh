#!/usr/bin/env bash
# The GPU check (#44, `make test-gpu`): every test marked `gpu`, then a GPU smoke of the pipeline
# through its plain commands (tools/gpu_smoke.py), on a machine with CUDA, from this checkout. On a
# bare machine (the NVIDIA PyTorch image: no DVC, DVCLive, pydantic) it first installs the wheels
# that tools/gpu_wheels.sh downloaded into .whl/, each one the machine lacks, into $GPU_SITE
# (default /tmp/site) with `pip install --no-index --no-deps --target`. Logs go to OUT.
# WHEELS names another folder of wheels; GPU_SMOKE_DEVICE=cpu runs the smokes where no GPU is.
#
#     tools/gpu_check.sh [OUT]      # default gpu-check/
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-check}
py=${PYTHON:-python3}
site=${GPU_SITE:-/tmp/site}
wheels=${WHEELS:-.whl}
mkdir -p "$out"
if compgen -G "$wheels/*.whl" >/dev/null; then
    normal() { tr 'A-Z_.' 'a-z--'; }  # a distribution's name as pip compares them
    have=$("$py" -m pip list --format=freeze 2>/dev/null | cut -d= -f1 | normal)
    missing=()
    for wheel in "$wheels"/*.whl; do
        name=$(basename "$wheel" | cut -d- -f1 | normal)
        grep -qx "$name" <<<"$have" || missing+=("$wheel")
    done
    if ((${#missing[@]})); then
        echo "installing ${#missing[@]} wheels into $site"
        "$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" "${missing[@]}"
    fi
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
# the checkout's code first; the tests pass PYTHONPATH on to the processes they start
export PYTHONPATH="$PWD/src:$PWD:$PYTHONPATH"
if ! command -v python >/dev/null; then  # dvc.yaml's stages run `python`
    # a script, not a link: a venv's interpreter reached through a link elsewhere loses the venv
    # (in a new folder: writing through an old link there would overwrite the interpreter)
    bin=$(mktemp -d)
    printf '#!/bin/sh\nexec %q "$@"\n' "$(command -v "$py")" >"$bin/python"
    chmod +x "$bin/python"
    export PATH="$bin:$PATH"
fi
export DVC_NO_ANALYTICS=1
"$py" -c "import torch; print(torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'NO GPU')" | tee "$out/device.txt"
status=0
# only the files that hold gpu tests: the others import Prefect and the like, which a bare machine lacks
mapfile -t files < <(grep -l "pytest.mark.gpu" tests/test_*.py)
"$py" -m pytest -p no:randomly -p no:cacheprovider -m gpu -rs -q "${files[@]}" 2>&1 |
    tee "$out/pytest-gpu.log" || status=1
"$py" -m tools.gpu_smoke --device "${GPU_SMOKE_DEVICE:-cuda}" --out "$out" || status=1
echo "gpu check: $([ $status = 0 ] && echo passed || echo FAILED) (logs in $out/)"
exit $status
