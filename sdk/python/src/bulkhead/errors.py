"""Exceptions of the bulkhead SDK.

Every error the daemon answers with is ``{"error": {"code": ..., "message": ...}}`` and an HTTP
status (docs/daemon.md, "API"); :func:`error_for` maps it to one of the classes below, which all
derive from :class:`BulkheadError` and carry ``status``, ``code`` and ``message``.
"""

from __future__ import annotations

from typing import Optional


class BulkheadError(Exception):
    """Base class of every error the SDK raises.

    Attributes:
        status: The HTTP status of the daemon's answer (e.g. 404), or None when the error did not
            come from an HTTP answer (the socket could not be reached, an exec stream broke).
        code: The API's machine-readable code (``not_found``, ``invalid_request``, ...), or an
            SDK code such as ``daemon_unavailable``.
        message: The daemon's human-readable explanation.
    """

    def __init__(self, message: str, *, status: Optional[int] = None, code: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message

    def __str__(self) -> str:
        if self.status is None:
            return f"{self.message} ({self.code})" if self.code else self.message
        return f"{self.message} ({self.status} {self.code})"


class DaemonUnavailable(BulkheadError):
    """The daemon's socket is missing or refuses connections (is bulkheadd running?), or the
    connection broke before the answer was complete (code ``connection_lost``)."""


class ProtocolError(BulkheadError):
    """The daemon answered something this SDK cannot read (not the documented JSON)."""


class ExecInterrupted(BulkheadError):
    """An exec stream ended before the command's exit status (the daemon stopped, or the
    connection broke); the command may still have run."""


class InvalidRequest(BulkheadError):
    """400: the request was refused as invalid (a bad value, an unknown field, an ambiguous ID
    prefix, a guest path or argument the agent refused)."""


class PermissionDenied(BulkheadError):
    """403: the guest refused the access (``guest_denied``)."""


class NotFound(BulkheadError):
    """404: no such sandbox, guest file, image, kernel or template."""


class Conflict(BulkheadError):
    """409: the sandbox is not in a state for this (not running, no workspace, a direct
    workspace's export, not supported for this sandbox)."""


class TooLarge(BulkheadError):
    """413: a body, file, stdin or collected output larger than the daemon's limit."""


class InsufficientResources(BulkheadError):
    """422, 429, 507: not enough host memory, too many sandboxes, or the guest ran out of space
    or memory."""


class SandboxError(BulkheadError):
    """502, 504: the sandbox's VM or guest agent failed (``vm_exited``, ``agent_unreachable``,
    ``boot_timeout``, an invalid change set from the guest)."""


class ServerError(BulkheadError):
    """Any other 5xx: the daemon could not do it (``start_failed``, ``internal``,
    ``shutting_down``)."""


_BY_STATUS = {
    400: InvalidRequest,
    403: PermissionDenied,
    404: NotFound,
    409: Conflict,
    413: TooLarge,
    422: InsufficientResources,
    429: InsufficientResources,
    502: SandboxError,
    504: SandboxError,
    507: InsufficientResources,
}

# The status each code of an exec stream's `error` line stands for (the line has no status; the
# codes are those of the daemon's ApiError::from_agent).
_STREAM_CODES = {
    "not_found": 404,
    "guest_denied": 403,
    "guest_rejected": 400,
    "guest_exhausted": 507,
    "agent_protocol": 502,
    "agent_unreachable": 502,
    # The agent's own codes (docs/agent-protocol.md), in an attached exec's Error frame.
    "permission_denied": 403,
    "invalid_request": 400,
    "resource_exhausted": 507,
}


def error_for(status: int, code: str, message: str) -> BulkheadError:
    """The exception for an error answer with HTTP ``status`` and the API's ``code`` and
    ``message``."""
    cls = _BY_STATUS.get(status)
    if cls is None:
        cls = ServerError if status >= 500 else BulkheadError
    return cls(message, status=status, code=code)


def stream_error(code: str, message: str) -> BulkheadError:
    """The exception for an exec stream's ``{"error": {...}}`` line (the VM failed while the
    command ran)."""
    return error_for(_STREAM_CODES.get(code, 502), code, message)
