"""The hand-written loop a user would write (#44), plain PyTorch and torchvision, no visionflow:
the peer the project's loop and train stage are timed against (bench/gpu_peer_bench.py).

torchvision's ResNet-50, a 256 px uint8 cache held on the device, per-image random resized crops
to 224 px with `torchvision.ops.roi_align`, a random flip, normalisation, SGD with momentum 0.9,
bf16 autocast, channels_last, cuDNN autotuning. One epoch to warm up, then `--epochs` timed; prints
one JSON line: {"images_per_s": [...per timed epoch], "warmup_s": ...}.

    python bench/plain_peer.py [--images 4096] [--batch 256] [--epochs 2] [--device cuda]
    python bench/plain_peer.py --device cpu --images 8 --batch 4 --size 64 --crop 56   # to try it
"""

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F
from torchvision.models import resnet50
from torchvision.ops import roi_align


def crops(x, size, crop, generator):
    """Boxes as RandomResizedCrop draws them (8-100% of the area, aspect 3/4-4/3), one per image,
    resampled to crop x crop by roi_align, then flipped at random and normalised."""
    n, device = len(x), x.device
    area = torch.empty(n, device=device).uniform_(0.08, 1.0, generator=generator) * size * size
    log_ratio = torch.empty(n, device=device).uniform_(
        math.log(3 / 4), math.log(4 / 3), generator=generator
    )
    w = (area * log_ratio.exp()).sqrt().clamp(max=size)
    h = (area / log_ratio.exp()).sqrt().clamp(max=size)
    x0 = torch.rand(n, device=device, generator=generator) * (size - w)
    y0 = torch.rand(n, device=device, generator=generator) * (size - h)
    boxes = torch.stack([torch.arange(n, device=device, dtype=w.dtype), x0, y0, x0 + w, y0 + h], 1)
    images = x.permute(0, 3, 1, 2).float()
    out = roi_align(images, boxes, output_size=crop, sampling_ratio=2, aligned=True)
    flip = torch.rand(n, device=device, generator=generator) < 0.5
    out = torch.where(flip.view(n, 1, 1, 1), out.flip(3), out)
    mean = torch.tensor([0.485, 0.456, 0.406], device=device).view(1, 3, 1, 1) * 255
    std = torch.tensor([0.229, 0.224, 0.225], device=device).view(1, 3, 1, 1) * 255
    return ((out - mean) / std).contiguous(memory_format=torch.channels_last)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=2, help="timed, after one warm-up epoch")
    parser.add_argument("--size", type=int, default=256, help="the cache's side, px")
    parser.add_argument("--crop", type=int, default=224, help="the crops' side, px")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.backends.cudnn.benchmark = True
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randint(
        0,
        256,
        (args.images, args.size, args.size, 3),
        dtype=torch.uint8,
        device=device,
        generator=g,
    )
    y = torch.randint(0, 100, (args.images,), device=device, generator=g)
    model = resnet50(num_classes=100).to(device, memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)

    def epoch():
        model.train()
        order = torch.randperm(args.images, device=device, generator=g)
        for start in range(0, args.images, args.batch):
            index = order[start : start + args.batch]
            inputs = crops(x[index], args.size, args.crop, g)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = F.cross_entropy(model(inputs).float(), y[index])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()

    started = time.perf_counter()
    epoch()
    warmup = time.perf_counter() - started
    rates = []
    for _ in range(args.epochs):
        started = time.perf_counter()
        epoch()
        rates.append(args.images / (time.perf_counter() - started))
    print(json.dumps({"images_per_s": rates, "warmup_s": warmup}))


if __name__ == "__main__":
    main()
