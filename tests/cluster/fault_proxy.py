"""A fault-injecting HTTPS proxy on loopback in front of the real API server, for the tests of retries and watches.

What the control plane cannot be made to do on demand (answer 429 or 5xx, drop a connection, cut a watch mid-stream,
answer slowly) is done here, between a client and the real kube-apiserver; everything else is forwarded unchanged.
As measured (``../shared/k8s/README.md``, "A fault proxy in front of the API server"):

- The proxy terminates TLS with the API server's own serving certificate, so a client keeps its one CA and only its
  ``Configuration.host`` changes (the Python client 30.x ignores ``HTTPS_PROXY``). The client's bearer token goes
  upstream unchanged: the API server still authenticates, authorizes and audits the real caller.
- Upstream it speaks HTTP/1.1 over TLS (a fresh connection per request, verified with the API server's certificate as
  CA), and forwards a response's body as it arrives: watches and followed logs are chunked and long-lived. A watch
  (``watch=true``) is forwarded one line at a time, a line being one watch event, so that a cut falls between events.
- Whenever it ends a client's stream (a cut, the client hanging up, :meth:`FaultProxy.stop`) it closes the upstream
  connection too; else the API server would hold that watch for 30-60 minutes.

Faults are rules, consumed in the order they were added: the first rule that matches a request and has uses left
applies (one rule per request). ``injected`` records every fault applied, ``requests`` every request seen.
Upgrade requests (exec, attach, port-forward) are not supported.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import re
import select
import socket
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0
# A non-streaming request: the API server's own limit is --request-timeout (1 min by default), so this only bounds a
# hung server. Watches and followed logs read without a timeout (the API server ends them) until stop().
READ_TIMEOUT_S = 90.0
STOP_WAIT_S = 5.0
CLIENT_POLL_S = 0.2  # how often a streaming response looks whether its client hung up

# RFC 9110 section 7.6.1, plus what this proxy sets itself (Host, Content-Length, Expect: the body is already read).
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "expect",
    }
)
WATCH = re.compile(r"[?&]watch=(true|1)(&|$)", re.IGNORECASE)
STREAMING = re.compile(r"[?&](watch|follow)=(true|1)(&|$)", re.IGNORECASE)

# The reasons (metav1.StatusReason) the API server gives with each code; "" is StatusReasonUnknown.
REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    406: "NotAcceptable",
    409: "Conflict",
    410: "Expired",
    413: "RequestEntityTooLarge",
    415: "UnsupportedMediaType",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}
MESSAGES = {
    429: "Too many requests, please try again later.",
    500: "Internal error occurred: injected by the fault proxy",
    503: "the server is currently unable to handle the request",
    504: "the server was unable to return a response in the time allotted, but may still be processing the request",
}


def status_body(code: int, message: str = "", reason: str | None = None, retry_after: float | None = None) -> bytes:
    """A ``Status`` (meta/v1) as the API server writes one for a failed request."""
    status: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message or MESSAGES.get(code, f"injected by the fault proxy: {code}"),
        "reason": REASONS.get(code, "") if reason is None else reason,
        "code": code,
    }
    if retry_after is not None:
        status["details"] = {"retryAfterSeconds": round(retry_after)}
    return json.dumps(status).encode()


def _shutdown(sock: socket.socket) -> None:
    """Shut a socket down both ways, which wakes a thread blocked reading or writing it (close alone does not).
    The plain socket's method, so that an SSLSocket neither sends close_notify nor drops its state under a reader."""
    with contextlib.suppress(OSError, ValueError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


@dataclass
class _Rule:
    kind: str  # fail, drop, delay or cut_watch
    method: str  # "*": any
    pattern: re.Pattern[str]
    times: int
    status: int = 0
    retry_after: float | None = None
    message: str = ""
    reason: str | None = None
    seconds: float = 0.0
    events: int = 0

    def matches(self, method: str, path: str) -> bool:
        if self.times <= 0 or self.method not in ("*", method.upper()) or not self.pattern.search(path):
            return False
        return self.kind != "cut_watch" or bool(WATCH.search(path))


class FaultProxy:
    """``https://127.0.0.1:<port>`` (:attr:`url`) forwarding to ``upstream_url``, with faults on demand.

    ``cert_file`` and ``key_file`` are what it serves (the API server's own, so that clients keep its CA);
    ``ca_file`` is what it trusts upstream. Use as ``proxy = FaultProxy(...).start()`` then ``proxy.stop()``, or as a
    context manager.
    """

    def __init__(self, upstream_url: str, cert_file: Path, key_file: Path, ca_file: Path):
        upstream = urlsplit(upstream_url)
        if upstream.scheme != "https" or not upstream.hostname:
            raise ValueError(f"upstream must be https://HOST[:PORT], not {upstream_url!r}")
        self.upstream_host, self.upstream_port = upstream.hostname, upstream.port or 443
        self.server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.server_context.load_cert_chain(cert_file, key_file)
        self.upstream_context = ssl.create_default_context(cafile=str(ca_file))
        self.url = ""
        self.injected: list[tuple[str, str, str]] = []
        self.requests: list[tuple[str, str]] = []
        self._rules: list[_Rule] = []
        self._lock = threading.Condition()
        self._open: set[socket.socket] = set()  # client and upstream sockets, closed by stop()
        self._stopping = threading.Event()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # -- life ---------------------------------------------------------------------------------------------------

    def start(self) -> FaultProxy:
        self._server = _Server(self)
        self.url = f"https://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.1},
            daemon=True,
            name=f"fault-proxy-{self._server.server_address[1]}",
        )
        self._thread.start()
        log.info("fault proxy %s -> https://%s:%d", self.url, self.upstream_host, self.upstream_port)
        return self

    def stop(self) -> None:
        """Stop accepting, shut every client and upstream connection down, and wait (bounded) for their threads."""
        self._stopping.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        with self._lock:
            for sock in self._open:
                _shutdown(sock)
            if not self._lock.wait_for(lambda: not self._open, timeout=STOP_WAIT_S):
                log.warning("fault proxy: %d connections still open %.0fs after stop", len(self._open), STOP_WAIT_S)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    # -- faults -------------------------------------------------------------------------------------------------

    def fail_next(
        self,
        method: str,
        path_regex: str,
        status: int,
        times: int = 1,
        retry_after: float | None = None,
        message: str = "",
        reason: str | None = None,
    ) -> None:
        """Answer the next ``times`` matching requests with a Status of ``status`` (the API server's reason for that
        code unless ``reason`` is given; a Retry-After header and ``details.retryAfterSeconds`` with
        ``retry_after``), without forwarding them. ``path_regex`` is searched in the path with its query; ``method``
        "*" is any.

        urllib3's default retries (a Configuration's ``retries`` None) resend an idempotent request answered 413, 429
        or 503 with a Retry-After by themselves, after sleeping it; and they take only whole seconds (the API server
        sends nothing else): a fraction such as "0.5" makes them raise InvalidHeader."""
        self._add(
            _Rule(
                "fail",
                method.upper(),
                re.compile(path_regex),
                times,
                status=status,
                retry_after=retry_after,
                message=message,
                reason=reason,
            )
        )

    def drop_next(self, method: str, path_regex: str, times: int = 1) -> None:
        """Close the client's connection instead of answering the next ``times`` matching requests."""
        self._add(_Rule("drop", method.upper(), re.compile(path_regex), times))

    def cut_watch_after(self, events: int, times: int = 1, path_regex: str = "") -> None:
        """For the next ``times`` matching watch requests: forward ``events`` events, then cut the client's
        connection mid-stream (no end of the chunked body) and close the upstream one. The cut comes right after the
        last event forwarded; a watch the API server ends first uses the rule up without a cut. A watch answered
        other than 200 is forwarded whole."""
        self._add(_Rule("cut_watch", "GET", re.compile(path_regex), times, events=events))

    def delay_next(self, method: str, path_regex: str, seconds: float, times: int = 1) -> None:
        """A slow server: wait ``seconds`` before forwarding the next ``times`` matching requests."""
        self._add(_Rule("delay", method.upper(), re.compile(path_regex), times, seconds=seconds))

    def _add(self, rule: _Rule) -> None:
        with self._lock:
            self._rules.append(rule)

    def _take(self, method: str, path: str) -> _Rule | None:
        """Record the request, and use up one time of the first rule that matches it."""
        with self._lock:
            self.requests.append((method, path))
            for rule in self._rules:
                if rule.matches(method, path):
                    rule.times -= 1
                    return rule
        return None

    def _record(self, kind: str, method: str, path: str) -> None:
        log.info("fault proxy: %s %s %s", kind, method, path)
        with self._lock:
            self.injected.append((kind, method, path))

    # -- connections --------------------------------------------------------------------------------------------

    def _track(self, sock: socket.socket) -> None:
        with self._lock:
            if self._stopping.is_set():
                _shutdown(sock)
            self._open.add(sock)

    def _untrack(self, sock: socket.socket) -> None:
        with self._lock:
            self._open.discard(sock)
            self._lock.notify_all()

    def _connect(self, streaming: bool) -> tuple[http.client.HTTPSConnection, socket.socket]:
        """A fresh upstream connection (no stale keep-alive to retry), connected within CONNECT_TIMEOUT_S."""
        conn = http.client.HTTPSConnection(
            self.upstream_host, self.upstream_port, timeout=CONNECT_TIMEOUT_S, context=self.upstream_context
        )
        conn.connect()
        assert conn.sock is not None
        sock = conn.sock  # kept: http.client hands it to the response and forgets it when the response will close
        self._track(sock)
        sock.settimeout(None if streaming else READ_TIMEOUT_S)
        return conn, sock


class _Server(ThreadingHTTPServer):
    """A thread per client connection; TLS handshakes happen in that thread, not in the accepting one."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, proxy: FaultProxy):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.proxy = proxy
        self.socket = proxy.server_context.wrap_socket(self.socket, server_side=True, do_handshake_on_connect=False)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("fault proxy: connection from %s ended with an error", client_address, exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: urllib3 pools its connections
    server: _Server
    connection: ssl.SSLSocket

    def setup(self) -> None:
        super().setup()
        self.server.proxy._track(self.connection)

    def handle(self) -> None:
        self.connection.do_handshake()
        super().handle()

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.proxy._untrack(self.connection)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("fault proxy: " + format, *args)

    def _proxy(self) -> None:
        proxy, method, path = self.server.proxy, self.command, self.path
        body = self._read_body()
        rule = proxy._take(method, path)
        if rule is None:
            self._forward(body)
        elif rule.kind == "fail":
            proxy._record("fail", method, path)
            headers = [] if rule.retry_after is None else [("Retry-After", f"{rule.retry_after:g}")]
            self._answer(rule.status, status_body(rule.status, rule.message, rule.reason, rule.retry_after), headers)
        elif rule.kind == "drop":
            proxy._record("drop", method, path)
            self._cut_client()
        elif rule.kind == "delay":
            proxy._record("delay", method, path)
            if proxy._stopping.wait(rule.seconds):
                self._cut_client()
            else:
                self._forward(body)
        else:
            self._forward(body, cut_after=rule.events)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = _proxy  # http.server's names

    # -- the request --------------------------------------------------------------------------------------------

    def _read_body(self) -> bytes | None:
        """The request's body (None: it has none), read whole: API requests are small, and a Content-Length is
        then known upstream."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks = []
            while size := int(self.rfile.readline(65537).split(b";")[0], 16):
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                pass  # trailers
            return b"".join(chunks)
        length = self.headers.get("Content-Length")
        return self.rfile.read(int(length)) if length is not None else None

    def _upstream_headers(self, body: bytes | None) -> list[tuple[str, str]]:
        named = {n.strip().lower() for n in self.headers.get("Connection", "").split(",")}
        headers = [(k, v) for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP and k.lower() not in named]
        headers += [
            ("Host", f"{self.server.proxy.upstream_host}:{self.server.proxy.upstream_port}"),
            ("Connection", "close"),
        ]
        if body is not None:
            headers.append(("Content-Length", str(len(body))))
        return headers

    # -- the response -------------------------------------------------------------------------------------------

    def _answer(self, code: int, body: bytes, headers: list[tuple[str, str]]) -> None:
        """The proxy's own answer, a Status in JSON."""
        self.send_response_only(code)
        for name, value in [("Content-Type", "application/json"), *headers, ("Content-Length", str(len(body)))]:
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _forward(self, body: bytes | None, cut_after: int | None = None) -> None:
        proxy, method, path = self.server.proxy, self.command, self.path
        streaming = bool(STREAMING.search(path))
        try:
            conn, sock = proxy._connect(streaming)
        except (OSError, http.client.HTTPException) as exc:
            log.warning("fault proxy: %s %s: cannot reach the API server: %r", method, path, exc)
            self._answer(502, status_body(502, f"fault proxy: cannot reach the API server: {exc}", ""), [])
            return
        response: http.client.HTTPResponse | None = None
        stream_done = threading.Event()  # ends the thread that watches for the client hanging up
        try:
            conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
            for name, value in self._upstream_headers(body):
                conn.putheader(name, value)
            conn.endheaders(body)
            response = conn.getresponse()
            if streaming:
                threading.Thread(
                    target=self._watch_client,
                    args=(stream_done, sock),
                    daemon=True,
                    name=f"fault-proxy-watch-{self.client_address[1]}",
                ).start()
            self._relay(response, cut_after if WATCH.search(path) and response.status == 200 else None)
        except (OSError, http.client.HTTPException) as exc:
            log.info("fault proxy: %s %s ended: %r", method, path, exc)
            if response is None and not proxy._stopping.is_set():  # nothing sent to the client yet: answer
                self._answer(502, status_body(502, f"fault proxy: the API server failed: {exc}", ""), [])
                self.close_connection = True
            else:  # the response began: cut it, as a broken server would
                self._cut_client()
        finally:
            stream_done.set()
            _shutdown(sock)
            proxy._untrack(sock)
            if response is not None:
                response.close()
            conn.close()

    def _relay(self, response: http.client.HTTPResponse, cut_after: int | None) -> None:
        """Status, headers (Warning, Retry-After, Audit-Id ... all but hop-by-hop) and the body as it arrives: with
        its Content-Length where upstream gave one, else chunked (each piece flushed at once)."""
        self.send_response_only(response.status, response.reason)
        for name, value in response.getheaders():
            if name.lower() not in HOP_BY_HOP:
                self.send_header(name, value)
        length = response.getheader("Content-Length")
        bodiless = self.command == "HEAD" or response.status in (204, 304) or response.status < 200
        chunked = length is None and not bodiless and self.request_version != "HTTP/1.0"
        if length is not None and not response.chunked:
            self.send_header("Content-Length", length)
        elif chunked:
            self.send_header("Transfer-Encoding", "chunked")
        elif not bodiless:
            self.send_header("Connection", "close")  # an HTTP/1.0 client: the end of the body is the close
        self.end_headers()
        if bodiless:
            return
        pieces = _lines(response) if cut_after is not None or WATCH.search(self.path) else _pieces(response)
        sent = 0
        while sent != cut_after and (piece := next(pieces, None)) is not None:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            self.wfile.flush()
            sent += 1
        if sent == cut_after:
            self.server.proxy._record("cut_watch", self.command, self.path)
            self._cut_client()
        elif chunked:
            self.wfile.write(b"0\r\n\r\n")

    def _cut_client(self) -> None:
        """End the client's connection abruptly, without an answer or the end of a chunked body."""
        self.close_connection = True
        _shutdown(self.connection)

    def _watch_client(self, done: threading.Event, upstream: socket.socket) -> None:
        """While a watch or followed log streams, shut its upstream connection down as soon as the client hangs up
        (else the API server would keep the watch until its timeout, 30-60 min). A client that sends anything (a
        TLS alert, a next request) is left to the stream."""
        while not done.is_set():
            try:
                if not select.select([self.connection], [], [], CLIENT_POLL_S)[0]:
                    continue
                if socket.socket.recv(self.connection, 1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                    return
            except BlockingIOError:
                continue
            except (OSError, ValueError):
                pass
            if not done.is_set():
                log.debug("fault proxy: the client of %s %s hung up: closing upstream", self.command, self.path)
                _shutdown(upstream)
            return


def _pieces(response: http.client.HTTPResponse) -> Iterator[bytes]:
    """The body as it arrives (one read each, never waiting for more)."""
    while piece := response.read1(65536):
        yield piece


def _lines(response: http.client.HTTPResponse) -> Iterator[bytes]:
    """The body a line at a time (a watch event each), then whatever follows the last newline."""
    pending = b""
    for piece in _pieces(response):
        *lines, pending = (pending + piece).split(b"\n")
        for line in lines:
            yield line + b"\n"
    if pending:
        yield pending
