"""`visionflow` command line.

visionflow predict IMAGE_OR_FOLDER... [--model PATH] [--runtime onnx|torchscript|pt2|torch]
                   (the runtime is the model file's own by default)
                   [--top-k K] [--json] [--trust-code]
                                                 classify images with an exported model: a
                                                 line per image (file, class, probability...,
                                                 tab-separated; --json: a JSON object each)
visionflow serve [--model PATH] [--host 127.0.0.1] [--port 8000] [--max-batch 32]
                 [--batch-window-ms 2] [--top-k 3] [--max-body-mb 20] [--max-pixels N]
                 [--reload-interval 2] [--decode-workers N] [--body-timeout 10]
                 [--min-upload-rate 32] [--max-uploads 32] [--max-uploads-per-client N]
                                                 the ONNX model over HTTP (POST /predict, GET
                                                 /health, GET /metadata), batching requests
visionflow repro [--if-busy wait|skip] [-- DVC REPRO ARGS]
                                                 `dvc repro`, one run at a time, nothing orphaned
visionflow verify [--data data/prepared]         re-hash the prepared cache and DVC's objects
visionflow lr-find [--data data/prepared] [--out results/lr_find]
                                                 the learning-rate range test on the prepared
                                                 data and train.*'s model: a plot and the
                                                 suggested train.lr in one line
visionflow doctor [--json]                       versions, GPU, disk, pipeline and Prefect, with fixes
"""

import argparse
import base64
import json
import os
import re
import signal
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
    from visionflow.data.decode import IMAGE_SUFFIXES, is_hidden

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
        elif str(path) == "-":  # a shell habit: `cat img.png | visionflow predict -`
            errors[path] = "-: images are read from files, not standard input: save it to a file"
        elif path.exists():
            errors[path] = f"{path}: not a regular file (a FIFO or a device): not read"
        else:
            errors[path] = f"{path}: no such file or folder"
    return files, errors


BATCH = 256  # images decoded and run at once at most: memory stays flat however long the folder
BATCH_VALUES = 2**19  # and at most this many input values (2 MB of float32) in a batch


def batch_size(spec: dict) -> int:
    """Images per batch for the model's input size: the runtime's activations grow with the
    batch's pixels (a 64 px RGB model's peak tripled from 60 images a batch to 256:
    docs/benchmarks.md), so a larger input runs fewer at a time; the per-image work is the same."""
    channels = 1 if spec["color"] == "grayscale" else 3
    return max(1, min(BATCH, BATCH_VALUES // (spec["image_size"] ** 2 * channels)))


def predict(args: argparse.Namespace) -> int:
    """Predict every image, in order, a batch at a time, printing each batch as it is done."""
    from visionflow.deploy.inference import ModelError, load_predictor

    if sys.stdout is None:  # `>&-`: nowhere to print, and nothing to tell apart from success
        print("error: standard output is closed: nowhere to write the predictions", file=sys.stderr)
        return 2
    # a file name or class that the terminal's encoding lacks is escaped, not a traceback
    sys.stdout.reconfigure(errors="backslashreplace")
    model = args.model or default_model(args.runtime or "onnx")
    files, errors = expand(args.inputs)
    if not files:
        for message in errors.values():
            print(f"error: {message}", file=sys.stderr)
        print(f"error: no image files in {', '.join(map(str, args.inputs))}", file=sys.stderr)
        return 2
    try:
        check_model_path(model)
        predictor, classes, spec = load_predictor(args.runtime, model, args.trust_code)
    except (FileNotFoundError, ModelError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # the right format, but a corrupt or truncated file
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(
            f"error: {model} could not be loaded ({type(e).__name__}: {first[:200]})",
            file=sys.stderr,
        )
        return 2
    show = json_line if args.json else tsv_line
    n = batch_size(spec)
    progress = progress_for(len(files), n)
    try:
        for path, message in errors.items():  # inputs that do not exist
            report(path, message, args.json)
        for i in range(0, len(files), n):
            results, failed = predict_batch(files[i : i + n], predictor, classes, spec, args)
            errors.update(failed)
            for path in files[i : i + n]:
                if path in results:
                    print(show(path, results[path]))
                else:
                    report(path, failed[path], args.json)
            sys.stdout.flush()
            progress(len(files[i : i + n]))
    except BrokenPipeError:  # `| head` has read enough: stop quietly, as `cat` does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return 128 + signal.SIGPIPE
    except OSError as e:  # a full disk, a quota: the predictions did not all get written
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print(f"error: cannot write the predictions: {e.strerror or e}", file=sys.stderr)
        return 2
    return 1 if errors else 0


def check_model_path(model: Path) -> None:
    """A model path that names no regular file is a ValueError or FileNotFoundError saying so
    (and how to get a missing pipeline output back)."""
    if model.is_dir():
        raise ValueError(f"{model} is a folder: name the model file in it with --model")
    if not model.exists():
        from visionflow.ops.project import missing_output

        raise FileNotFoundError(missing_output(model, "model file"))
    if not model.is_file():
        raise ValueError(f"{model} is not a regular file (a FIFO or a device): not read")


def progress_for(total: int, batch: int):
    """Images done of the total, the rate and the time left on stderr, for a folder longer than
    a batch whose results go to a file or a pipe (in a terminal, the results are the progress)."""
    if total <= batch or sys.stdout.isatty():
        return lambda n: None
    from visionflow.data.pool import ProgressBar

    return ProgressBar(total, what="predict")


def default_model(runtime: str) -> Path:
    """The pipeline's model file for `runtime`, found from anywhere inside the project (a
    subfolder too); outside one, relative to the current folder."""
    from visionflow.ops.project import dvc_root

    root = dvc_root(Path.cwd())
    relative = Path(DEFAULT_MODELS[runtime])
    return relative if root is None or root == Path.cwd().resolve() else root / relative


def predict_batch(files, predictor, classes, spec, args) -> tuple[dict, dict]:
    """Top-k classes of the images that decode, and an error line for each one that does not."""
    from visionflow.deploy.inference import load_images, to_input, top_k

    pixels, good, failed = load_images(files, spec)
    ranked = top_k(predictor(to_input(pixels, spec)), classes, args.top_k) if good else []
    return dict(zip(good, ranked, strict=True)), failed


def report(path: Path, message: str, as_json: bool) -> None:
    if as_json:
        print(json.dumps({**file_fields(path), "error": message}))
    print(f"error: {message}", file=sys.stderr)


def json_line(path: Path, ranked: list[tuple[str, float]]) -> str:
    """One JSON object per image on one line (a newline in a file name is escaped)."""
    rows = [{"class": c, "probability": p} for c, p in ranked]
    return json.dumps({**file_fields(path), "predictions": rows})


def file_fields(path: Path) -> dict[str, str]:
    """`file`: the name as text; for a name that is not UTF-8 (where `file` shows `\\xe9` for
    the byte, as a name really holding those four characters would), also `file_bytes`: the
    name's exact bytes in base64 (`os.fsdecode(base64.b64decode(...))` opens it)."""
    fields = {"file": text_of(path)}
    raw = os.fsencode(path)
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        fields["file_bytes"] = base64.b64encode(raw).decode("ascii")
    return fields


def tsv_line(path: Path, ranked: list[tuple[str, float]]) -> str:
    """file, then class and probability for each of the top k, tab-separated, one line per image."""
    cells = [str(path)] + [v for c, p in ranked for v in (c, f"{p:.4f}")]
    return "\t".join(map(escape, cells))


# Characters a terminal acts on rather than shows: other control characters (ESC starts a
# colour or clear-screen sequence), and the bidi controls that reorder what follows (U+202E).
HIDDEN = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def escape(text: str) -> str:
    """A name as one TSV cell: backslash, tab and line breaks escaped (as `\\t`, `\\n`), other
    control and bidi characters as `\\x1b`, `\\u202e` (a model's class names are untrusted
    text), and bytes that are not UTF-8 (a file name from another system) shown as `\\xff`."""
    for char, code in (("\\", "\\\\"), ("\t", "\\t"), ("\n", "\\n"), ("\r", "\\r")):
        text = text.replace(char, code)
    text = HIDDEN.sub(lambda m: m[0].encode("unicode_escape").decode(), text)
    return text_of(text)


def text_of(name) -> str:
    """A path or name as valid UTF-8 text: bytes that are not UTF-8 (a file name from another
    system) become `\\xff`, not the lone surrogate that strict JSON parsers refuse."""
    return str(name).encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def add_serve(commands) -> None:
    s = commands.add_parser(
        "serve", help="the ONNX model over HTTP, batching concurrent requests (no torch)"
    )
    s.add_argument("--model", type=Path, help="ONNX file (default: the pipeline's model.onnx)")
    s.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine)"
    )
    s.add_argument(
        "--port", type=int, default=8000, help="TCP port (default 8000; 0: any free one)"
    )
    s.add_argument("--max-batch", type=int, default=32, help="images run together at most (32)")
    s.add_argument(
        "--batch-window-ms",
        type=float,
        default=2.0,
        help="the longest an image waits for others to join its batch, ms (default 2)",
    )
    s.add_argument("--top-k", type=int, default=3, help="classes per answer (default 3; ?top_k=)")
    s.add_argument("--max-body-mb", type=float, default=20.0, help="request body limit (20 MB)")
    s.add_argument(
        "--max-pixels", type=int, help="image size limit, width x height (default 50,000,000)"
    )
    s.add_argument(
        "--reload-interval",
        type=float,
        default=2.0,
        help="seconds between looks at the model file for a new one to load (default 2; 0: never)",
    )
    s.add_argument(
        "--decode-workers", type=int, help="threads that decode images (default: one per core)"
    )
    s.add_argument(
        "--body-timeout",
        type=float,
        default=10.0,
        help="seconds a request body may go without a byte, and a request head may take, before "
        "its connection is dropped (default 10)",
    )
    s.add_argument(
        "--min-upload-rate",
        type=float,
        default=32.0,
        help="KB/s a request body must average once --body-timeout has passed, or it is dropped "
        "with a 408: a client that drips bytes cannot hold an upload slot (default 32)",
    )
    s.add_argument(
        "--max-uploads",
        type=int,
        default=32,
        help="request bodies received at once; more are a 503 with Retry-After (default 32)",
    )
    s.add_argument(
        "--max-uploads-per-client",
        type=int,
        default=0,
        help="one client address's share of --max-uploads: the graces it may owe for slow "
        "uploads, and its uploads at once when few slots are free; more are a 429 "
        "(default: a quarter of --max-uploads, at least 1)",
    )


def serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from visionflow.deploy.serve import MAX_PIXELS, MB, Settings
    from visionflow.deploy.serve import serve as run

    max_pixels = MAX_PIXELS if args.max_pixels is None else args.max_pixels
    checks = {
        "--max-batch must be at least 1": args.max_batch < 1,
        "--batch-window-ms must be 0 or more": not args.batch_window_ms >= 0,
        "--top-k must be at least 1": args.top_k < 1,
        "--max-body-mb must be more than 0": not args.max_body_mb > 0,
        f"--max-pixels must be 1 to {MAX_PIXELS} (the decoder's limit)": not (
            1 <= max_pixels <= MAX_PIXELS
        ),
        "--reload-interval must be 0 or more": not args.reload_interval >= 0,
        "--decode-workers must be at least 1": (args.decode_workers or 1) < 1,
        "--body-timeout must be more than 0": not args.body_timeout > 0,
        "--max-uploads must be at least 1": args.max_uploads < 1,
        "--min-upload-rate must be more than 0": not args.min_upload_rate > 0,
        "--max-uploads-per-client must be 0 or more": args.max_uploads_per_client < 0,
        "--max-uploads-per-client must be at most --max-uploads (more turns the share off)": (
            args.max_uploads_per_client > args.max_uploads
        ),
        "--port must be 0 to 65535": not 0 <= args.port <= 65535,
    }
    for message, wrong in checks.items():
        if wrong:
            parser.error(message)
    settings = Settings(
        max_batch=args.max_batch,
        window_s=args.batch_window_ms / 1000,
        top_k=args.top_k,
        max_body=int(args.max_body_mb * MB),
        max_pixels=max_pixels,
        reload_interval_s=args.reload_interval,
        decode_workers=args.decode_workers or Settings().decode_workers,
        body_timeout_s=args.body_timeout,
        max_uploads=args.max_uploads,
        min_upload_rate=args.min_upload_rate * 1024,
        max_uploads_per_client=args.max_uploads_per_client,
    )
    model = args.model or default_model("onnx")
    try:
        check_model_path(model)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return run(model, args.host, args.port, settings)


def lr_find(args: argparse.Namespace) -> int:
    """`python -m pipeline.lr_find` in the project: the stages' code, which the library never
    imports, run with this Python."""
    import subprocess

    from visionflow.ops.runner import NotAProject, find_root

    try:
        root = find_root(Path.cwd())
    except NotAProject as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not (root / args.data / "manifest.json").is_file():
        print(
            f"error: {args.data} holds no prepared cache: `dvc repro sanity` makes it",
            file=sys.stderr,
        )
        return 2
    if (root / args.data).resolve() == (root / "data/prepared").resolve():
        from visionflow.ops.repo import unchanged

        if not unchanged(root, "prepare"):
            print(
                f"lr-find: warning: {args.data} is not what params.yaml and the data make now "
                "(`dvc status prepare` says what changed): the range test runs on it as it is; "
                "`dvc repro prepare` makes it anew",
                file=sys.stderr,
            )
    command = [sys.executable, "-m", "pipeline.lr_find", "--data", str(args.data)]
    process = subprocess.Popen([*command, "--out", str(args.out)], cwd=root)
    # a terminal's Ctrl-C reaches the range test too, which stops and says so in one line: this
    # process waits for it, as a shell waits for its foreground job (no traceback of its own)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return process.wait()
    finally:
        signal.signal(signal.SIGINT, previous)


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
    p.add_argument(
        "--json", action="store_true", help="one JSON object per image and line (JSON Lines)"
    )
    p.add_argument(
        "--trust-code",
        action="store_true",
        help="load a TorchScript or .pt2 file, which can run code: only files you made or trust",
    )
    add_serve(commands)
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
    f = commands.add_parser(
        "lr-find", help="the learning-rate range test: a plot and the suggested train.lr"
    )
    f.add_argument("--data", type=Path, default=Path("data/prepared"), help="prepared cache folder")
    f.add_argument("--out", type=Path, default=Path("results/lr_find"), help="folder to write")
    d = commands.add_parser(
        "doctor", help="check the environment and workspace; fixes for problems"
    )
    d.add_argument("--json", action="store_true", help="print JSON instead of lines")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        from visionflow.ops.doctor import doctor

        return doctor(Path.cwd(), args.json)
    if args.command == "serve":
        return serve(args, parser)
    if args.command == "lr-find":
        return lr_find(args)
    if args.command == "repro":
        from visionflow.ops.runner import repro

        return repro(Path.cwd(), args.dvc_args, wait=args.if_busy == "wait")
    if args.command == "verify":
        from visionflow.ops.runner import NotAProject, find_root
        from visionflow.ops.verify import verify

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
