"""Python SDK of bulkhead: KVM microVM sandboxes for untrusted code, through ``bulkheadd``.

Standard library only: HTTP/1.1 + JSON over the daemon's Unix socket (``socket=``, else
``$BULKHEAD_SOCKET``, else ``/run/bulkhead/bulkheadd.sock``). See docs/sdk-python.md.

>>> from bulkhead import Sandbox
>>> with Sandbox.create(memory_mib=256) as sb:          # doctest: +SKIP
...     print(sb.exec(["uname", "-r"]).stdout.decode())
"""

from ._attach import Attached
from ._transport import DEFAULT_SOCKET, SOCKET_ENV
from .errors import (
    BulkheadError,
    Conflict,
    DaemonUnavailable,
    ExecInterrupted,
    InsufficientResources,
    InvalidRequest,
    NotFound,
    PermissionDenied,
    ProtocolError,
    SandboxError,
    ServerError,
    TooLarge,
)
from .sandbox import MAX_EXEC_STDIN_BYTES, Client, Files, Sandbox
from .types import (
    Change,
    ExecEvent,
    ExecResult,
    Exit,
    ExportReview,
    Failure,
    FileInfo,
    Mount,
    Network,
    SandboxInfo,
    SkippedPath,
    Stderr,
    Stdout,
    Workspace,
    WorkspaceDiff,
)

__version__ = "0.1.0"

__all__ = [
    "Attached",
    "DEFAULT_SOCKET",
    "MAX_EXEC_STDIN_BYTES",
    "SOCKET_ENV",
    "BulkheadError",
    "Change",
    "Client",
    "Conflict",
    "DaemonUnavailable",
    "ExecEvent",
    "ExecInterrupted",
    "ExecResult",
    "Exit",
    "ExportReview",
    "Failure",
    "FileInfo",
    "Files",
    "InsufficientResources",
    "InvalidRequest",
    "Mount",
    "Network",
    "NotFound",
    "PermissionDenied",
    "ProtocolError",
    "Sandbox",
    "SandboxError",
    "SandboxInfo",
    "ServerError",
    "SkippedPath",
    "Stderr",
    "Stdout",
    "TooLarge",
    "Workspace",
    "WorkspaceDiff",
]
