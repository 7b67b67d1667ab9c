"""HTTP/1.1 over the daemon's Unix socket, with the standard library's ``http.client``.

Every request opens its own connection (cheap on a Unix socket), as the Rust client does, so a
:class:`Transport` may be shared between threads.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
from typing import Any, Iterator, Mapping, Optional, Union

from .errors import DaemonUnavailable, ProtocolError, error_for

#: Where the daemon listens unless told otherwise (the same default as the CLI and Rust client).
DEFAULT_SOCKET = "/run/bulkhead/bulkheadd.sock"
#: Environment variable naming the daemon's socket.
SOCKET_ENV = "BULKHEAD_SOCKET"
#: Largest error document read from an answer, bytes (the daemon's are a few hundred).
_MAX_ERROR_BYTES = 1 << 20
#: Bytes asked of the socket per read while streaming.
_READ_SIZE = 64 << 10

Body = Union[bytes, None]


def socket_path(socket_arg: Union[str, "os.PathLike[str]", None] = None) -> str:
    """The socket to use: ``socket_arg``, else ``$BULKHEAD_SOCKET`` (when not empty), else
    :data:`DEFAULT_SOCKET`. An empty ``socket_arg`` is a :class:`ValueError` (it names no
    socket; pass ``None`` for the default)."""
    if socket_arg is not None:
        path = os.fspath(socket_arg)
        if not path:
            raise ValueError("socket: an empty path names no socket (pass None for the default)")
        return path
    return os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET


class _UnixConnection(http.client.HTTPConnection):
    """An ``HTTPConnection`` whose transport is a Unix stream socket."""

    def __init__(self, path: str, timeout: Optional[float]) -> None:
        super().__init__("bulkheadd")
        #: The socket path.
        self.path = path
        self._sock_timeout = timeout

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self._sock_timeout)
        try:
            sock.connect(self.path)
        except OSError as err:
            sock.close()
            raise DaemonUnavailable(
                f"cannot connect to bulkheadd at {self.path}: {err.strerror or err} "
                f"(is the daemon running? pass socket= or set {SOCKET_ENV})",
                code="daemon_unavailable",
            ) from err
        self.sock = sock


class Response:
    """A successful answer whose body is still to be read; close it (or use ``with``) when done."""

    def __init__(self, conn: _UnixConnection, raw: http.client.HTTPResponse) -> None:
        self._conn = conn
        self._raw = raw
        #: The HTTP status (2xx).
        self.status: int = raw.status

    def header(self, name: str) -> Optional[str]:
        """The value of response header ``name``, or None."""
        return self._raw.getheader(name)

    def read(self) -> bytes:
        """The whole body; closes the connection."""
        try:
            return self._raw.read()
        finally:
            self.close()

    def json(self) -> Any:
        """The body parsed as JSON."""
        body = self.read()
        try:
            return json.loads(body)
        except ValueError as err:
            raise ProtocolError(f"bulkheadd answered with invalid JSON: {err}", code="protocol") from err

    def chunks(self) -> Iterator[bytes]:
        """The body in pieces as they arrive (each at most 64 KiB); closes at the end. A body
        cut short (the daemon died, the connection broke) raises
        :class:`~bulkhead.errors.DaemonUnavailable` rather than ending quietly."""
        try:
            while True:
                try:
                    piece = self._raw.read1(_READ_SIZE)
                except (OSError, http.client.HTTPException) as err:
                    raise DaemonUnavailable(
                        f"the connection to bulkheadd at {self._conn.path} broke during its "
                        f"answer: {err!r}",
                        code="connection_lost",
                    ) from err
                if not piece:
                    return
                yield piece
        finally:
            self.close()

    def close(self) -> None:
        """Closes the connection (a running exec's command is killed by the daemon)."""
        self._raw.close()
        self._conn.close()

    def __enter__(self) -> "Response":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Transport:
    """Sends requests to one daemon socket."""

    def __init__(self, path: str, timeout: Optional[float] = None) -> None:
        #: The socket path.
        self.path = path
        #: Socket timeout in seconds for each read and write (None: wait as long as it takes;
        #: creates wait for a VM's boot and execs for their command).
        self.timeout = timeout

    def connect(self) -> socket.socket:
        """A new connection to the daemon (for an upgraded request); raises
        :class:`~bulkhead.errors.DaemonUnavailable` when the socket cannot be reached."""
        conn = _UnixConnection(self.path, self.timeout)
        conn.connect()
        assert conn.sock is not None
        sock: socket.socket = conn.sock
        return sock

    def request(
        self,
        method: str,
        target: str,
        *,
        body: Body = None,
        json_body: Any = None,
        headers: Optional[Mapping[str, str]] = None,
    ) -> Response:
        """Sends a request; returns the answer with its body unread, or raises the API error
        (a :class:`~bulkhead.errors.BulkheadError` subclass) for a 4xx/5xx answer."""
        send_headers = dict(headers or {})
        if json_body is not None:
            body = json.dumps(json_body).encode()
            send_headers["Content-Type"] = "application/json"
        if body is not None:
            send_headers["Content-Length"] = str(len(body))
        conn = _UnixConnection(self.path, self.timeout)
        try:
            conn.request(method, target, body=body, headers=send_headers)
            raw = conn.getresponse()
        except DaemonUnavailable:
            conn.close()
            raise
        except (OSError, http.client.HTTPException) as err:
            conn.close()
            raise DaemonUnavailable(
                f"talking to bulkheadd at {self.path}: {err}", code="daemon_unavailable"
            ) from err
        if raw.status >= 400:
            try:
                raise _api_error(raw)
            finally:
                raw.close()
                conn.close()
        return Response(conn, raw)


def _api_error(raw: http.client.HTTPResponse) -> Exception:
    """The exception for an error answer (its ``{"error": {code, message}}`` document)."""
    text = raw.read(_MAX_ERROR_BYTES)
    try:
        detail = json.loads(text)["error"]
        code, message = str(detail["code"]), str(detail["message"])
    except (ValueError, KeyError, TypeError):
        code = "http_error"
        message = text.decode("utf-8", "replace").strip() or (raw.reason or "no explanation")
    return error_for(raw.status, code, message)
