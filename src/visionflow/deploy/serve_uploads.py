"""How a request's body reaches `visionflow serve`: spooled to a file (`spool`), within a size, a
deadline and a minimum rate (`Upload`), and admitted only while the server and the client's
address have room (`Uploads`). No torch.

The deadline of one upload is its start + --body-timeout (the grace) + its bytes / --min-upload-rate.
A client that reconnects gets a new upload and a new grace, so deadlines alone let 32 connections
from one address, dripping a byte every 5 s and reconnecting after each 408, hold every upload
slot at about 10 bytes/s (a good client got 503 on 79 of 80 requests). Hence `Uploads` shares
the slots out by client address: a budget of grace that an address's uploads spend and
reconnecting does not renew, and the last slots kept for addresses that hold few.
"""

import asyncio
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from visionflow.deploy.batching import Refused

MB = 2**20
RAW_TYPES = ("application/octet-stream",)  # besides image/*: "these are a file's bytes"
REFILL_GRACES = 6  # an address pays back one grace per 6 x --body-timeout (a minute)

NOT_AN_IMAGE_TYPE = (
    "Content-Type {} is not an image: send the file's bytes with Content-Type image/jpeg "
    "(image/png, ...) or application/octet-stream, or as a multipart form file "
    "(curl -F file=@photo.jpg)"
)


def media_type(request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


def too_large(limit: int) -> str:
    return f"the body is over the limit of {limit} bytes ({limit / MB:g} MB, --max-body-mb)"


class Upload:
    """One request body as it arrives: `request` is the request with a receive that refuses (413)
    a body past `limit` bytes, and drops (408, closing the connection) one that sends no byte for
    `grace_s`, or that, once `grace_s` has passed since its first byte was awaited, has averaged
    under `min_rate` bytes/s. A deadline per receive alone let a client that drips a byte now and
    then hold an upload slot for good."""

    def __init__(self, request, limit: int, grace_s: float, min_rate: float):
        from starlette.requests import Request

        self.limit, self.grace_s, self.min_rate = limit, grace_s, min_rate
        self.seen = 0  # bytes of the body so far
        self.start = self.last = time.monotonic()  # when it was first awaited; its last bytes
        self.cutoff = math.inf  # time.monotonic() by which it must end: the server is stopping
        self.inner = request.receive
        self.request = Request(request.scope, self.receive)

    async def receive(self):
        # the body's deadline for the bytes so far: the grace, then min_rate on average
        due = self.start + self.grace_s + self.seen / self.min_rate
        try:
            wait = min(due, self.last + self.grace_s, self.cutoff) - time.monotonic()
            message = await asyncio.wait_for(self.inner(), wait)
        except TimeoutError:  # asyncio.TimeoutError is this class from Python 3.11 on
            if time.monotonic() >= self.cutoff:
                raise Refused(
                    503,
                    f"the server is stopping: {self.seen} bytes of the upload came; send it again",
                    {"Retry-After": "1", "Connection": "close"},
                ) from None
            elapsed = time.monotonic() - self.start
            if due < self.last + self.grace_s:
                reason = (
                    f"the upload is too slow: {self.seen} bytes in {elapsed:.0f} s, under the "
                    f"minimum of {self.min_rate / 1024:g} KB/s (--min-upload-rate) after the "
                    f"first {self.grace_s:g} s (--body-timeout)"
                )
            else:
                reason = (
                    f"the upload stalled: no byte of the body for {self.grace_s:g} s "
                    f"(--body-timeout); {self.seen} bytes came"
                )
            raise Refused(408, reason, {"Connection": "close"}) from None
        self.seen += len(message.get("body", b""))
        self.last = time.monotonic()
        if self.seen > self.limit:
            raise Refused(413, too_large(self.limit))
        return message

    def graces_used(self) -> float:
        """The time this upload has held its slot beyond what its bytes pay for at min_rate, in
        graces: 0 for one at the minimum rate or faster, about 1 for one dropped at the end of
        its grace (a 408); so far, or however it ended (finished, dropped, or abandoned)."""
        unpaid = time.monotonic() - self.start - self.seen / self.min_rate
        return max(0.0, unpaid) / self.grace_s


@dataclass
class Client:
    """One client address: its uploads being received, and the graces it owes (`Uploads`)."""

    uploads: set = field(default_factory=set)  # its `Upload`s being received
    owed: float = 0.0  # graces its ended uploads used, not yet paid back
    at: float = 0.0  # time.monotonic() when `owed` was last brought up to date


class Uploads:
    """The uploads being received, at most `most` at once (past that, a 503: the server is
    busy), shared out by client address (past its share, a 429 for that address alone):

    - An address owes the time its uploads held their slots beyond what their bytes pay for at
      --min-upload-rate, in graces (--body-timeout): about 1 for an upload dropped at the end
      of its grace, 0 for one at the minimum rate or faster, however it ends. It pays back one
      grace per REFILL_GRACES graces of time, and while it owes `per_client` graces or more it
      is refused. Reconnecting renews nothing: the debt is the address's, not the upload's.
    - The last `per_client` free slots go only to addresses that have fewer than `per_client`
      uploads being received: no address takes every slot, and an address with many fast
      uploads at once is refused nothing while the server has room.

    So 32 drippers from one address take 24 of 32 slots for one grace, and then owe 24: the
    address is refused for 16 minutes, then gets one upload a minute (--body-timeout 10,
    per_client 8)."""

    def __init__(self, most: int, per_client: int, grace_s: float):
        self.most, self.per_client = most, per_client
        self.refill_s = REFILL_GRACES * grace_s  # the seconds an address pays a grace back in
        self.receiving = 0
        self.clients: dict[str, Client] = {}  # by address; forgotten once it owes nothing
        self.swept = time.monotonic()
        self.refused: Counter = Counter()  # "busy" (503), "per_client" (429)
        self.cutoff = math.inf  # set when the server stops (`cut_off`)

    def cut_off(self, at: float) -> None:
        """The server stops: every upload, arriving or to come, must end by `at` (monotonic)."""
        self.cutoff = at
        for client in self.clients.values():
            for upload in client.uploads:
                upload.cutoff = at

    def client(self, address: str) -> Client:
        """The address's uploads, with what it owes brought up to date."""
        now = time.monotonic()
        if now - self.swept > self.refill_s:  # forget addresses that owe nothing, now and then
            self.swept = now
            for gone in [a for a, c in self.clients.items() if self.idle(c, now)]:
                del self.clients[gone]
        client = self.clients.setdefault(address, Client(at=now))
        client.owed = max(0.0, client.owed - (now - client.at) / self.refill_s)
        client.at = now
        return client

    def idle(self, client: Client, now: float) -> bool:
        return not client.uploads and client.owed <= (now - client.at) / self.refill_s

    def admit(self, address: str, upload: Upload) -> None:
        """Give `upload` from `address` a slot, or refuse it (429, 503) saying why."""
        client = self.client(address)
        owes = client.owed + sum(u.graces_used() for u in client.uploads)
        if owes >= self.per_client:
            self.refused["per_client"] += 1
            wait = max(1, math.ceil((owes - self.per_client) * self.refill_s))
            raise Refused(
                429,
                f"uploads from {address} were too slow lately: they held their slots {owes:.1f} "
                f"x --body-timeout longer than their bytes paid for at --min-upload-rate; an "
                f"address owing {self.per_client} is refused until it has paid back (one every "
                f"{self.refill_s:g} s): try again in {wait} s, or send faster",
                {"Retry-After": str(wait)},
            )
        free, n = self.most - self.receiving, len(client.uploads)
        if free <= self.per_client and n >= self.per_client:
            self.refused["per_client"] += 1
            uploads = f"{n} upload{'s' if n > 1 else ''}"
            raise Refused(
                429,
                f"{address} has {uploads} being received already, its share while {free} of "
                f"{self.most} slots are free: try again",
                {"Retry-After": "1"},
            )
        if free <= 0:
            self.refused["busy"] += 1
            raise Refused(
                503,
                f"{self.receiving} uploads are being received already (--max-uploads): try again",
                {"Retry-After": "1"},
            )
        upload.cutoff = self.cutoff
        client.uploads.add(upload)
        self.receiving += 1

    def end(self, address: str, upload: Upload) -> None:
        """Give the slot back; the address owes the graces the upload used."""
        client = self.client(address)
        client.uploads.remove(upload)
        self.receiving -= 1
        client.owed += upload.graces_used()

    def report(self) -> dict:
        return {
            "receiving": self.receiving,
            "max": self.most,
            "per_client": self.per_client,
            "refused": {"busy": self.refused["busy"], "per_client": self.refused["per_client"]},
        }


async def spool(request, dest: Path, limit: int) -> None:
    """The request's image into the file `dest`: a raw body, or a multipart form's one file.
    `request` is an `Upload`'s, which enforces the limits as the body arrives."""
    kind = media_type(request)
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise Refused(413, too_large(limit))
    if kind == "multipart/form-data":
        await spool_form(request, dest)
    elif kind.startswith("image/") or kind in RAW_TYPES:
        with open(dest, "wb") as out:
            async for chunk in request.stream():
                out.write(chunk)
    else:
        raise Refused(400, NOT_AN_IMAGE_TYPE.format(kind or "(none)"))
    if dest.stat().st_size == 0:
        raise Refused(400, "the image is empty (0 bytes): send the image file's bytes")


async def spool_form(request, dest: Path) -> None:
    """The one file of a multipart form into `dest`. A form that ends before its closing
    boundary (cut off mid-file), or that the parser cannot read, is a 400 saying so."""
    from starlette.datastructures import UploadFile
    from starlette.formparsers import MultiPartException, MultiPartParser

    class Parser(MultiPartParser):
        complete = False  # the closing boundary came (Starlette accepts a form without it)

        def on_end(self) -> None:
            self.complete = True

    parser = Parser(request.headers, request.stream(), max_files=1, max_fields=16)
    try:
        form = await parser.parse()
    except MultiPartException as error:
        reason = f" ({error.__cause__})" if error.__cause__ else ""  # the parser's own words
        raise Refused(400, f"the multipart form is malformed: {error.message}{reason}") from None
    try:
        if not parser.complete:
            raise Refused(
                400,
                "the multipart form is cut off: it ends before its closing boundary "
                "(mid-file?); send the whole form",
            )
        files = [value for _, value in form.multi_items() if isinstance(value, UploadFile)]
        if not files:
            raise Refused(
                400, "the multipart form has no file field: send one (-F file=@photo.jpg)"
            )
        with open(dest, "wb") as out:
            await files[0].seek(0)
            while chunk := await files[0].read(MB):
                out.write(chunk)
    finally:
        await form.close()
