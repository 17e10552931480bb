"""The train stage against the hand-written loop (#44), side by side in one run, on the same data
shape, model, precision and batch: ResNet-50, random resized 224 px crops and flips from a 256 px
uint8 cache held on the device, bf16, channels_last, SGD with momentum 0.9, batch 256.

  peer     bench/plain_peer.py: plain PyTorch and torchvision, no visionflow;
  loop     bench/gpu_bench.py --finetune: the project's train_one_epoch;
  stage    `python -m pipeline.train` as dvc.yaml runs it, on a cache of random images of the same
           size (weights made here, so that it random-resize-crops to 224 as fine-tuning does),
           with train.deterministic false (cuDNN autotunes, as in the peer), then true (the
           default), and with train.compile true when `--compile` is given. (The loop always
           crops 224 px from 256: `--size` changes the peer and the stage only.)

Prints a markdown table of images/s (the timed epochs: the peer's and the loop's after a warm-up
epoch; the stage's epochs 2 and on, from its curves) and each one's ratio to the peer; the
commands' output goes to OUT/. `--device cpu` with tiny sizes runs it here (numbers meaningless).

    python bench/gpu_peer_bench.py [--images 8000] [--batch 256] [--epochs 4] [--compile] [--out DIR]
    python bench/gpu_peer_bench.py --device cpu --images 16 --batch 8 --epochs 2 --size 64
"""

import argparse
import csv
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]


def run(cmd: list[str], cwd: Path, log: Path) -> str:
    env = {**os.environ, "DVC_NO_ANALYTICS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH")])
    )
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    log.write_text(f"$ {' '.join(cmd)}\n{result.stdout}{result.stderr}")
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({result.returncode}); see {log}")
    return result.stdout


def stage_project(work: Path, args) -> Path:
    """A folder the train stage runs in: params.yaml, a cache of random images, weights."""
    from torchvision.models import get_model

    from visionflow.data import dataset, sources

    rng = np.random.default_rng(0)
    count = args.images * 10 // 8  # the stage keeps 80% for training (val 0.1, test 0.1)
    images = rng.integers(0, 256, (count, args.size, args.size, 3), dtype=np.uint8)
    classes = max(2, min(100, count // 10))  # 100, as the others; fewer in a tiny try
    labels = np.arange(count) % classes
    names = [f"c{k}" for k in range(classes)]
    source = sources.Source(list(images), labels, names, None, [f"#{i}" for i in range(count)])
    decode = dataset.Decode(args.size, "rgb")
    dataset.build_cache(
        source, work / "prepared", decode, val_fraction=0.1, test_fraction=0.1, seed=0, dedupe=False
    )
    (work / "pretrained").mkdir()
    torch.save(get_model("resnet50").state_dict(), work / "pretrained/r50.pth")
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["train"] |= {
        "model": "resnet50",
        "pretrained": "pretrained/r50.pth",
        "device": args.device,
        "epochs": args.epochs,
        "batch_size": args.batch,
        "optimizer": "sgd",
        "lr": 0.01,
        "momentum": 0.9,
        "weight_decay": 1e-4,
        "amp": "bf16",
        "channels_last": True,
        "scheduler": "none",
        "dropout": 0.0,
        "max_memory_gb": 64.0,
        "augment": {"crop_padding": 0, "hflip": True, "rotation": 0.0, "color_jitter": 0.0},
    }
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return work


def stage(work: Path, name: str, change: dict, out: Path) -> list[float]:
    """The stage's images/s of epochs 2 and on (its curve), run with `change` to train.*."""
    params = yaml.safe_load((work / "params.yaml").read_text())
    params["train"] |= change
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    cmd = [
        sys.executable,
        "-m",
        "pipeline.train",
        "--data",
        "prepared",
        "--out",
        name,
        "--checkpoints",
        f"{name}-state",
    ]
    log = run(cmd, work, out / f"stage-{name}.log")
    print(re.findall(r"^ +seconds: .*$", log, re.MULTILINE)[0].strip(), file=sys.stderr)
    curve = work / f"{name}.timings/plots/metrics/train/images_per_s.tsv"
    with curve.open() as f:
        rates = [float(row["images_per_s"]) for row in csv.DictReader(f, delimiter="\t")]
    return rates[1:] or rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=8000, help="training images")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=4, help="the stage's; 2 timed for the others")
    parser.add_argument("--size", type=int, default=256, help="the cache's side, px (crops: 7/8)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--compile", action="store_true", help="also the stage with train.compile")
    parser.add_argument("--out", type=Path, default=Path("gpu-peer-bench"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    crop = args.size * 7 // 8
    sizes = ["--images", str(args.images), "--batch", str(args.batch), "--device", args.device]
    peer = [
        sys.executable,
        str(ROOT / "bench/plain_peer.py"),
        *sizes,
        "--size",
        str(args.size),
        "--crop",
        str(crop),
    ]
    rates = {
        "peer (plain PyTorch)": json.loads(run(peer, ROOT, args.out / "peer.log").splitlines()[-1])[
            "images_per_s"
        ]
    }
    loop = [sys.executable, str(ROOT / "bench/gpu_bench.py"), "--finetune", *sizes, "--epochs", "2"]
    said = run(loop, ROOT, args.out / "loop.log")
    rates["loop (train_one_epoch)"] = [float(re.search(r"(\d+) images/s", said)[1])]
    with tempfile.TemporaryDirectory(prefix="visionflow-peer-") as work:
        project = stage_project(Path(work), args)
        rates["stage, deterministic false"] = stage(
            project, "fast", {"deterministic": False}, args.out
        )
        rates["stage, deterministic true (default)"] = stage(
            project, "default", {"deterministic": True}, args.out
        )
        if args.compile:
            change = {"deterministic": False, "compile": True}
            rates["stage, compile, deterministic false"] = stage(
                project, "compiled", change, args.out
            )
    base = statistics.mean(rates["peer (plain PyTorch)"])
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    print(
        f"{name}, torch {torch.__version__}, {args.images} images {args.size} px -> {crop}, batch {args.batch}"
    )
    print("| run | images/s (timed epochs) | vs the peer |\n|---|---|---|")
    for run_name, values in rates.items():
        shown = ", ".join(f"{v:.0f}" for v in values)
        print(f"| {run_name} | {shown} | {statistics.mean(values) / base:.2f}x |")


if __name__ == "__main__":
    main()
