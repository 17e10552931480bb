"""Stage export: write the model as ONNX and prove ONNX Runtime matches eager PyTorch.

Reads:  params.yaml (export.*); the model from train; real test images from the cache
Writes: <out>/model.onnx and <out>/parity.json. The ONNX file is written to a temporary folder and
        moved into <out> only when every parity check passes; on a miss the stage fails with the
        numbers and <out> holds only parity.json.
Run:    python -m pipeline.export --model results/train/model.pt --data data/prepared --out results/export
"""

import argparse
import shutil
import tempfile
from pathlib import Path

import torch

from pipeline import GateError, run
from visionflow import data
from visionflow.export import export_onnx, onnx_parity
from visionflow.models import load_model
from visionflow.params import load_params


def main() -> None:
    parser = argparse.ArgumentParser(description="Export to ONNX with a parity gate.")
    parser.add_argument("--model", type=Path, required=True, help="model.pt from train")
    parser.add_argument("--data", type=Path, required=True, help="cache folder from prepare")
    parser.add_argument("--out", type=Path, required=True, help="folder to write")
    args = parser.parse_args()
    e = load_params().export

    model, meta = load_model(args.model, map_location="cpu")  # export from eval mode, CPU, fp32
    x, _ = data.read_split(args.data, "test")
    mean, std = torch.tensor(meta["mean"]), torch.tensor(meta["std"])
    batch = data.to_model_input(torch.from_numpy(x[: e.batch_size]), mean, std).contiguous()
    batch_sizes = sorted({min(n, len(batch)) for n in (1, 3, len(batch))})

    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.out.parent, prefix=".export-") as tmp:
        onnx_path = Path(tmp) / "model.onnx"
        exporter = export_onnx(model, batch, onnx_path, e.opset)
        onnx = onnx_parity(model, onnx_path, batch, batch_sizes, e.rtol, e.atol)
        passed = all(r["passed"] for r in onnx.values())
        report = {
            "exporter": exporter,
            "opset": e.opset,
            "rtol": e.rtol,
            "atol": e.atol,
            "onnx": onnx,
            "passed": passed,
        }
        data.write_json(args.out / "parity.json", report)
        for name, r in onnx.items():
            print(
                f"parity onnx {name:9s} max abs {r['max_abs_diff']:.2e}  max rel "
                f"{r['max_rel_diff']:.2e}  top-1 {r['top1_agreement']:.3f}  "
                + ("ok" if r["passed"] else "MISS")
            )
        if not passed:
            raise GateError(
                f"ONNX parity missed (rtol {e.rtol}, atol {e.atol}); nothing promoted; "
                f"see {args.out / 'parity.json'}"
            )
        shutil.move(onnx_path, args.out / "model.onnx")
    print(f"export: {args.out / 'model.onnx'} ({exporter} exporter, opset {e.opset})")


if __name__ == "__main__":
    run(main)
