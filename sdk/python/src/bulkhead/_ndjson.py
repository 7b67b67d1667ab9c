"""The NDJSON stream of ``POST /v1/sandboxes/{id}/exec``: one JSON object per line, exactly one
key each: ``{"stdout": base64}``, ``{"stderr": base64}``, and last ``{"exit": {code, signal,
timed_out}}`` or ``{"error": {code, message}}``."""

from __future__ import annotations

import base64
import binascii
import json
from typing import Iterable, Iterator

from .errors import ExecInterrupted, ProtocolError, stream_error
from .types import ExecEvent, Exit, Stderr, Stdout

#: Longest line accepted, bytes: an output line carries at most a few KiB of base64; anything
#: this long is not the daemon's stream.
MAX_LINE_BYTES = 16 << 20


def lines(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """The lines of a byte stream that arrives in arbitrary pieces (a line may be split across
    pieces, a piece may hold several lines); a last line without a newline is yielded too."""
    pending = bytearray()
    for chunk in chunks:
        pending += chunk
        while True:
            end = pending.find(b"\n")
            if end < 0:
                break
            line = bytes(pending[:end])
            del pending[: end + 1]
            if line.strip():
                yield line
        if len(pending) > MAX_LINE_BYTES:
            raise ProtocolError(
                f"an exec stream line is longer than {MAX_LINE_BYTES} bytes", code="protocol"
            )
    if pending.strip():
        yield bytes(pending)


def events(chunks: Iterable[bytes]) -> Iterator[ExecEvent]:
    """The exec events of a byte stream, ending with :class:`~bulkhead.types.Exit`.

    Raises:
        BulkheadError: For an ``error`` line (the class of its code; the VM failed meanwhile).
        ExecInterrupted: When the stream ends before the exit status.
        ProtocolError: For a line that is not one of the documented objects.
    """
    for line in lines(chunks):
        event = parse_line(line)
        yield event
        if isinstance(event, Exit):
            return
    raise ExecInterrupted(
        "the exec stream ended before the command's exit status (did bulkheadd stop?)",
        code="interrupted",
    )


def parse_line(line: bytes) -> ExecEvent:
    """One line of the stream as an event; raises the stream's error for an ``error`` line."""
    try:
        doc = json.loads(line)
        if not isinstance(doc, dict) or len(doc) != 1:
            raise ValueError("expected an object with exactly one key")
        (key, value), = doc.items()
        if key == "stdout":
            return Stdout(base64.b64decode(value, validate=True))
        if key == "stderr":
            return Stderr(base64.b64decode(value, validate=True))
        if key == "exit":
            return Exit(
                exit_code=value.get("code"),
                signal=value.get("signal"),
                timed_out=bool(value.get("timed_out", False)),
            )
        if key != "error":
            raise ValueError(f"unknown key {key!r}")
        failure = stream_error(str(value["code"]), str(value["message"]))
    except (ValueError, KeyError, TypeError, AttributeError, binascii.Error) as err:
        shown = line[:200].decode("utf-8", "replace")
        raise ProtocolError(f"unexpected exec stream line {shown!r}: {err}", code="protocol") from err
    raise failure
