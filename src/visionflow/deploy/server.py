"""uvicorn's HTTP server, made to hold up under real clients: a deadline for each request head
(`HeadTimeout`), a stop that loses no request a client has sent (`Server`), and a listening
socket that gets TCP_NODELAY (`listen`). No torch."""

import asyncio
import socket

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from visionflow.deploy.batching import log


class HeadTimeout(H11Protocol):
    """uvicorn's HTTP/1.1, with a deadline for each request head, which uvicorn has not: a
    client that sent `GET /hea` and nothing more held its connection for good, and enough of
    them held every file descriptor (the server then answered nobody). The head must be whole
    within `head_timeout_s` (--body-timeout) of the connection or of the previous answer."""

    head_timeout_s = 10.0  # serve() sets it
    deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.deadline is not None and self.conn.their_state is not h11.IDLE:
            self.deadline.cancel()  # the head is in
            self.deadline = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.arm()

    def arm(self) -> None:
        if self.deadline is None and self.conn.their_state is h11.IDLE:
            self.deadline = self.loop.call_later(self.head_timeout_s, self.head_too_late)

    def head_too_late(self) -> None:
        self.deadline = None
        if self.conn.their_state is h11.IDLE:
            self.timeout_keep_alive_handler()  # closes the connection


class Server(uvicorn.Server):
    """uvicorn's server, stopping without losing a request a client has sent. uvicorn closes
    each idle kept-alive connection the moment it stops, and a POST a client sent on one just
    then is lost (16 keep-alive clients lost 6 to 11 POSTs; clients do not retry a POST).
    Here it stops accepting connections first, then each open one closes after its next answer
    (which says Connection: close) or, idle, after uvicorn's keep-alive timeout (5 s); then
    uvicorn's own shutdown (requests in flight finish, within graceful_s in all)."""

    def __init__(self, config: uvicorn.Config, service):  # serve.Service
        super().__init__(config)
        self.service = service

    async def shutdown(self, sockets=None) -> None:
        log("stopping: no new connections; each open one closes after its next answer")
        self.service.stopping = True
        for server in self.servers:
            server.close()
        loop = asyncio.get_running_loop()
        graceful = self.config.timeout_graceful_shutdown
        deadline = loop.time() + graceful
        # an upload still arriving then (a slow, legal one) is answered 503 before uvicorn would
        # cancel it (a bare 500 and a traceback): the client sends it again, to another replica
        self.service.uploads.cut_off(deadline - min(2.0, graceful / 2))
        while self.server_state.connections and not self.force_exit and loop.time() < deadline:
            await asyncio.sleep(0.05)
        self.config.timeout_graceful_shutdown = max(0.0, deadline - loop.time())
        await super().shutdown(sockets)


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket. Made with proto IPPROTO_TCP, as asyncio makes its own: asyncio
    sets TCP_NODELAY only on such sockets, and without it every answer on a kept-alive
    connection waited 40 ms for the client's delayed ACK (socket.create_server's proto is 0)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock
