"""`visionflow` command line.

visionflow predict IMAGE_OR_FOLDER... [--model PATH] [--runtime onnx|torchscript|pt2|torch]
                   (the runtime is the model file's own by default)
                   [--top-k K] [--json]          classify images with an exported model
visionflow repro [--if-busy wait|skip] [-- DVC REPRO ARGS]
                                                 `dvc repro`, one run at a time, nothing orphaned
visionflow verify [--data data/prepared]         re-hash the prepared cache and DVC's objects
visionflow doctor [--json]                       versions, GPU, disk, pipeline and Prefect, with fixes
"""

import argparse
import json
import sys
from pathlib import Path

# Each command imports what it needs when it runs: `repro` starts without torch.
DEFAULT_MODELS = {
    "onnx": "results/export/model.onnx",
    "torchscript": "results/export/model.torchscript.pt",
    "pt2": "results/export/model.pt2",
    "torch": "results/train/model.pt",
}


def expand(inputs: list[Path]) -> tuple[list[Path], dict[Path, str]]:
    """Files as given; folders searched for image files (hidden entries skipped), sorted."""
    from visionflow.decode import IMAGE_SUFFIXES, is_hidden

    files, errors = [], {}
    for path in inputs:
        if path.is_dir():
            files += sorted(
                p
                for p in path.rglob("*")
                if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES and not is_hidden(p, path)
            )
        elif path.is_file():
            files.append(path)
        else:
            errors[path] = f"{path}: no such file or folder"
    return files, errors


def predict(args: argparse.Namespace) -> int:
    import numpy as np

    from visionflow.inference import file_format, load_images, load_predictor, normalise, top_k

    model = args.model or Path(DEFAULT_MODELS[args.runtime or "onnx"])
    files, errors = expand(args.inputs)
    if not files:
        for message in errors.values():
            print(f"error: {message}", file=sys.stderr)
        print(f"error: no image files in {', '.join(map(str, args.inputs))}", file=sys.stderr)
        return 2
    try:
        found = file_format(model) if model.is_file() else None
        if found == "torchscript" and args.runtime in (None, "torchscript"):  # it will load it
            print(
                f"warning: {model} is TorchScript, which is code: load only files you made or "
                "trust",
                file=sys.stderr,
            )
        predictor, classes, spec = load_predictor(args.runtime, model)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # the right format, but a corrupt or truncated file
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(
            f"error: {model} could not be loaded ({type(e).__name__}: {first[:200]})",
            file=sys.stderr,
        )
        return 2
    pixels, good, decode_errors = load_images(files, spec)
    errors.update(decode_errors)
    logits = (
        np.concatenate(
            [predictor(normalise(pixels[i : i + 256], spec)) for i in range(0, len(pixels), 256)]
        )
        if len(good)
        else np.empty((0, 0))
    )
    ranked = top_k(logits, classes, args.top_k) if len(good) else []
    results = dict(zip(good, ranked, strict=True))
    if args.json:
        rows = [
            {"file": str(f), "predictions": [{"class": c, "probability": p} for c, p in results[f]]}
            if f in results
            else {"file": str(f), "error": errors[f]}
            for f in files
        ]
        rows += [{"file": str(f), "error": e} for f, e in errors.items() if f not in files]
        print(json.dumps(rows, indent=2))
    else:
        for f, preds in results.items():
            print(f"{f}: " + ", ".join(f"{c} {p:.3f}" for c, p in preds))
    for message in errors.values():
        print(f"error: {message}", file=sys.stderr)
    return 1 if errors else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="visionflow", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("predict", help="classify images with an exported model")
    p.add_argument("inputs", nargs="+", type=Path, help="image files or folders of images")
    p.add_argument("--model", type=Path, help="model file (default: the pipeline's, per runtime)")
    p.add_argument(
        "--runtime",
        choices=list(DEFAULT_MODELS),
        help="default: what the --model file is (without --model: onnx, ONNX Runtime)",
    )
    p.add_argument("--top-k", type=int, default=3, help="classes to show per image (default 3)")
    p.add_argument("--json", action="store_true", help="print JSON instead of lines")
    r = commands.add_parser(
        "repro", help="`dvc repro` under the workspace lock, in its own process group"
    )
    r.add_argument(
        "--if-busy",
        choices=("wait", "skip"),
        default="wait",
        help="when another run holds the workspace (default: wait)",
    )
    r.add_argument("dvc_args", nargs="*", help="passed to `dvc repro` (after --)")
    v = commands.add_parser("verify", help="re-hash the prepared cache and the DVC cache objects")
    v.add_argument("--data", type=Path, default=Path("data/prepared"), help="prepared cache folder")
    d = commands.add_parser(
        "doctor", help="check the environment and workspace; fixes for problems"
    )
    d.add_argument("--json", action="store_true", help="print JSON instead of lines")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        from visionflow.doctor import doctor

        return doctor(Path.cwd(), args.json)
    if args.command == "repro":
        from visionflow.runner import repro

        return repro(Path.cwd(), args.dvc_args, wait=args.if_busy == "wait")
    if args.command == "verify":
        from visionflow.runner import NotAProject, find_root
        from visionflow.verify import verify

        try:
            root = find_root(Path.cwd())
            return verify(root, root / args.data)
        except NotAProject as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if args.top_k < 1:
        parser.error("--top-k must be at least 1")
    return predict(args)


if __name__ == "__main__":
    raise SystemExit(main())
