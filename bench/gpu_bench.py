"""GPU benchmark: train-stage throughput on CIFAR-sized synthetic data, side by side in one run.

For each model (simple_cnn, small_resnet) it times `visionflow.train.engine.train_one_epoch` with the
uint8 data held on the GPU, in four settings: fp32 NCHW; bf16 autocast; bf16 + channels_last;
bf16 + channels_last + torch.compile. It prints images/s per setting and the ratio to fp32.
Exits with a message when torch sees no CUDA device (CI and the development machines have none).

    .venv/bin/python bench/gpu_bench.py [--images 50000] [--batch 512] [--epochs 2]

With `--finetune`, it measures what fine-tuning users run instead: torchvision's ResNet-50 in the
project's FineTune wrapper, a 256 px uint8 cache random-resized-cropped to 224 px on the
device, bf16 autocast + channels_last, and reports images/s with the achieved TFLOP/s (3 x 4.1
GFLOPs per image: forward and backward) against `--peak-tflops` (the device's dense bf16 peak:
989 for an H100 or H200 SXM).

    .venv/bin/python bench/gpu_bench.py --finetune [--images 4096] [--batch 256] [--peak-tflops 989]

`--arch` takes another torchvision network (efficientnet_b0, convnext_tiny, ...) and `--compile
MODE` compiles it with torch.compile (`default`, `reduce-overhead`: CUDA graphs, whose shapes are
static here but for an epoch's last batch, `max-autotune-no-cudagraphs`); the warm-up epoch's
seconds, printed apart, hold the compile time.

    .venv/bin/python bench/gpu_bench.py --finetune --arch convnext_tiny --compile default

`--finetune --device cpu --images 8 --batch 4 --epochs 1` runs the same code on the CPU, to try
it where no GPU is (its numbers mean nothing there).
"""

import argparse
import sys
import time

import torch

from visionflow.train.augment import augment
from visionflow.train.engine import Split, Step, make_optimizer, train_one_epoch
from visionflow.train.models import build_model

SETTINGS = {  # name: (autocast dtype, channels_last, compile)
    "fp32": (None, False, False),
    "bf16": (torch.bfloat16, False, False),
    "bf16 + channels_last": (torch.bfloat16, True, False),
    "bf16 + channels_last + compile": (torch.bfloat16, True, True),
}


def throughput(name, setting, x, y, batch, epochs) -> float:
    dtype, channels_last, compiled = setting
    torch.manual_seed(0)
    model = build_model(name, 3, 10, 32).cuda()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    net = torch.compile(model) if compiled else model
    optimizer = make_optimizer("sgd", model, 0.05, 5e-4, 0.9, True)
    g = torch.Generator().manual_seed(0)
    mean, std = torch.tensor([0.5] * 3, device="cuda"), torch.tensor([0.25] * 3, device="cuda")

    def aug(images):
        return augment(images, g, crop_padding=4, hflip=True)

    def epoch():
        train_one_epoch(
            net, optimizer, Split(x, y, mean, std, g, augment=aug), Step(batch, dtype=dtype)
        )

    epoch()  # warm-up: cuDNN autotuning, compilation
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(epochs):
        epoch()
    torch.cuda.synchronize()
    return epochs * len(x) / (time.perf_counter() - start)


RESNET50_TRAIN_GFLOPS = 3 * 4.1  # per 224 px image: forward, and backward at twice that


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def finetune(args) -> None:
    from visionflow.train import zoo

    device = args.device
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (args.images, 256, 256, 3), dtype=torch.uint8, generator=g)
    y = torch.randint(0, 100, (args.images,), generator=g)
    x, y = x.to(device), y.to(device)
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    torch.backends.cudnn.benchmark = True  # as the plain peer (bench/plain_peer.py)
    model = zoo.finetune(args.arch, 3, 100, 224, (mean, std)).to(device)
    model = model.to(memory_format=torch.channels_last)
    net = model if args.compile == "none" else torch.compile(model, mode=args.compile)
    optimizer = make_optimizer("sgd", model, 0.01, 1e-4, 0.9, False)
    norm = torch.tensor(mean, device=device), torch.tensor(std, device=device)

    def aug(images):
        return augment(images, g, hflip=True, resized_crop=224)

    def epoch():
        split = Split(x, y, *norm, g, augment=aug)
        train_one_epoch(net, optimizer, split, Step(args.batch, dtype=torch.bfloat16))

    start = time.perf_counter()
    epoch()  # warm-up: cuDNN autotuning, allocation, compiling
    sync(device)
    warmup = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(args.epochs):
        epoch()
    sync(device)
    rate = args.epochs * len(x) / (time.perf_counter() - start)
    name = torch.cuda.get_device_name() if device.startswith("cuda") else device
    flops = ""
    if args.arch == "resnet50":
        tflops = rate * RESNET50_TRAIN_GFLOPS / 1000
        flops = f", {tflops:.1f} TFLOP/s, {tflops / args.peak_tflops:.1%} of {args.peak_tflops:.0f}"
    print(
        f"{name}, torch {torch.__version__}: {args.arch} fine-tune, 224 px, bf16 + channels_last, "
        f"compile {args.compile}, batch {args.batch}: {rate:.0f} images/s{flops}; "
        f"warm-up epoch {warmup:.1f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=50_000)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--finetune", action="store_true", help="ResNet-50 fine-tuning at 224 px")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak")
    parser.add_argument("--device", default="cuda", help="with --finetune: cpu to try it here")
    parser.add_argument("--arch", default="resnet50", help="with --finetune: a torchvision network")
    parser.add_argument(
        "--compile",
        default="none",
        choices=["none", "default", "reduce-overhead", "max-autotune-no-cudagraphs"],
        help="with --finetune: torch.compile's mode",
    )
    args = parser.parse_args()
    if args.finetune and args.device == "cpu":
        return finetune(args)
    if not torch.cuda.is_available():
        sys.exit("no CUDA device visible to torch: nothing to measure here")
    if args.finetune:
        return finetune(args)
    torch.backends.cudnn.benchmark = True
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (args.images, 32, 32, 3), dtype=torch.uint8, generator=g).cuda()
    y = torch.randint(0, 10, (args.images,), generator=g).cuda()
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.images} images 32x32x3, "
        f"batch {args.batch}"
    )
    print("| model | setting | images/s | vs fp32 |\n|---|---|---|---|")
    for name in ("simple_cnn", "small_resnet"):
        base = None
        for label, setting in SETTINGS.items():
            rate = throughput(name, setting, x, y, args.batch, args.epochs)
            base = base or rate
            print(f"| {name} | {label} | {rate:.0f} | {rate / base:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
