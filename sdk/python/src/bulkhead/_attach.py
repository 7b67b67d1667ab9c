"""Attached execs: ``POST /v1/sandboxes/{id}/exec/attach`` switches the connection
(``Connection: Upgrade``, ``Upgrade: bulkhead-exec``, answer 101) to the agent protocol's frames
both ways (docs/agent-protocol.md, "Frames"): a ``u32`` little-endian length of the rest, a type
byte, the payload. Stdin streams without a size limit; a terminal gets resizes."""

from __future__ import annotations

import json
import socket
import struct
import threading
from typing import IO, Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

from .errors import ExecInterrupted, ProtocolError, error_for, stream_error
from .types import ExecEvent, ExecResult, Exit, Stderr, Stdout

#: The ``Upgrade`` protocol name of attached execs.
ATTACH_PROTOCOL = "bulkhead-exec"
#: Largest frame payload either side accepts, bytes (1 MiB).
MAX_FRAME = 1 << 20
#: Stdin is sent in frames of at most this many bytes (16 KiB, as the agent's senders do).
DATA_CHUNK = 16 << 10
#: Longest answer head read before the upgrade, bytes.
_MAX_HEAD = 64 << 10

_STARTED, _STDIN, _STDIN_EOF, _SIGNAL = 0x10, 0x11, 0x12, 0x13
_STDOUT, _STDERR, _EXIT, _RESIZE, _ERROR = 0x14, 0x15, 0x16, 0x17, 0x7F


def encode(kind: int, payload: bytes = b"") -> bytes:
    """One frame of type ``kind``."""
    return struct.pack("<IB", len(payload) + 1, kind) + payload


def upgrade(sock: socket.socket, target: str, spec: Dict[str, Any]) -> IO[bytes]:
    """Sends the attach request on the connected ``sock`` and reads the answer's head; returns
    the connection's reader positioned at the first frame, or raises the API error."""
    body = json.dumps(spec).encode()
    head = (
        f"POST {target} HTTP/1.1\r\nHost: bulkheadd\r\nConnection: Upgrade\r\n"
        f"Upgrade: {ATTACH_PROTOCOL}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    reader = sock.makefile("rb")
    try:
        status, headers = _read_head(reader)
        if status == 101:
            return reader
        raise _error(status, headers, reader)
    except BaseException:
        reader.close()
        raise


def _read_head(reader: IO[bytes]) -> Tuple[int, Dict[str, str]]:
    line = reader.readline(_MAX_HEAD)
    parts = line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise ProtocolError(f"unexpected answer to an attach: {line[:100]!r}", code="protocol")
    headers: Dict[str, str] = {}
    total = len(line)
    while True:
        line = reader.readline(_MAX_HEAD)
        total += len(line)
        if line in (b"\r\n", b"\n", b"") or total > _MAX_HEAD:
            break
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


def _error(status: int, headers: Dict[str, str], reader: IO[bytes]) -> Exception:
    """The API error of a refused attach (its JSON error document)."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        text = b""
        while len(text) < _MAX_HEAD:
            size = int(reader.readline(100).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                break
            text += reader.read(size)
            reader.readline(100)
    else:
        text = reader.read(min(int(headers.get("content-length", "0") or 0), _MAX_HEAD))
    try:
        detail = json.loads(text)["error"]
        return error_for(status, str(detail["code"]), str(detail["message"]))
    except (ValueError, KeyError, TypeError):
        return error_for(status, "http_error", text.decode("utf-8", "replace").strip() or str(status))


class Attached:
    """A command running with its stdin held open (``sb.attach(...)``).

    Feed it with :meth:`write` and end its input with :meth:`close_stdin`; iterate over it (or
    call :meth:`wait`) for its output events, ending with :class:`~bulkhead.types.Exit`. Writing
    and reading may happen on different threads (the connection is full-duplex), which large
    inputs need when the command writes while it reads. Closing the attachment before the
    command's exit (:meth:`close`, or leaving a ``with`` block) kills it unless stdin was closed.
    """

    def __init__(self, sock: socket.socket, reader: IO[bytes]) -> None:
        self._sock = sock
        self._reader = reader
        self._send_lock = threading.Lock()
        #: The command's guest pid (from the daemon's ``Started`` frame).
        self.pid: Optional[int] = None
        first = self._frame()
        if first is None or first[0] != _STARTED:
            self.close()
            raise ProtocolError("an attached exec did not start with a Started frame", code="protocol")
        self.pid = int(_json(first[1])["pid"])

    def write(self, data: bytes) -> None:
        """Sends ``data`` to the command's stdin (in frames of at most 16 KiB)."""
        for start in range(0, len(data), DATA_CHUNK):
            self._send(encode(_STDIN, bytes(data[start : start + DATA_CHUNK])))

    def close_stdin(self) -> None:
        """Ends the command's stdin (end of file; on a terminal, ``^D``)."""
        self._send(encode(_STDIN_EOF))

    def signal(self, signo: int) -> None:
        """Sends signal ``signo`` to the command's process group."""
        self._send(encode(_SIGNAL, json.dumps({"signo": signo}).encode()))

    def resize(self, rows: int, cols: int) -> None:
        """Sets the terminal's size (with ``tty=True``)."""
        self._send(encode(_RESIZE, json.dumps({"rows": rows, "cols": cols}).encode()))

    def __iter__(self) -> Iterator[ExecEvent]:
        while True:
            frame = self._frame()
            if frame is None:
                raise ExecInterrupted(
                    "the attached exec ended before the command's exit status", code="interrupted"
                )
            kind, payload = frame
            if kind == _STDOUT:
                yield Stdout(payload)
            elif kind == _STDERR:
                yield Stderr(payload)
            elif kind == _EXIT:
                status = _json(payload)
                yield Exit(status.get("code"), status.get("signal"), bool(status.get("timed_out", False)))
                return
            elif kind == _ERROR:
                detail = _json(payload)
                raise stream_error(str(detail.get("code", "other")), str(detail.get("message", "")))
            else:
                raise ProtocolError(f"unexpected frame type {kind:#x} in an attached exec", code="protocol")

    def wait(
        self,
        on_stdout: Optional[Callable[[bytes], Any]] = None,
        on_stderr: Optional[Callable[[bytes], Any]] = None,
    ) -> ExecResult:
        """Reads the rest of the output (calling back with each piece) up to the exit."""
        result = collect(self, on_stdout, on_stderr)
        if result is None:
            raise ProtocolError("an attached exec ended without an exit event", code="protocol")
        return result


    def close(self) -> None:
        """Closes the connection."""
        self._reader.close()
        self._sock.close()

    def __enter__(self) -> "Attached":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, frame: bytes) -> None:
        with self._send_lock:
            try:
                self._sock.sendall(frame)
            except OSError as err:
                raise ExecInterrupted(f"the attached exec's connection broke: {err}", code="interrupted") from err

    def _frame(self) -> Optional[Tuple[int, bytes]]:
        """The next frame, or None at a clean end of the stream (between frames)."""
        try:
            head = self._reader.read(5)
            if not head:
                return None
            if len(head) < 5:
                raise ProtocolError("an attached exec's stream ended inside a frame", code="protocol")
            length, kind = struct.unpack("<IB", head)
            if not 1 <= length <= MAX_FRAME + 1:
                raise ProtocolError(f"an attached exec sent a frame of {length} bytes", code="protocol")
            payload = self._reader.read(length - 1)
        except OSError as err:
            raise ExecInterrupted(f"the attached exec's connection broke: {err}", code="interrupted") from err
        if len(payload) < length - 1:
            raise ProtocolError("an attached exec's stream ended inside a frame", code="protocol")
        return kind, payload


def _json(payload: bytes) -> Dict[str, Any]:
    try:
        doc = json.loads(payload)
    except ValueError as err:
        raise ProtocolError(f"an attached exec sent invalid JSON: {err}", code="protocol") from err
    if not isinstance(doc, dict):
        raise ProtocolError("an attached exec sent JSON that is not an object", code="protocol")
    return doc


def collect(
    events: Iterable[ExecEvent],
    on_stdout: Optional[Callable[[bytes], Any]] = None,
    on_stderr: Optional[Callable[[bytes], Any]] = None,
) -> Optional[ExecResult]:
    """Gathers an exec's events into its result, calling back with each piece of output as it
    comes; None when the events end without an exit."""
    out: List[bytes] = []
    err: List[bytes] = []
    for event in events:
        if isinstance(event, Stdout):
            out.append(event.data)
            if on_stdout is not None:
                on_stdout(event.data)
        elif isinstance(event, Stderr):
            err.append(event.data)
            if on_stderr is not None:
                on_stderr(event.data)
        else:
            return ExecResult(event.exit_code, b"".join(out), b"".join(err), event.signal, event.timed_out)
    return None
