"""GPU smoke of the pipeline through the plain commands, each in a fresh copy of the project:

  digits      `dvc repro` of the default pipeline on the built-in digits (train, evaluate, export
              with its parity gate: a GPU-trained model exported), `dvc metrics show`, and
              `visionflow predict` with the exported ONNX model on three test images;
  resume      the train stage stopped by a SIGKILL after epoch 1 and run again ends with the
              weights of an uninterrupted 3-epoch run, bit for bit;
  finetune    resnet18 from weights made here (no download), two epochs on a made photo folder,
              the first with the backbone frozen (`dvc repro train`).

Every command's output goes to OUT/<check>.log; a line per check says ok or FAILED, and the exit
status is 1 when one failed. `--device cpu` runs the same commands here (slowly; the numbers mean
nothing), to try the script where no GPU is.

    python -m tools.gpu_smoke [--device cuda] [--out DIR] [--only digits,resume,finetune]
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import yaml
from PIL import Image

from bench.photos import generate  # run as a module from the checkout: bench/ is importable
from bench.project_files import FILES

ROOT = Path(__file__).resolve().parents[1]


def project(dest: Path, change: dict) -> Path:
    """A committed git copy of the project with `change` merged into params.yaml."""
    for name in FILES:
        src, target = ROOT / name, dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, target, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        elif src.exists():
            shutil.copy2(src, target)
    params = yaml.safe_load((dest / "params.yaml").read_text())
    for section, values in change.items():
        params[section] |= values
    (dest / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    for cmd in (["git", "init", "-q", "-b", "main"], ["git", "add", "-A"]):
        subprocess.run(cmd, cwd=dest, check=True)
    who = ["-c", "user.name=smoke", "-c", "user.email=smoke@localhost"]
    subprocess.run(["git", *who, "commit", "-q", "-m", "smoke"], cwd=dest, check=True)
    return dest


class Log:
    """Runs commands in a project, their output into one log file; the first failure raises."""

    def __init__(self, path: Path):
        self.file = path.open("w")

    def run(self, cwd: Path, *cmd: str, fault: str = "", expect: int = 0) -> str:
        env = {**os.environ, "DVC_NO_ANALYTICS": "1", "VISIONFLOW_FAULT": fault}
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(cwd / "src"), str(cwd), env.get("PYTHONPATH")])
        )
        started = time.perf_counter()
        result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - started
        self.file.write(f"$ {' '.join(cmd)}  ({seconds:.1f} s, exit {result.returncode})\n")
        self.file.write(result.stdout + result.stderr + "\n")
        self.file.flush()
        if result.returncode != expect:
            raise AssertionError(f"{' '.join(cmd)} exited {result.returncode}, not {expect}")
        return result.stdout + result.stderr


def digits(work: Path, device: str, log: Log) -> str:
    p = project(work / "digits", {"train": {"device": device}})
    out = log.run(p, sys.executable, "-m", "dvc", "repro")
    picked = next(line for line in out.splitlines() if line.startswith("train: amp "))
    log.run(p, sys.executable, "-m", "dvc", "metrics", "show")
    x = np.load(p / "data/prepared/test_x.npy")
    images = []
    for i in range(3):
        images.append(p / f"digit{i}.png")
        Image.fromarray(x[i].squeeze(-1)).save(images[-1])
    model = "results/export/model.onnx"
    predicted = log.run(
        p, sys.executable, "-m", "visionflow.cli", "predict", *map(str, images), "--model", model
    )
    assert len(predicted.strip().splitlines()) >= 3, predicted
    return picked


def weights(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]


def resume(work: Path, device: str, log: Log) -> str:
    p = project(work / "resume", {"train": {"device": device, "epochs": 3}})
    log.run(p, sys.executable, "-m", "dvc", "repro", "prepare")
    stage = [sys.executable, "-m", "pipeline.train", "--data", "data/prepared"]
    log.run(p, *stage, "--out", "whole", "--checkpoints", "whole-state")
    stopped = [*stage, "--out", "stopped", "--checkpoints", "stopped-state"]
    log.run(p, *stopped, fault="train.epoch_end@epoch=1:kill", expect=-9)
    out = log.run(p, *stopped)
    assert "resuming from" in out, out[-2000:]
    a, b = weights(p / "whole/model.pt"), weights(p / "stopped/model.pt")
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"the resumed run's weights differ: {differ[:5]}"
    return f"{len(a)} tensors equal"


def finetune(work: Path, device: str, log: Log) -> str:
    from torchvision.models import get_model

    p = project(
        work / "finetune",
        {
            "prepare": {"source": "imagefolder", "path": "data/photos", "image_size": 64},
            "train": {
                "device": device,
                "model": "resnet18",
                "pretrained": "data/pretrained/r18.pth",
            },
        },
    )
    params = yaml.safe_load((p / "params.yaml").read_text())
    params["prepare"] |= {"color": "rgb", "min_per_class": 2}
    params["train"] |= {
        "freeze_epochs": 1,
        "epochs": 2,
        "batch_size": 32,
        "backbone_lr_factor": 0.1,
    }
    (p / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    generate(p / "data/photos", 200, classes=4, size=(160, 120))
    torch.manual_seed(1)  # "pretrained": any weights in torchvision's layout, made here
    (p / "data/pretrained").mkdir(parents=True, exist_ok=True)
    torch.save(get_model("resnet18").state_dict(), p / "data/pretrained/r18.pth")
    out = log.run(p, sys.executable, "-m", "dvc", "repro", "train")
    epochs = [line for line in out.splitlines() if line.startswith("epoch ")]
    assert len(epochs) == 2, out[-2000:]
    return epochs[-1]


CHECKS = {"digits": digits, "resume": resume, "finetune": finetune}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="train.device: cuda, or cpu to try it")
    parser.add_argument("--out", type=Path, default=Path("gpu-smoke"), help="logs go here")
    parser.add_argument("--only", default=",".join(CHECKS), help="checks to run, by name")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    failed = 0
    with tempfile.TemporaryDirectory(prefix="visionflow-smoke-") as work:
        for name in args.only.split(","):
            started = time.perf_counter()
            try:
                said = CHECKS[name](Path(work), args.device, Log(args.out / f"{name}.log"))
                verdict = f"ok: {said}"
            except Exception as e:  # the next check still runs; the log has the output
                failed += 1
                verdict = f"FAILED: {e} (see {args.out / name}.log)"
            print(f"smoke {name} ({time.perf_counter() - started:.0f} s): {verdict}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
