"""Try a server (`visionflow serve`, or a proxy in front of it) against slow uploads: clients that
drip request bodies and reconnect, a good client beside them, and a probe; prints what each got.

    python examples/upload_attack.py URL IMAGE [--drippers 32] [--drip-every 5] [--drip-bytes 1]
        [--length 100000] [--attacker 127.0.0.1] [--client 127.0.0.2] [--every 0.5]
        [--probe /health/live] [--seconds 40]

Each dripper, from --attacker (a comma-separated list spreads them over several addresses), sends
a POST /predict that announces --length bytes, then --drip-bytes of them every --drip-every
seconds; once the server answers or closes, it opens a new one at once. The good client, from
--client, posts IMAGE every --every seconds (a 20 s timeout; its statuses are also counted per
10 s); the probe, from 127.0.0.3, asks
for --probe every second. Linux routes all of 127.0.0.0/8 to lo, so 127.0.0.x are distinct client
addresses on one machine. Prints one JSON object: the statuses each side got (`closed`: closed
without an answer; `timeout`: none within 20 s) and the good client's slowest answer. Standard
library only.
"""

import argparse
import json
import math
import select
import socket
import threading
import time
from collections import Counter
from urllib.parse import urlsplit

ANSWER_TIMEOUT_S = 20.0  # the good client's and the probe's patience, as the bound
COUNTING = threading.Lock()  # the threads' counts


def count(seen: Counter, status: str) -> None:
    with COUNTING:
        seen[status] += 1


def connect(address, source: str, timeout: float) -> socket.socket:
    """A connection from `source`. IP_BIND_ADDRESS_NO_PORT (Linux) picks the local port at
    connect, for this destination: else thousands of refused attempts a second each hold a port of
    `source` in TIME-WAIT for a minute, and a proxy on this machine (connecting from 127.0.0.1
    too) found none left to reach serve with (502s that a real attacker could not cause)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.IPPROTO_IP, getattr(socket, "IP_BIND_ADDRESS_NO_PORT", 24), 1)
        sock.settimeout(timeout)
        sock.bind((source, 0))
        sock.connect(address)
    except BaseException:
        sock.close()
        raise
    return sock


def status_of(sock: socket.socket) -> str:
    """The status code of the answer coming on `sock`, or `closed`."""
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            return "closed"
        data += chunk
    return data.split(b" ", 2)[1].decode()


def ask(address, source: str, request: bytes) -> str:
    """One request on a new connection (Connection: close): its status."""
    try:
        with connect(address, source, ANSWER_TIMEOUT_S) as sock:
            sock.sendall(request)
            return status_of(sock)
    except TimeoutError:
        return "timeout"
    except OSError as error:
        return type(error).__name__


def drip(address, source: str, args, stop: threading.Event, seen: Counter) -> None:
    head = (
        f"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
        f"Content-Length: {args.length}\r\n\r\n"
    ).encode()
    while not stop.is_set():
        sent, status = 0, "closed"
        try:
            with connect(address, source, 60) as sock:
                sock.sendall(head)
                while not stop.is_set() and sent < args.length:
                    piece = min(args.drip_bytes, args.length - sent)
                    sock.sendall(b"x" * piece)
                    sent += piece
                    if select.select([sock], [], [], args.drip_every)[0]:
                        break  # answered (or closed) before the body was whole
                status = status_of(sock)
        except OSError as error:
            status = type(error).__name__
            stop.wait(0.1)  # refused or reset: not a busy loop
        if not stop.is_set():
            count(seen, status)


def good_client(address, source: str, image: bytes, args, stop, seen, times) -> None:
    request = (
        f"POST /predict HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        f"Content-Type: application/octet-stream\r\nContent-Length: {len(image)}\r\n\r\n"
    ).encode() + image
    began = time.monotonic()
    while not stop.is_set():
        start = time.monotonic()
        status = ask(address, source, request)
        count(seen, status)
        times.append((start - began, time.monotonic() - start, status))
        stop.wait(args.every)


def probe(address, path: str, stop, seen) -> None:
    request = f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
    while not stop.is_set():
        count(seen, ask(address, "127.0.0.3", request))
        stop.wait(1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url")
    parser.add_argument("image")
    parser.add_argument("--drippers", type=int, default=32)
    parser.add_argument("--drip-every", type=float, default=5.0, help="seconds between drips")
    parser.add_argument("--drip-bytes", type=int, default=1, help="bytes each drip sends")
    parser.add_argument("--length", type=int, default=100_000, help="the body each announces")
    parser.add_argument("--attacker", default="127.0.0.1", help="addresses, comma-separated")
    parser.add_argument("--client", default="127.0.0.2")
    parser.add_argument("--every", type=float, default=0.5, help="seconds between good posts")
    parser.add_argument("--probe", default="/health/live")
    parser.add_argument("--seconds", type=float, default=40.0)
    args = parser.parse_args()
    url = urlsplit(args.url)
    address = (url.hostname, url.port or 80)
    with open(args.image, "rb") as f:
        image = f.read()
    stop, drips, good, live, times = threading.Event(), Counter(), Counter(), Counter(), []
    sources = args.attacker.split(",")
    threads = [
        threading.Thread(target=drip, args=(address, sources[i % len(sources)], args, stop, drips))
        for i in range(args.drippers)
    ]
    threads.append(
        threading.Thread(
            target=good_client, args=(address, args.client, image, args, stop, good, times)
        )
    )
    threads.append(threading.Thread(target=probe, args=(address, args.probe, stop, live)))
    for thread in threads:
        thread.start()
    time.sleep(args.seconds)
    stop.set()
    for thread in threads:
        thread.join()
    windows = [Counter() for _ in range(math.ceil(args.seconds / 10))]
    for start, _, status in times:
        windows[min(int(start // 10), len(windows) - 1)][status] += 1
    print(
        json.dumps(
            {
                "seconds": args.seconds,
                "good": dict(good),
                "good_slowest_s": round(max((t for _, t, _ in times), default=0.0), 3),
                "good_per_10s": [dict(window) for window in windows],
                "probe": {args.probe: dict(live)},
                "drippers": dict(drips),
            }
        )
    )


if __name__ == "__main__":
    main()
