"""`visionflow serve`: the real server (the CLI in a subprocess, on a free port of 127.0.0.1),
spoken to over HTTP with httpx: answers equal `visionflow predict`'s, bad input is a 400 or 413
and the server goes on, concurrent requests share batches, a replaced model file is validated
before it is served, SIGTERM lets requests in flight finish. Tests wait on events the server
reports (/health), never on the clock."""

import asyncio
import contextlib
import hashlib
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from PIL import Image

from visionflow.deploy.inference import ModelError, file_metadata, preprocess_spec

URL = re.compile(r"http://127\.0\.0\.1:\d+")


@contextlib.contextmanager
def serving(model: Path, *flags: str, env: dict | None = None, log: Path | None = None, **popen):
    """`visionflow serve --port 0` on `model`; yields (URL, process); stopped with SIGTERM."""
    cmd = [sys.executable, "-m", "visionflow.cli", "serve", "--model", str(model), "--port", "0"]
    log = log or Path(tempfile.mkstemp(prefix="serve-", suffix=".log", dir=model.parent)[1])
    with open(log, "w") as err:
        process = subprocess.Popen(
            [*cmd, *flags],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env={**os.environ, **(env or {})},
            **popen,
        )
    try:
        ready, _, _ = select.select([process.stdout], [], [], 120)
        line = process.stdout.readline() if ready else ""
        found = URL.search(line)
        assert found, f"no URL from serve: {line!r}\n{log.read_text()}"
        yield found[0], process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        process.stdout.close()
        process.stdout.close()


def until(check, what: str, limit_s: float = 120):
    """Poll `check()` until it returns something true (an event the server reports)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"never happened: {what}")


def tiny_onnx(
    path: Path,
    classes: list[str],
    size: int = 4,
    opset: int = 17,
    outputs=None,
    one_row: bool = False,
    meta: dict | None = None,
) -> Path:
    """A grayscale `size` px classifier (Flatten, MatMul) with visionflow's metadata (and
    `meta`). `one_row`: a broken one that passes validation (a batch of 1) but answers any
    batch with one row, the mean of its logits."""
    n = outputs or len(classes)
    weight = np.linspace(-1, 1, size * size * n, dtype=np.float32).reshape(size * size, n)
    nodes = [
        helper.make_node("Flatten", ["image"], ["flat"]),
        helper.make_node("MatMul", ["flat", "w"], ["rows" if one_row else "logits"]),
    ]
    if one_row:
        nodes.append(helper.make_node("ReduceMean", ["rows"], ["logits"], axes=[0], keepdims=1))
    graph = helper.make_graph(
        nodes,
        "tiny",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", 1, size, size])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", n])],
        [helper.make_tensor("w", TensorProto.FLOAT, weight.shape, weight.ravel())],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    spec = preprocess_spec(size, 1, [0.5], [0.25])
    helper.set_model_props(model, {**file_metadata(classes, spec), **(meta or {})})
    onnx.save(model, str(path))
    return path


def renamed(good: Path, dest: Path, classes: list[str]) -> Path:
    """A copy of an ONNX file whose class names are `classes` (a different, valid model when
    there are as many; forged metadata when not)."""
    model = onnx.load(str(good))
    meta = {p.key: p.value for p in model.metadata_props}
    meta["visionflow.classes"] = json.dumps(classes)
    del model.metadata_props[:]
    helper.set_model_props(model, meta)
    tmp = dest.with_suffix(".tmp")
    onnx.save(model, str(tmp))
    os.replace(tmp, dest)  # as `dvc checkout` or a deploy script replaces a file
    return dest


def replace(dest: Path, data: bytes) -> None:
    tmp = dest.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, dest)


# Fast tests: the library, on a tiny ONNX model made here.


def test_opset_is_read_from_the_file_as_onnx_reads_it(tmp_path):
    from visionflow.deploy.served import load_served, onnx_opset

    for opset in (13, 17, 18):
        path = tiny_onnx(tmp_path / f"m{opset}.onnx", ["a", "b", "c"], opset=opset)
        assert onnx.load(str(path)).opset_import[0].version == opset
        assert onnx_opset(path.read_bytes()) == opset
        model = load_served(path, tmp_path)
        assert model.opset == opset and model.classes == ["a", "b", "c"]
        assert model.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert onnx_opset(b"\x08\x08\x42\xff") is None  # truncated: no opset, no exception
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m13.onnx", "m17.onnx", "m18.onnx"]


def test_a_model_that_cannot_be_served_is_refused_naming_the_file(tmp_path):
    from visionflow.deploy.served import load_served

    bad = {
        "junk.onnx": lambda p: p.write_bytes(b"\x08not a model at all"),
        "notes.onnx": lambda p: p.write_text("hello"),
        "forged.onnx": lambda p: tiny_onnx(p, ["a", "b", "c"], outputs=4),
    }
    for name, make in bad.items():
        make(tmp_path / name)
        with pytest.raises(ModelError, match=re.escape(str(tmp_path / name))):
            load_served(tmp_path / name, tmp_path)
    with pytest.raises(ModelError, match="no model file"):
        load_served(tmp_path / "missing.onnx", tmp_path)
    assert "network has 4 outputs" in str(
        pytest.raises(ModelError, load_served, tmp_path / "forged.onnx", tmp_path).value
    )


def test_serve_loads_and_runs_a_model_without_torch(tmp_path):
    path = tiny_onnx(tmp_path / "m.onnx", ["a", "b"])
    code = (
        "import sys; from pathlib import Path; import numpy as np; import visionflow.cli; "
        "import visionflow.deploy.serve as s; import uvicorn, starlette.applications; "
        "m = s.load_served(Path(sys.argv[1]), Path(sys.argv[2])); "
        "print(m.predictor(np.zeros((2, 1, 4, 4), np.float32)).shape); "
        "print(sorted(k for k in sys.modules if k.split('.')[0] in ('torch', 'torchvision', 'onnx')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(path), str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert out == ["(2, 2)", "[]"]


def test_metadata_says_a_model_is_int8(tmp_path):
    """An INT8 file written by the project's quantizer is served as INT8 (/metadata says so,
    with the file's record of what was done); the float32 file it came from as float32."""
    from visionflow.deploy.inference import file_metadata as metadata_of
    from visionflow.deploy.quantize import quantize_onnx

    classes, spec = ["a", "b", "c"], preprocess_spec(4, 1, [0.5], [0.25])
    fp32 = tiny_onnx(tmp_path / "model.onnx", classes)
    calibration = np.random.default_rng(0).integers(0, 256, (16, 4, 4, 1), dtype=np.uint8)
    int8 = tmp_path / "model.int8.onnx"
    record = quantize_onnx(fp32, int8, calibration, spec, "minmax", metadata_of(classes, spec))
    for path, precision, quantization in ((fp32, "float32", None), (int8, "int8", record)):
        with serving(path, "--reload-interval", "0") as (url, process):
            model = httpx.get(f"{url}/metadata").json()["model"]
        assert (model["precision"], model["quantization"]) == (precision, quantization)


def raw_post(url: str, head: str, body: bytes) -> tuple[int, dict]:
    """POST /predict over a plain socket (HTTP/1.1, Connection: close): the status and JSON."""
    host, port = url.removeprefix("http://").split(":")
    request = f"POST /predict HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{head}\r\n"
    with socket.create_connection((host, int(port))) as client:
        client.sendall(request.encode() + body)
        answer = b""
        while chunk := client.recv(65536):
            answer += chunk
    status, _, body = answer.partition(b"\r\n\r\n")
    return int(status.split()[1]), json.loads(body)


def test_a_multipart_form_cut_off_or_malformed_is_a_400_saying_so(tmp_path):
    png = digit_pngs(tmp_path, 1)[0].read_bytes()
    boundary = "b0undary"
    part = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="d.png"\r\n'
        "Content-Type: image/png\r\n\r\n"
    ).encode()
    whole = part + png + f"\r\n--{boundary}--\r\n".encode()
    forms = {
        "whole": (whole, 200, "predictions"),
        "cut off mid-file": (part + png[: len(png) // 2], 400, "the multipart form is cut off"),
        "malformed": (f"--{boundary}junk\r\n".encode(), 400, "Did not find CR at end"),
    }
    log = tmp_path / "serve.log"
    with serving(tiny_onnx(tmp_path / "m.onnx", ["a", "b"]), log=log) as (url, process):
        for what, (body, status, words) in forms.items():
            head = (
                f"Content-Type: multipart/form-data; boundary={boundary}\r\n"
                f"Content-Length: {len(body)}\r\n"
            )
            got, answer = raw_post(url, head, body)
            assert got == status and words in json.dumps(answer), (what, answer)
    lines = log.read_text().splitlines()  # serve's own; not the parser's ("Did not find CR")
    assert lines and all(line.startswith("serve: ") for line in lines), lines


def stalled_upload(url: str, sent: bytes, length: int, source: str = "127.0.0.1") -> socket.socket:
    """A POST /predict from the address `source` that says its body has `length` bytes, sends
    `sent` of them, and stalls. Linux routes all of 127.0.0.0/8 to lo: 127.0.0.2 is another
    client to the server. Reads on it give up after 60 s: the issue's bound, not a measure of
    speed."""
    host, port = url.removeprefix("http://").split(":")
    client = socket.create_connection((host, int(port)), timeout=60, source_address=(source, 0))
    head = (
        "POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
        f"Content-Length: {length}\r\n\r\n"
    )
    client.sendall(head.encode() + sent)
    return client


def read_answer(client: socket.socket) -> tuple[int, dict, dict]:
    """One HTTP answer from `client`: status, headers (lower-case names), JSON body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = client.recv(65536)
        assert chunk, f"closed without an answer: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    while len(body) < int(headers["content-length"]):
        body += client.recv(65536)
    return int(lines[0].split()[1]), headers, json.loads(body)


def test_stalled_uploads_are_dropped_with_their_connections_and_files(tmp_path):
    """A request head that stalls is dropped with its connection once --body-timeout passes;
    twelve uploads that stall after 1 MB: each is a 408 once --body-timeout passes without a
    byte, its connection is closed and its spooled file removed, and the server goes on."""
    png = digit_pngs(tmp_path, 1)[0]
    model = tiny_onnx(tmp_path / "m.onnx", ["a", "b"])
    env = {"TMPDIR": str(tmp_path)}
    flags = ("--body-timeout", "1", "--reload-interval", "0")
    with serving(model, *flags, env=env) as (url, process):
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=60) as head:
            head.sendall(b"GET /hea")  # a head that never ends: closed (held for good before)
            assert head.recv(1) == b""
        clients = [stalled_upload(url, os.urandom(2**20), 4 * 2**20) for _ in range(12)]
        for client in clients:
            with client:
                status, headers, body = read_answer(client)
                assert status == 408 and headers["connection"] == "close", body
                assert "the upload stalled: no byte of the body for 1 s" in body["error"]
                assert client.recv(1) == b""  # the server closed the connection
        uploads = health(url)["uploads"]
        assert (uploads["receiving"], uploads["max"], uploads["per_client"]) == (0, 32, 8)
        assert uploads["refused"] == {"busy": 0, "per_client": 0}
        assert not list(tmp_path.glob("visionflow-serve-*/request-*"))
        assert post(url, png).status_code == 200


def drip(client: socket.socket, stop: threading.Event) -> None:
    """Send one byte of the body every 0.1 s until the server closes the connection."""
    with contextlib.suppress(OSError):
        while not stop.wait(0.1):
            client.sendall(b"x")


def taken(url: str, n: int) -> httpx.Response | None:
    """/health's answer once `n` uploads are being received."""
    answer = httpx.get(f"{url}/health")
    return answer if answer.json()["uploads"]["receiving"] == n else None


def test_uploads_that_drip_bytes_are_dropped_and_do_not_lock_other_clients_out(tmp_path):
    """Two clients (two addresses) that each send a byte every 0.1 s take both upload slots:
    /health reports it and stays 200 "ok", as /health/ready does (a load balancer that took
    the replica out for busy slots would do the drippers' work for them); once --body-timeout
    has passed, each is a 408 for averaging under --min-upload-rate, and the next client is
    answered. Before, a deadline per receive let them hold the slots for as long as they
    dripped: every other client got a 503."""
    png = digit_pngs(tmp_path, 1)[0]
    model = tiny_onnx(tmp_path / "m.onnx", ["a", "b"])
    flags = ("--max-uploads", "2", "--body-timeout", "4", "--min-upload-rate", "1")
    flags += ("--reload-interval", "0")
    stop = threading.Event()
    with serving(model, *flags) as (url, process):
        clients = [stalled_upload(url, b"x", 100_000, f"127.0.0.{i}") for i in (2, 3)]
        drippers = [threading.Thread(target=drip, args=(c, stop)) for c in clients]
        for dripper in drippers:
            dripper.start()
        try:
            full = until(lambda: taken(url, 2), "both upload slots taken")
            assert full.status_code == 200 and full.json()["status"] == "ok", full.text
            ready = httpx.get(f"{url}/health/ready")
            assert ready.status_code == 200 and ready.json()["status"] == "ready"
            for client in clients:
                status, headers, body = read_answer(client)
                assert status == 408 and headers["connection"] == "close", body
                assert "the upload is too slow" in body["error"], body
                assert "under the minimum of 1 KB/s (--min-upload-rate)" in body["error"], body
        finally:
            stop.set()
            for dripper in drippers:
                dripper.join()
            for client in clients:
                client.close()
        until(lambda: health(url)["uploads"]["receiving"] == 0, "the drippers dropped")
        assert health(url)["status"] == "ok"
        assert post(url, png).status_code == 200


def reconnecting_dripper(url: str, stop: threading.Event, answers: list) -> None:
    """A client of 127.0.0.1 that drips an upload (a byte every 0.1 s, as `drip`) and, once the
    server answers, opens a new one: at once after a 408, 0.1 s after a refusal. Appends each
    answer's (status, headers, JSON); (None, {}, None) for a connection closed unanswered."""
    while not stop.is_set():
        with stalled_upload(url, b"x", 100_000) as client:
            try:
                while not select.select([client], [], [], 0.1)[0]:
                    if stop.is_set():
                        return
                    client.sendall(b"x")
                answers.append(read_answer(client))
            except (OSError, AssertionError):  # reset or closed before an answer came
                answers.append((None, {}, None))
        if answers[-1][0] != 408:
            stop.wait(0.1)


def test_reconnecting_drippers_from_one_address_leave_other_clients_served(tmp_path):
    """Issue 57: 32 connections from 127.0.0.1 that drip uploads and open a new one after each
    answer. Before, every new upload got its grace (--body-timeout) again, so they held every
    upload slot: a good client got 503 on 79 of 80 requests, and /health answered 503. Now the
    address takes all but the last 8 slots (a quarter of --max-uploads, kept for addresses with
    fewer; the other 8 drippers get a 429), its 24 uploads are dropped (408) at the end of their
    grace, and the address owes that grace: each of those drippers, reconnecting at once, is
    refused (429, Retry-After) ten times in a row, longer than a grace. All along, a client from 127.0.0.2 is answered 200 (within 20 s, the issue's
    bound) and liveness (/health/live, from 127.0.0.3) is 200."""
    png = digit_pngs(tmp_path, 1)[0].read_bytes()
    model = tiny_onnx(tmp_path / "m.onnx", ["a", "b"])
    flags = ("--body-timeout", "1", "--min-upload-rate", "1", "--reload-interval", "0")
    stop, answers = threading.Event(), [[] for _ in range(32)]

    def after_their_408() -> list[list]:
        """The answers each dripper whose upload was dropped got after that 408."""
        statuses = [[status for status, _, _ in a] for a in answers]
        return [a[s.index(408) + 1 :] for a, s in zip(answers, statuses, strict=True) if 408 in s]

    with (
        serving(model, *flags) as (url, process),
        httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=20) as good,
        httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.3"), timeout=20) as live,
    ):
        drippers = [
            threading.Thread(target=reconnecting_dripper, args=(url, stop, a)) for a in answers
        ]
        for dripper in drippers:
            dripper.start()
        try:
            until(lambda: health(url)["uploads"]["receiving"] >= 24, "the drippers' uploads")
            posts = 0
            while not (
                len(after_their_408()) == 24 and all(len(a) >= 10 for a in after_their_408())
            ):
                assert live.get(f"{url}/health/live").status_code == 200
                answer = good.post(
                    f"{url}/predict", content=png, headers={"content-type": "image/png"}
                )
                assert answer.status_code == 200, answer.text
                posts += 1
            report = good.get(f"{url}/health")
            assert report.status_code == 200 and report.json()["status"] == "ok"
        finally:
            stop.set()
            for dripper in drippers:
                dripper.join()
    statuses = [status for a in answers for status, _, _ in a]
    assert statuses.count(408) == 24 and set(statuses) <= {408, 429, None}, statuses
    assert posts > 0
    for after in after_their_408():  # not one slot again: the grace stays spent
        assert {status for status, _, _ in after} <= {429, None}, after
        status, headers, body = [answer for answer in after if answer[0] == 429][-1]
        assert headers["connection"] == "close" and int(headers["retry-after"]) >= 1, headers
        assert "uploads from 127.0.0.1 were too slow lately" in body["error"], body


def test_uploads_past_max_uploads_are_a_503_with_retry_after(tmp_path):
    """Two uploads from two addresses take both slots (--max-uploads 2): a third address gets a
    503 with Retry-After, and the first address a 429 (it has its share, a quarter of 2 but at
    least 1, and no slot is free); once an upload is whole, its slot is free again."""
    path = digit_pngs(tmp_path, 1)[0]
    png = path.read_bytes()
    model = tiny_onnx(tmp_path / "m.onnx", ["a", "b"])
    flags = ("--max-uploads", "2", "--body-timeout", "600", "--reload-interval", "0")
    with serving(model, *flags) as (url, process):
        first, second = (stalled_upload(url, png[:10], len(png), f"127.0.0.{i}") for i in (2, 3))
        until(lambda: health(url)["uploads"]["receiving"] == 2, "2 uploads being received")
        refused = post(url, path)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert "2 uploads are being received already (--max-uploads)" in refused.json()["error"]
        with stalled_upload(
            url, png[:10], len(png), "127.0.0.4"
        ) as third:  # refused, its body coming:
            status, headers, _ = read_answer(third)
            assert status == 503 and headers["connection"] == "close"
            assert third.recv(1) == b""  # the server closed the connection (it held it for good)
        with stalled_upload(url, png[:10], len(png), "127.0.0.2") as again:  # first's address
            status, headers, body = read_answer(again)
            assert status == 429 and headers["retry-after"] == "1", body
            assert (
                "127.0.0.2 has 1 upload being received already, its share while 0 of 2 slots"
                in body["error"]
            ), body
        with first:
            first.sendall(png[10:])  # the rest of its body: answered, and its slot freed
            assert read_answer(first)[0] == 200
        assert post(url, path).status_code == 200
        second.close()
        until(lambda: health(url)["uploads"]["receiving"] == 0, "the last upload dropped")


def fake_model(scale: float):
    """A ServedModel whose network multiplies its input's first two pixels by `scale`."""
    from visionflow.deploy.served import ServedModel

    def predictor(x):
        return x.reshape(len(x), -1)[:, :2] * scale

    return ServedModel(Path("m"), predictor, ["a", "b"], {}, str(scale), 17, [], None, 0.0)


def test_the_batcher_keeps_each_image_with_its_model_and_its_row():
    """Images queued for two models (a reload between them) run as one batch per model, each
    answer is its own image's row, and at most max_batch images are taken at once."""
    from visionflow.deploy.batching import Batcher

    async def scenario():
        batcher = Batcher(max_batch=4, window_s=3600)  # an hour: a wait would hang the test
        old, new = fake_model(1.0), fake_model(10.0)
        models = [old, old, new, new, old]
        answers = [
            batcher.put(m, np.full((1, 1, 2, 2), i, np.float32)) for i, m in enumerate(models)
        ]
        runner = asyncio.create_task(batcher.run_forever())
        answers = await asyncio.gather(*answers)
        runner.cancel()
        return answers, batcher.stats()

    answers, stats = asyncio.run(scenario())
    assert [row.tolist() for row, _ in answers] == [[0, 0], [1, 1], [20, 20], [30, 30], [4, 4]]
    assert [size for _, size in answers] == [2, 2, 2, 2, 1]  # 4 taken: 2 per model; then 1
    assert stats["sizes"] == {"1": 1, "2": 2} and stats["images"] == 5


def test_a_failed_batch_is_a_500_for_each_request_and_health_says_failing_until_one_works(
    tmp_path,
):
    """Each request of a failed batch gets an error of its own (one shared by all gathered
    every request's traceback: thousands of log lines), and /health and /health/ready are a
    503 saying why until a batch succeeds again; /health/live is 200 all along (the process
    answers: a restart would not mend the model)."""
    from visionflow.deploy.batching import Refused
    from visionflow.deploy.serve import Service, Settings
    from visionflow.deploy.served import ServedModel

    def one_row(x):  # passes the one-image check, broken beyond it
        return x.reshape(len(x), -1)[:1, :2]

    broken = ServedModel(Path("m"), one_row, ["a", "b"], {}, "s", 17, [], None, 0.0)

    async def scenario():
        service = Service(broken, Settings(), tmp_path)
        loop = asyncio.get_running_loop()

        def batch(n):
            return [(broken, np.zeros((1, 1, 2, 2), np.float32), loop.create_future())] * n

        failed = [(m, x, loop.create_future()) for m, x, _ in batch(3)]
        await service.batcher.run(failed)
        errors = [done.exception() for _, _, done in failed]
        failing = await service.health(None)
        probes = [await service.ready(None), await service.live(None)]
        await service.batcher.run(batch(1))
        probes += [await service.ready(None), await service.live(None)]
        return errors, failing, await service.health(None), probes

    errors, failing, ok, probes = asyncio.run(scenario())
    assert [(p.status_code, json.loads(p.body)["status"]) for p in probes] == [
        (503, "failing"),
        (200, "alive"),
        (200, "ready"),
        (200, "alive"),
    ]
    assert all(isinstance(e, Refused) and e.status == 500 for e in errors)
    assert len({id(e) for e in errors}) == 3
    assert "returned 1 rows of logits for a batch of 3 images" in str(errors[0])
    report = json.loads(failing.body)
    assert failing.status_code == 503 and report["status"] == "failing"
    assert report["batches"]["failed"] == 1 and "batch 1 of 3" in report["batches"]["last_failed"]
    report = json.loads(ok.body)
    assert ok.status_code == 200 and report["status"] == "ok"
    assert report["batches"]["failed"] == 1 and report["batches"]["last_failed"] is None


def test_a_lone_request_does_not_wait_out_the_window():
    from visionflow.deploy.batching import Batcher

    async def scenario():
        batcher = Batcher(max_batch=32, window_s=3600)  # an hour: a wait would hang the test
        runner = asyncio.create_task(batcher.run_forever())
        row, size = await batcher.put(fake_model(2.0), np.ones((1, 1, 2, 2), np.float32))
        runner.cancel()
        return row.tolist(), size

    assert asyncio.run(scenario()) == ([2.0, 2.0], 1)


# End to end: the real server on the shared reproduced project's model.onnx.


@pytest.fixture(scope="module")
def images(reproduced_base, tmp_path_factory) -> Path:
    """Test digits as PNG, a camera-like JPEG, an RGBA PNG, a 16-bit PNG, a BMP."""
    folder = tmp_path_factory.mktemp("images")
    x = np.load(reproduced_base / "data/prepared/test_x.npy")
    for i in range(4):
        Image.fromarray(x[i, ..., 0]).save(folder / f"digit{i}.png")
    rng = np.random.default_rng(0)
    photo = (rng.random((48, 64, 3)) * 255).astype(np.uint8)
    Image.fromarray(photo).resize((640, 480), Image.BICUBIC).save(folder / "photo.jpg", quality=90)
    rgba = np.dstack([photo, (rng.random((48, 64)) * 255).astype(np.uint8)])
    Image.fromarray(rgba, "RGBA").save(folder / "rgba.png")
    wide = (rng.random((20, 30)) * 65535).astype(np.uint16)
    Image.fromarray(wide).save(folder / "sixteen.png")
    Image.fromarray(photo).save(folder / "photo.bmp")
    return folder


@pytest.fixture(scope="module")
def model(reproduced_base, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("model")
    target = folder / "model.onnx"
    target.write_bytes((reproduced_base / "results/export/model.onnx").read_bytes())
    return target


@pytest.fixture(scope="module")
def server(model):
    """One server for the tests that change nothing: a 1 MB body limit, reloads off."""
    with serving(model, "--max-body-mb", "1", "--reload-interval", "0") as (url, process):
        yield url
    assert process.returncode == 0, "serve did not stop cleanly on SIGTERM"


def post(url: str, path: Path, kind: str = "image/png", **params) -> httpx.Response:
    return httpx.post(
        f"{url}/predict",
        content=path.read_bytes(),
        headers={"content-type": kind},
        params=params,
        timeout=60,
    )


@pytest.mark.slow
def test_health_and_metadata_describe_the_model_served(server, model):
    health = httpx.get(f"{server}/health").json()
    meta = httpx.get(f"{server}/metadata").json()
    sha = hashlib.sha256(model.read_bytes()).hexdigest()
    assert health["status"] == "ok" and health["model"]["sha256"] == sha
    props = {p.key: p.value for p in onnx.load(str(model)).metadata_props}
    assert meta["classes"] == json.loads(props["visionflow.classes"])
    assert meta["preprocess"] == json.loads(props["visionflow.preprocess"])
    assert meta["model"]["sha256"] == sha
    assert meta["model"]["opset"] == onnx.load(str(model)).opset_import[0].version
    assert (meta["model"]["precision"], meta["model"]["quantization"]) == ("float32", None)
    assert meta["model"]["input"] == ["N", 1, 8, 8]  # the tiny project's 8 px grayscale


@pytest.mark.slow
def test_answers_equal_visionflow_predict_for_the_same_files(server, model, images):
    cmd = [sys.executable, "-m", "visionflow.cli", "predict", str(images), "--model", str(model)]
    lines = subprocess.run(
        [*cmd, "--json", "--top-k", "10"], capture_output=True, text=True, check=True
    ).stdout
    expected = {Path(r["file"]).name: r["predictions"] for r in map(json.loads, lines.splitlines())}
    assert len(expected) == 8
    kinds = {".png": "image/png", ".jpg": "image/jpeg", ".bmp": "image/bmp"}
    for name, wanted in expected.items():
        path = images / name
        raw = post(server, path, kinds[path.suffix], top_k=10)
        with open(path, "rb") as f:
            form = httpx.post(f"{server}/predict?top_k=10", files={"file": (name, f)}, timeout=60)
        for answer in (raw, form):
            assert answer.status_code == 200, answer.text
            got = answer.json()["predictions"]
            # the same pixels through the same ONNX Runtime: the same bits, though predict ran
            # the 8 images as one batch and serve one at a time
            assert got == wanted, name
    default = post(server, images / "digit0.png").json()["predictions"]
    assert len(default) == 3  # --top-k's default


def bomb(path: Path) -> Path:
    """A 20000 x 20000 PNG of 49 KB: 400 Mpx once decoded."""
    Image.new("1", (20000, 20000)).save(path, optimize=True)
    return path


@pytest.mark.slow
def test_bad_input_is_a_400_or_413_with_one_line_and_the_server_goes_on(server, images, tmp_path):
    photo = images / "photo.jpg"
    (tmp_path / "truncated.jpg").write_bytes(photo.read_bytes()[: photo.stat().st_size // 3])
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "junk.png").write_bytes(b"<html>not an image</html>")
    Image.new("L", (8000, 7000)).save(tmp_path / "big.png")  # 56 Mpx: over the 50 Mpx limit
    (tmp_path / "huge.png").write_bytes(os.urandom(2 * 2**20))  # over the 1 MB body limit
    cases = {
        ("junk.png", "image/png"): (400, "not a readable image"),
        ("empty.png", "image/png"): (400, "empty"),
        ("truncated.jpg", "image/jpeg"): (400, "truncated"),
        ("junk.png", "text/plain"): (400, "Content-Type text/plain is not an image"),
        ("junk.png", "application/x-www-form-urlencoded"): (400, "is not an image"),
        ("big.png", "image/png"): (413, "8000x7000 = 56000000 px is over the limit"),
        ("huge.png", "image/png"): (413, "the body is over the limit of 1048576 bytes"),
    }
    bomb(tmp_path / "bomb.png")
    cases[("bomb.png", "image/png")] = (413, "decompression bomb")
    for (name, kind), (status, words) in cases.items():
        answer = post(server, tmp_path / name, kind)
        assert (answer.status_code, answer.headers["content-type"]) == (
            status,
            "application/json",
        ), (name, answer.text)
        reason = answer.json()["error"]
        assert words in reason and "\n" not in reason, (name, reason)
    forms = {
        "no file": ({"files": {"a": (None, "b")}}, 400, "no file field"),
        "two files": ({"files": [("a", b"1"), ("b", b"2")]}, 400, "Maximum number of files is 1"),
        "oversize": ({"files": {"file": os.urandom(2 * 2**20)}}, 413, "over the limit"),
    }
    for what, (kwargs, status, words) in forms.items():
        answer = httpx.post(f"{server}/predict", timeout=60, **kwargs)
        assert answer.status_code == status and words in answer.json()["error"], (what, answer.text)
    for query, words in (
        ("0", "top_k must be"),
        ("x", "top_k must be"),
        ("²", "top_k"),
        ("9" * 5000, "top_k"),
    ):
        answer = post(server, images / "digit0.png", top_k=query)
        assert answer.status_code == 400 and words in answer.json()["error"]
    assert post(server, images / "digit0.png").status_code == 200  # still serving
    sniffed = post(server, images / "photo.jpg", "image/png")  # the content decides, not the type
    assert sniffed.status_code == 200
    assert httpx.get(f"{server}/health").json()["batches"]["coming"] == 0


@pytest.mark.slow
def test_a_client_that_goes_away_mid_request_leaves_the_server_serving(server, images):
    host, port = server.removeprefix("http://").split(":")
    for sent in (b"", b"\x89PNG"):  # gone before any body byte; gone halfway
        with socket.create_connection((host, int(port))) as client:
            head = b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\nContent-Length: 5000\r\n\r\n"
            client.sendall(head + sent)
    until(lambda: health(server)["batches"]["coming"] == 0, "the requests ended")
    assert post(server, images / "digit1.png").status_code == 200
    assert health(server)["batches"]["coming"] == 0  # nothing counted as on its way for good


@pytest.mark.slow
def test_a_second_server_on_the_same_port_is_one_line_and_exit_2(server, model):
    port = server.rsplit(":", 1)[1]
    cmd = [sys.executable, "-m", "visionflow.cli", "serve", "--model", str(model), "--port", port]
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert second.returncode == 2 and second.stdout == ""
    assert second.stderr.startswith(
        f"error: cannot listen on 127.0.0.1:{port}: Address already in use"
    )


def health(url: str) -> dict:
    return httpx.get(f"{url}/health").json()


def queued(url: str) -> int:
    """Images waiting for a batch or in the one running."""
    batches = health(url)["batches"]
    return batches["waiting"] + batches["running"]


def many(url: str, paths: list[Path]) -> list[httpx.Response]:
    """Each image in its own thread, all at once."""
    with ThreadPoolExecutor(len(paths)) as pool:
        return list(pool.map(lambda p: post(url, p), paths))


@pytest.mark.slow
def test_concurrent_requests_run_in_fewer_batches(model, images, tmp_path):
    """The first batch is held on ONNX Runtime (a fault point) until all 16 requests are in the
    server; the 15 that queued meanwhile then run as one batch."""
    go = tmp_path / "go"
    env = {"VISIONFLOW_FAULT": f"serve.infer@batch=1:pause={go}"}
    with serving(model, "--max-batch", "16", "--reload-interval", "0", env=env) as (url, process):
        with ThreadPoolExecutor(1) as pool:
            answers = pool.submit(many, url, [images / f"digit{i % 4}.png" for i in range(16)])
            until(lambda: queued(url) == 16, "16 images queued or running")
            go.touch()
            answers = answers.result()
        assert [a.status_code for a in answers] == [200] * 16
        stats = httpx.get(f"{url}/health").json()["batches"]
        sizes = {int(k): v for k, v in stats["sizes"].items()}
        assert sum(size * n for size, n in sizes.items()) == stats["images"] == 16
        assert stats["count"] < 16 and max(sizes) > 1, stats
        # each answer says the batch it ran in: a batch of n has n answers saying n
        said = sorted(a.json()["batch_size"] for a in answers)
        assert sum(1 / n for n in said) == pytest.approx(stats["count"])


def digit_pngs(folder: Path, n: int) -> list[Path]:
    rng = np.random.default_rng(1)
    paths = [folder / f"d{i}.png" for i in range(n)]
    for path in paths:
        Image.fromarray((rng.random((8, 8)) * 255).astype(np.uint8)).save(path)
    return paths


def test_a_model_that_answers_a_batch_with_the_wrong_rows_is_a_500_and_serving_goes_on(tmp_path):
    """A model that passes validation (one image) but returns one row for any batch: the first
    batch is held until all 4 requests are in the server, so at least one batch has several
    images. Its requests get a 500 naming the problem, the log says it, and later requests are
    answered."""
    broken = tiny_onnx(tmp_path / "broken.onnx", ["a", "b", "c"], one_row=True)
    go, log = tmp_path / "go", tmp_path / "serve.log"
    env = {"VISIONFLOW_FAULT": f"serve.infer@batch=1:pause={go}"}
    pngs = digit_pngs(tmp_path, 4)
    with serving(broken, "--reload-interval", "0", env=env, log=log) as (url, process):
        with ThreadPoolExecutor(1) as pool:
            answers = pool.submit(many, url, pngs)
            until(lambda: queued(url) == 4, "4 images queued or running")
            go.touch()
            answers = answers.result()
        sizes = {int(k): n for k, n in health(url)["batches"]["sizes"].items()}
        assert max(sizes) > 1 and sum(k * n for k, n in sizes.items()) == 4
        for answer in answers:
            if answer.status_code == 200:
                assert answer.json()["batch_size"] == 1
            else:
                reason = answer.json()["error"]
                found = re.search(r"returned 1 rows of logits for a batch of (\d+) images", reason)
                assert answer.status_code == 500 and found and int(found[1]) > 1, reason
        assert sum(a.status_code == 500 for a in answers) == sum(
            k * n for k, n in sizes.items() if k > 1
        )
        later = post(url, pngs[0])  # the batcher goes on
        assert later.status_code == 200 and later.json()["batch_size"] == 1
    assert "Traceback" not in log.read_text()  # one line per failed batch, nothing more
    failed = re.findall(r"serve: batch \d+ of (\d+) images failed: ModelError", log.read_text())
    assert sorted(map(int, failed)) == sorted(
        k for k, n in sizes.items() if k > 1 for _ in range(n)
    )


@pytest.mark.slow
def test_sigterm_lets_the_requests_in_flight_finish(model, images, tmp_path):
    go = tmp_path / "go"
    env = {"VISIONFLOW_FAULT": f"serve.infer@batch=1:pause={go}", "TMPDIR": str(tmp_path)}
    with serving(model, "--reload-interval", "0", env=env) as (url, process):
        with ThreadPoolExecutor(1) as pool:
            answers = pool.submit(many, url, [images / f"digit{i}.png" for i in range(4)])
            until(lambda: queued(url) == 4, "4 images queued or running")
            process.send_signal(signal.SIGTERM)
            go.touch()
            assert [a.status_code for a in answers.result()] == [200] * 4
        assert process.wait(60) == 0
    assert not list(tmp_path.glob("visionflow-serve-*"))  # its scratch folder removed


@pytest.mark.slow
def test_sigterm_answers_an_upload_still_arriving_503_not_a_500(tmp_path):
    """A slow upload, legal (above --min-upload-rate), with more to come than the stop's grace
    allows: uvicorn cancelled it at the end of the grace, a bare 500 and a traceback in the log
    (adversarial pass). Now it is answered 503 with Retry-After before that, and the server
    exits 0."""
    model = tiny_onnx(tmp_path / "m.onnx", ["a", "b"])
    log, stop = tmp_path / "serve.log", threading.Event()
    with serving(model, "--min-upload-rate", "1", "--reload-interval", "0", log=log) as (
        url,
        process,
    ):
        client = stalled_upload(url, b"x" * 100, 2**20)  # a MB at 2 KB/s: over 8 minutes

        def send() -> None:
            with contextlib.suppress(OSError):
                while not stop.wait(0.05):
                    client.sendall(b"x" * 100)

        sender = threading.Thread(target=send)
        sender.start()
        try:
            until(lambda: taken(url, 1), "the upload being received")
            process.send_signal(signal.SIGTERM)
            status, headers, body = read_answer(client)
        finally:
            stop.set()
            sender.join()
        assert (status, headers["retry-after"], headers["connection"]) == (503, "1", "close")
        assert "the server is stopping" in body["error"], body
        assert process.wait(60) == 0
    assert "Traceback" not in log.read_text()


def refuses_connections(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    try:
        socket.create_connection((host, int(port)), timeout=60).close()
    except ConnectionRefusedError:
        return True
    return False


def test_sigterm_answers_a_post_sent_on_a_kept_alive_connection(tmp_path):
    """uvicorn closed idle kept-alive connections the moment it stopped, so a POST a client sent
    on one just then was lost (clients do not retry a POST). Now, once SIGTERM has come and the
    server takes no new connections, a POST on a connection kept alive from before is answered,
    with Connection: close; the next one needs a new connection, which is refused."""
    png = digit_pngs(tmp_path, 1)[0].read_bytes()
    model = tiny_onnx(tmp_path / "m.onnx", ["a", "b"])
    log = tmp_path / "serve.log"
    with (
        serving(model, "--reload-interval", "0", log=log) as (url, process),
        httpx.Client(timeout=60, headers={"content-type": "image/png"}) as client,
    ):
        assert client.post(f"{url}/predict", content=png).status_code == 200  # kept alive
        process.send_signal(signal.SIGTERM)
        until(lambda: refuses_connections(url), "new connections refused")
        answer = client.post(f"{url}/predict", content=png)  # on the connection kept alive
        assert answer.status_code == 200 and answer.headers["connection"] == "close"
        with pytest.raises(httpx.ConnectError):
            client.post(f"{url}/predict", content=png)
        assert process.wait(60) == 0
    assert "serve: stopping: no new connections" in log.read_text()


@pytest.mark.slow
def test_ctrl_c_stops_it_with_exit_0_even_where_sigint_was_ignored(model, images, tmp_path):
    """A shell's background job starts with SIGINT ignored; uvicorn takes the signal over."""

    def ignore_sigint():
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    env, log = {"TMPDIR": str(tmp_path)}, tmp_path / "serve.log"
    flags = ("--reload-interval", "0")
    with serving(model, *flags, env=env, log=log, preexec_fn=ignore_sigint) as (url, process):
        assert post(url, images / "digit2.png").status_code == 200
        process.send_signal(signal.SIGINT)
        assert process.wait(60) == 0
    assert log.read_text().endswith("serve: stopped\n")
    assert not list(tmp_path.glob("visionflow-serve-*"))  # its scratch folder removed


@pytest.mark.slow
def test_a_replaced_model_is_validated_before_it_is_served(model, images, tmp_path):
    served = tmp_path / "model.onnx"
    served.write_bytes(model.read_bytes())
    digit = images / "digit0.png"
    first = hashlib.sha256(served.read_bytes()).hexdigest()
    log = tmp_path / "serve.log"
    with serving(served, "--reload-interval", "0.1", log=log) as (url, process):
        for bad, words in (
            (lambda: replace(served, b"\x08garbage"), "could not be loaded"),
            (lambda: renamed(model, served, [str(i) for i in range(11)]), "lists 11 names"),
            (lambda: replace(served, b"plain text"), "not a model file"),
        ):
            bad()
            refused = until(lambda: health(url)["reload"]["refused"], "the bad file refused")
            assert words in refused and str(served) in refused, refused
            answer = post(url, digit)
            assert answer.status_code == 200 and answer.json()["model"] == first
            replace(served, model.read_bytes())  # back to the good one: refused clears
            until(lambda: health(url)["reload"]["refused"] is None, "the good file back")
        names = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
        renamed(model, served, names)
        second = hashlib.sha256(served.read_bytes()).hexdigest()
        until(lambda: health(url)["model"]["sha256"] == second, "the new model served")
        assert httpx.get(f"{url}/metadata").json()["classes"] == names
        answer = post(url, digit).json()
        assert answer["model"] == second and answer["predictions"][0]["class"] in names
        assert health(url)["reload"]["reloads"] == 1
        served.unlink()
        until(lambda: health(url)["reload"]["file_missing"], "the deleted file noticed")
        assert post(url, digit).json()["model"] == second  # still serving
    log = log.read_text()
    assert "reload refused" in log and "reloaded" in log and "is gone" in log


def test_images_decoding_at_once_stay_within_the_pixel_budget():
    """A tiny upload can decode to hundreds of MB (a 49 Mpx 16-bit PNG of 381 KB took 0.8 GB):
    the pixels decoding at once, over all the threads, stay within --max-pixels; an image that
    does not fit beside the others waits for them, and one alone always goes."""
    from visionflow.deploy.batching import PixelBudget

    budget, inside, release, seen = PixelBudget(100), threading.Event(), threading.Event(), []
    trying = threading.Event()

    def big():
        with budget.held(80):
            inside.set()
            release.wait(60)

    def waiting():
        trying.set()
        with budget.held(50):  # does not fit beside the 80: waits for it
            seen.append(budget.used)

    first = threading.Thread(target=big)
    first.start()
    assert inside.wait(60)
    with budget.held(20):  # fits beside it
        seen.append(budget.used)
    second = threading.Thread(target=waiting)
    second.start()
    assert trying.wait(60)  # on its way in before the 80 goes (a budget that let it in: 130)
    release.set()
    first.join(60)
    second.join(60)
    with budget.held(500):  # over the budget, but alone
        seen.append(budget.used)
    assert seen == [100, 50, 500] and budget.used == 0


def conv_onnx(path: Path, size: int = 64, channels: int = 64) -> Path:
    """An RGB `size` px classifier whose activations grow with the batch as a real network's do:
    a 3x3 convolution to `channels` maps (1 MB an image at 64 px), then an average and 2 classes."""
    rng = np.random.default_rng(0)
    conv = rng.standard_normal((channels, 3, 3, 3)).astype(np.float32)
    head = rng.standard_normal((channels, 2)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["image", "conv"], ["maps"], pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["maps"], ["relu"]),
            helper.make_node("GlobalAveragePool", ["relu"], ["pooled"]),
            helper.make_node("Flatten", ["pooled"], ["flat"]),
            helper.make_node("MatMul", ["flat", "head"], ["logits"]),
        ],
        "conv",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", 3, size, size])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 2])],
        [
            helper.make_tensor("conv", TensorProto.FLOAT, conv.shape, conv.ravel()),
            helper.make_tensor("head", TensorProto.FLOAT, head.shape, head.ravel()),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    spec = preprocess_spec(size, 3, [0.5] * 3, [0.25] * 3)
    helper.set_model_props(model, file_metadata(["a", "b"], spec))
    onnx.save(model, str(path))
    return path


def predict_peak_mb(model: Path, folder: Path) -> float:
    """The peak resident memory of one `visionflow predict` process over `folder`, in MB."""
    cmd = [sys.executable, "-m", "visionflow.cli", "predict", "--model", str(model), str(folder)]
    with open(os.devnull, "w") as null:
        process = subprocess.Popen(cmd, stdout=null, stderr=subprocess.PIPE)
        _, status, usage = os.wait4(process.pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, process.stderr.read()
        process.stderr.close()
    return usage.ru_maxrss / 1024  # Linux: KB


def test_predicts_peak_memory_does_not_grow_with_the_folder_for_a_larger_input(tmp_path):
    """A 64 px RGB model over 60 and 600 photos: the runtime's activations grow with the batch,
    and batches of 256 made the 600 peak at about 3x the 60 (#45). Batches now hold a bounded
    number of input values, so both peak alike."""
    model = conv_onnx(tmp_path / "m.onnx")
    photo = tmp_path / "photo.png"
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (64, 64, 3), np.uint8)).save(photo)
    peaks = []
    for count in (60, 600):
        folder = tmp_path / str(count)
        folder.mkdir()
        for i in range(count):
            os.link(photo, folder / f"{i:04d}.png")
        peaks.append(predict_peak_mb(model, folder))
    assert peaks[1] < 1.2 * peaks[0], peaks


def test_a_body_no_route_reads_does_not_hold_its_connection(tmp_path):
    """GET /health and a POST to no route, each announcing a body of 1 MB and sending a byte of
    it: answered, then the connection closed. Before, uvicorn went on reading the body, each
    byte resetting its keep-alive timer: a client dripping it held the connection for good."""
    model = tiny_onnx(tmp_path / "m.onnx", ["a", "b"])
    with serving(model, "--body-timeout", "600", "--reload-interval", "0") as (url, process):
        host, port = url.removeprefix("http://").split(":")
        for head in ("GET /health", "POST /nope"):
            with socket.create_connection((host, int(port)), timeout=60) as client:
                client.sendall(
                    f"{head} HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\nx".encode()
                )
                status, headers, _ = read_answer(client)
                assert status in (200, 404) and headers["connection"] == "close", (head, headers)
                assert client.recv(1) == b""  # closed by the server, the body unread


def test_a_request_head_must_arrive_in_time_on_a_socket_that_sends_at_once():
    """uvicorn with the server's `HeadTimeout` and its socket from `listen` (IPPROTO_TCP, so
    asyncio sets TCP_NODELAY): a whole request is answered; then that kept-alive connection, and
    one that sent half a head, are closed at the head deadline, long before uvicorn's own
    keep-alive timeout. The clients write before the server starts: a slow machine cannot make
    them late."""
    import uvicorn

    from visionflow.deploy.server import HeadTimeout, listen

    async def app(scope, receive, send):
        headers = [(b"content-length", b"2")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"ok"})

    class Quick(HeadTimeout):
        head_timeout_s = 0.5

    sock = listen("127.0.0.1", 0)
    assert sock.proto == socket.IPPROTO_TCP
    with pytest.raises(OSError):  # the port is taken: nothing half made is left open
        listen("127.0.0.1", sock.getsockname()[1])
    whole = socket.create_connection(sock.getsockname(), timeout=60)  # in the listen backlog
    half = socket.create_connection(sock.getsockname(), timeout=60)
    whole.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    half.sendall(b"GET /hea")
    config = uvicorn.Config(app, http=Quick, lifespan="off", log_level="error")
    config.timeout_keep_alive = 600  # what closes them within the sockets' 60 s is the deadline
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        got = b""
        while not got.endswith(b"\r\n\r\nok"):
            more = whole.recv(4096)
            assert more, got
            got += more
        assert got.startswith(b"HTTP/1.1 200 OK")
        assert whole.recv(4096) == b""  # no next head: closed
        assert half.recv(4096) == b""  # closed, with no answer
    finally:
        whole.close()
        half.close()
        server.should_exit = True
        thread.join(60)


def test_an_address_owing_its_share_of_graces_is_refused_until_it_pays_back(monkeypatch):
    """The budget is the address's: uploads dropped at the end of their grace (drippers that
    reconnect) add up, and the address is refused (429) until it has paid one back; another
    address is served all along, and one address never takes the last free slots."""
    from visionflow.deploy.batching import Refused
    from visionflow.deploy.serve_uploads import Uploads

    clock = [1000.0]
    monkeypatch.setattr("visionflow.deploy.serve_uploads.time.monotonic", lambda: clock[0])

    class Dripped:  # held its slot one grace beyond what its bytes paid for
        def graces_used(self) -> float:
            return 1.0

    uploads = Uploads(most=32, per_client=8, grace_s=10)
    for _ in range(8):
        upload = Dripped()
        uploads.admit("10.0.0.1", upload)
        uploads.end("10.0.0.1", upload)
    with pytest.raises(Refused) as refused:
        uploads.admit("10.0.0.1", Dripped())
    assert refused.value.status == 429 and refused.value.headers["Retry-After"] == "1"
    uploads.admit("10.0.0.2", Dripped())  # another address: served
    clock[0] += 60  # 6 x --body-timeout: one grace paid back
    uploads.admit("10.0.0.1", Dripped())
    assert uploads.report()["refused"] == {"busy": 0, "per_client": 1}

    class Fast:  # at the minimum rate or faster: owes nothing
        def graces_used(self) -> float:
            return 0.0

    fast = Uploads(most=10, per_client=4, grace_s=10)
    for _ in range(6):
        fast.admit("10.0.0.3", Fast())  # 6 at once while more than 4 slots are free
    with pytest.raises(Refused, match="has 6 uploads being received already, its share while 4"):
        fast.admit("10.0.0.3", Fast())
    fast.admit("10.0.0.4", Fast())  # the last slots go to other addresses


def test_a_per_client_share_over_max_uploads_is_refused(capsys):
    """A share larger than every slot turned the per-address limit off, silently: 8 drippers
    from one address then held --max-uploads 4 (adversarial pass)."""
    from visionflow import cli

    flags = ["--max-uploads", "4", "--max-uploads-per-client", "100"]
    with pytest.raises(SystemExit) as exit:
        cli.main(["serve", "--model", "m.onnx", *flags])
    said = capsys.readouterr().err
    assert exit.value.code == 2 and "--max-uploads-per-client must be at most --max-uploads" in said
