"""A fault-injecting HTTP proxy on loopback, in front of the moto S3 server.

Wrappers around the storage object can fail calls, but only a proxy reproduces what S3 clients
really meet: throttling answers, connections cut in the middle of an upload, an endpoint that
resets everything for a while, a request left hanging while its client is killed. The proxy speaks
just enough HTTP/1.1 for botocore/aiohttp: keep-alive, request bodies by ``Content-Length`` or
``Transfer-Encoding: chunked``, ``Expect: 100-continue``; responses are buffered and relayed with a
fresh ``Content-Length``. Each request is forwarded on its own upstream connection, so an injected
fault never leaves moto with a half-sent request.

Matching: ``method`` compares with the HTTP method (``None`` matches all) and ``path_regex`` is
``re.search``-ed against the request target, path and query (``"/bucket/key?partNumber=2&..."``).
"""

from __future__ import annotations

import http.client
import http.server
import re
import select
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import NamedTuple

_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te",
               "upgrade", "expect", "content-length", "trailer"}
_S3_ERRORS = {500: ("InternalError", "We encountered an internal error. Please try again."),
              503: ("SlowDown", "Please reduce your request rate."),
              403: ("AccessDenied", "Access Denied"),
              404: ("NoSuchKey", "The specified key does not exist.")}


class LogEntry(NamedTuple):
    method: str
    path: str
    query: str
    body_bytes: int
    outcome: int | str  # moto's status; or "failed" (injected error), "reset", "client-gone"


class PauseHandle:
    """A request held by ``FaultProxy.pause``: ``reached`` is set once it arrived and its first
    body bytes were read; it goes upstream only after ``release()``."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self._released = threading.Event()

    def release(self) -> None:
        self._released.set()


@dataclass
class _Rule:
    kind: str  # "fail" | "reset" | "pause"
    remaining: int
    method: str | None
    regex: re.Pattern[str] | None
    status: int = 503
    code: str | None = None
    after_body_bytes: int = 0
    handle: PauseHandle | None = field(default=None)
    forward_if_client_gone: bool = False

    def matches(self, method: str, target: str) -> bool:
        return (self.remaining > 0 and self.method in (None, method)
                and (self.regex is None or self.regex.search(target) is not None))


class _Body:
    """Reads a request body incrementally (Content-Length or chunked) so that a fault can strike
    after exactly K body bytes. ``complete`` is False if the client went away early."""

    def __init__(self, rfile, headers) -> None:
        self._rfile = rfile
        self._chunked = "chunked" in headers.get("Transfer-Encoding", "").lower()
        self._left = 0 if self._chunked else int(headers.get("Content-Length") or 0)
        self._done = not self._chunked and self._left == 0
        self.data = bytearray()
        self.complete = True

    def read(self, upto: int | None = None) -> None:
        """Read until ``upto`` body bytes in all (None: the whole body) or the body ends."""
        try:
            self._read(upto)
        except (OSError, ValueError):  # reset by a killed client; or garbage chunk framing
            self._gone()

    def _read(self, upto: int | None) -> None:
        while not self._done and (upto is None or len(self.data) < upto):
            if self._chunked and self._left == 0:
                size = self._rfile.readline(65537).split(b";")[0].strip()
                if not size:
                    return self._gone()
                self._left = int(size, 16)
                if self._left == 0:  # last chunk: skip trailers up to the blank line
                    while self._rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass
                    self._done = True
                    return None
            want = self._left if upto is None else min(self._left, upto - len(self.data))
            chunk = self._rfile.read(want)
            if not chunk:
                return self._gone()
            self.data += chunk
            self._left -= len(chunk)
            if self._left == 0:
                if self._chunked:
                    self._rfile.readline(3)  # CRLF after the chunk data
                else:
                    self._done = True
        return None

    def _gone(self) -> None:
        self.complete, self._done = False, True


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        # Clients that vanish (killed, or reset by an injected fault) are expected here.
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)


class FaultProxy:
    """Threaded HTTP proxy to ``upstream`` (``http://host:port``) with injectable faults.

    All control methods are thread-safe. ``url`` is the endpoint to give to s3fs instead of moto's.
    """

    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.removeprefix("http://").rstrip("/").partition(":")
        self._upstream = (host, int(port or 80))
        self._lock = threading.Lock()
        self._rules: list[_Rule] = []
        self._latency = 0.0
        self._outage_until = 0.0
        self._conns: set[socket.socket] = set()
        self.log: list[LogEntry] = []
        self._server = _Server(("127.0.0.1", 0), self._handler_class())
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, args=(0.05,), name="faultproxy",
                         daemon=True).start()

    # ---- controls -------------------------------------------------------------------------------

    def latency(self, seconds: float) -> None:
        """Delay every request by ``seconds`` before it is answered or forwarded."""
        with self._lock:
            self._latency = seconds

    def fail(self, n: int, status: int = 503, method: str | None = None,
             path_regex: str | None = None, code: str | None = None) -> None:
        """Answer the next ``n`` matching requests with an S3 XML error, without forwarding."""
        self._add(_Rule("fail", n, method, _compile(path_regex), status=status, code=code))

    def reset(self, n: int = 1, after_body_bytes: int = 0, method: str | None = None,
              path_regex: str | None = None) -> None:
        """For the next ``n`` matching requests, read ``after_body_bytes`` body bytes, then reset
        the TCP connection (the client sees ECONNRESET mid-upload)."""
        self._add(_Rule("reset", n, method, _compile(path_regex),
                        after_body_bytes=after_body_bytes))

    def outage(self, seconds: float) -> None:
        """Reset every request's connection for ``seconds`` from now."""
        with self._lock:
            self._outage_until = time.monotonic() + seconds

    def outage_until_cleared(self) -> None:
        with self._lock:
            self._outage_until = float("inf")

    def pause(self, method: str | None, path_regex: str | None, after_body_bytes: int = 0,
              forward_if_client_gone: bool = False) -> PauseHandle:
        """Hold the next matching request after ``after_body_bytes`` body bytes until released,
        e.g. to ``kill -9`` the client while its upload is in flight.

        If the client has gone away when released, the request is dropped (logged as
        ``client-gone``), even if its whole body had already reached the proxy's socket buffers;
        with ``forward_if_client_gone`` a complete body still goes to S3, as it may in reality
        (an object written by a writer that died before hearing the answer).
        """
        handle = PauseHandle()
        self._add(_Rule("pause", 1, method, _compile(path_regex), after_body_bytes=after_body_bytes,
                        handle=handle, forward_if_client_gone=forward_if_client_gone))
        return handle

    def clear(self) -> None:
        """End all faults and latency; release paused requests."""
        with self._lock:
            rules, self._rules = self._rules, []
            self._latency, self._outage_until = 0.0, 0.0
        for rule in rules:
            if rule.handle is not None:
                rule.handle.release()

    def count(self, method: str | None = None, path_regex: str | None = None,
              outcome: int | str | None = None) -> int:
        """Logged requests matching ``method``, ``path_regex`` (on path?query) and ``outcome``."""
        regex = _compile(path_regex)
        with self._lock:
            return sum(1 for e in self.log
                       if method in (None, e.method) and outcome in (None, e.outcome)
                       and (regex is None or regex.search(_target(e.path, e.query))))

    def close(self) -> None:
        """Stop serving and cut all client connections (keep-alive ones included)."""
        self.clear()
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            conns = list(self._conns)
        for sock in conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    # ---- internals ------------------------------------------------------------------------------

    def _add(self, rule: _Rule) -> None:
        with self._lock:
            self._rules.append(rule)

    def _take(self, method: str, target: str) -> tuple[_Rule | None, bool, float]:
        """The fault for this request (consuming one use of the rule), outage flag, latency."""
        with self._lock:
            if time.monotonic() < self._outage_until:  # an outage does not use up other faults
                return None, True, self._latency
            rule = next((r for r in self._rules if r.matches(method, target)), None)
            if rule is not None:
                rule.remaining -= 1
            return rule, False, self._latency

    def _record(self, method: str, target: str, body_bytes: int, outcome: int | str) -> None:
        path, _, query = target.partition("?")
        with self._lock:
            self.log.append(LogEntry(method, path, query, body_bytes, outcome))

    def _forward(self, method: str, target: str, headers, body: bytes
                 ) -> tuple[int, str, list[tuple[str, str]], bytes]:
        """Send one request to moto on a new connection; return status, reason, headers, body."""
        conn = http.client.HTTPConnection(*self._upstream, timeout=30)
        try:
            conn.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
            for name, value in headers.items():
                if name.lower() not in _HOP_BY_HOP:
                    conn.putheader(name, value)
            if body or "Content-Length" in headers or "Transfer-Encoding" in headers:
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body)
            resp = conn.getresponse()
            return resp.status, resp.reason, resp.getheaders(), resp.read()
        finally:
            conn.close()

    def _handler_class(self) -> type[http.server.BaseHTTPRequestHandler]:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = 60  # idle keep-alive connections end eventually

            def setup(self) -> None:
                super().setup()
                with proxy._lock:
                    proxy._conns.add(self.connection)

            def finish(self) -> None:
                with proxy._lock:
                    proxy._conns.discard(self.connection)
                try:
                    super().finish()
                except OSError:
                    pass

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _proxy_request(self) -> None:
                method, target = self.command, self.path
                rule, outage, delay = proxy._take(method, target)
                if delay:
                    time.sleep(delay)
                body = _Body(self.rfile, self.headers)
                if outage:
                    return self._reset(method, target, 0)
                if rule is not None and rule.kind in ("reset", "pause"):
                    body.read(rule.after_body_bytes)
                    if rule.kind == "reset":
                        return self._reset(method, target, len(body.data))
                    assert rule.handle is not None
                    rule.handle.reached.set()
                    rule.handle._released.wait()
                body.read()
                if not body.complete or (rule is not None and rule.kind == "pause"
                                         and not rule.forward_if_client_gone
                                         and not _client_alive(self.connection)):
                    proxy._record(method, target, len(body.data), "client-gone")
                    self.close_connection = True
                    return None
                if rule is not None and rule.kind == "fail":
                    proxy._record(method, target, len(body.data), "failed")
                    return self._send_error_xml(method, rule.status, rule.code)
                try:
                    status, reason, headers, data = proxy._forward(
                        method, target, self.headers, bytes(body.data))
                except OSError as exc:
                    proxy._record(method, target, len(body.data), "upstream-error")
                    return self._send(502, [("Content-Type", "text/plain")], str(exc).encode())
                proxy._record(method, target, len(body.data), status)
                relayed = [(k, v) for k, v in headers if k.lower() not in _HOP_BY_HOP]
                if method == "HEAD":  # a HEAD answer's Content-Length is the object's size
                    relayed += [(k, v) for k, v in headers if k.lower() == "content-length"]
                return self._send(status, relayed, data, reason=reason, head=method == "HEAD")

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = do_PATCH = do_OPTIONS = (
                _proxy_request)

            def _send(self, status: int, headers: list[tuple[str, str]], body: bytes,
                      reason: str | None = None, head: bool = False) -> None:
                self.send_response_only(status, reason)
                for name, value in headers:
                    self.send_header(name, value)
                if not head and status not in (204, 304):
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head and status not in (204, 304):
                    self.wfile.write(body)
                self.wfile.flush()

            def _send_error_xml(self, method: str, status: int, code: str | None) -> None:
                default_code, message = _S3_ERRORS.get(status, ("InternalError", "Injected fault."))
                xml = ('<?xml version="1.0" encoding="UTF-8"?>\n'
                       f"<Error><Code>{code or default_code}</Code><Message>{message}</Message>"
                       "<RequestId>faultproxy</RequestId></Error>").encode()
                headers = [("Content-Type", "application/xml"), ("x-amz-request-id", "faultproxy")]
                if method == "HEAD":
                    headers.append(("Content-Length", "0"))
                self._send(status, headers, xml, head=method == "HEAD")

            def _reset(self, method: str, target: str, body_bytes: int) -> None:
                proxy._record(method, target, body_bytes, "reset")
                # SO_LINGER 0: close() sends RST instead of FIN, so the client gets ECONNRESET.
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                           struct.pack("ii", 1, 0))
                self.close_connection = True
                # rfile (a makefile()) holds the socket open: close it too, so the RST goes out
                # now and socketserver's later shutdown(SHUT_WR) cannot send a FIN first.
                self.rfile.close()
                self.connection.close()

        return Handler


def _client_alive(sock: socket.socket) -> bool:
    """False if the client closed or reset its side (a peek sees EOF or an error)."""
    try:
        # select() first: on a socket with a timeout, recv() would wait for data even with
        # MSG_DONTWAIT.
        if not select.select([sock], [], [], 0)[0]:
            return True
        return sock.recv(1, socket.MSG_PEEK) != b""
    except OSError:
        return False


def _compile(path_regex: str | None) -> re.Pattern[str] | None:
    return re.compile(path_regex) if path_regex is not None else None


def _target(path: str, query: str) -> str:
    return f"{path}?{query}" if query else path
