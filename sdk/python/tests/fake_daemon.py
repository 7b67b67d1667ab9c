"""A stand-in for bulkheadd in the SDK's unit tests: an HTTP/1.1 server on a Unix socket in a
temporary directory that records every request and answers with what the test scripted."""

from __future__ import annotations

import http.server
import os
import socketserver
import tempfile
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple


@dataclass
class Request:
    """A request the fake daemon received."""

    method: str
    target: str
    headers: Dict[str, str]
    body: bytes


@dataclass
class Answer:
    """What the fake daemon answers: a status, headers and a body sent in ``chunks`` (HTTP
    chunked encoding, one chunk each, flushed one by one, as axum streams)."""

    status: int = 200
    chunks: Sequence[bytes] = (b"",)
    headers: Dict[str, str] = field(default_factory=dict)
    #: Close the connection in the middle of a chunk after ``chunks`` (a daemon that died).
    cut: bool = False
    #: Answer 101 and hand the connection (reader, writer) to this function instead.
    upgrade: Optional[Callable[[Any, Any], None]] = None


def json_answer(status: int, text: str) -> Answer:
    """An answer with a JSON body."""
    return Answer(status, [text.encode()], {"Content-Type": "application/json"})


def error_answer(status: int, code: str, message: str) -> Answer:
    """The daemon's error document."""
    return json_answer(status, '{"error": {"code": "%s", "message": "%s"}}' % (code, message))


Route = Callable[[Request], Answer]


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        # A client that leaves once it has what it needs (the exec's `exit` line) is normal.
        pass


class FakeDaemon:
    """The server; ``routes[(method, path)]`` (the path without its query) answers requests,
    anything else is a 404 ``not_found``. Use as a context manager."""

    def __init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="bulkhead-sdk-test-")
        #: The socket path.
        self.socket = os.path.join(self._dir.name, "d.sock")
        #: Requests received, in order.
        self.requests: List[Request] = []
        #: Scripted answers.
        self.routes: Dict[Tuple[str, str], Route] = {}
        self._server = _Server(self.socket, self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.01,), daemon=True)

    def __enter__(self) -> "FakeDaemon":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._dir.cleanup()

    def route(self, method: str, path: str, answer: Answer) -> None:
        """Answers ``method path`` with ``answer`` every time."""
        self.routes[(method, path)] = lambda _req: answer

    def _answer(self, request: Request) -> Answer:
        self.requests.append(request)
        path = request.target.split("?", 1)[0]
        route = self.routes.get((request.method, path))
        if route is None:
            return error_answer(404, "not_found", f"no route {request.method} {path}")
        return route(request)

    def _handler(self) -> type:
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                request = Request(
                    self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, body
                )
                answer = fake._answer(request)
                if answer.upgrade is not None:
                    self.send_response(101)
                    self.send_header("Connection", "Upgrade")
                    self.send_header("Upgrade", request.headers.get("upgrade", ""))
                    self.end_headers()
                    self.wfile.flush()
                    answer.upgrade(self.rfile, self.wfile)
                    self.close_connection = True
                    return
                self.send_response(answer.status)
                for key, value in answer.headers.items():
                    self.send_header(key, value)
                self.send_header("Transfer-Encoding", "chunked")
                self.send_header("Connection", "close")
                self.end_headers()
                for chunk in answer.chunks:
                    if chunk:
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.flush()
                self.wfile.write(b"10\r\npart" if answer.cut else b"0\r\n\r\n")
                self.wfile.flush()

            do_GET = do_POST = do_PUT = do_DELETE = _serve

            def log_message(self, format: str, *args: object) -> None:
                pass

        return Handler


def sandbox_doc(sandbox_id: str = "3fa8c01d92be", state: str = "running") -> str:
    """A ``SandboxInfo`` document as the daemon sends it."""
    return (
        '{"id": "%s", "state": "%s", "created_at": "2026-12-04T23:00:00Z", "expires_at": null, '
        '"vcpus": 1, "memory_mib": 256, "kernel": null, "image": null, "disk_mib": null, '
        '"labels": {"team": "a"}, "workspace": null, "mounts": [], "hostname": "bh-%s", '
        '"network": null, "template": null, "limits": {"memory_bytes": 335544320, '
        '"cpu_quota": null, "pids_max": 64, "cgroup": null}, "vmm_pid": 4242, "failure": null}'
        % (sandbox_id, state, sandbox_id)
    )


