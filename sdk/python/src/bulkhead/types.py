"""The documents of the bulkheadd API as dataclasses (docs/daemon.md, "API"; the daemon serves
the full schema at ``GET /openapi.json``)."""

from __future__ import annotations

import base64
import binascii
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

from .errors import ProtocolError


@dataclass(frozen=True)
class Workspace:
    """A host project directory shared at the guest's ``/workspace`` (``workspace`` of a create).

    Attributes:
        path: Host path, inside one of the daemon's ``mount_roots``; a relative one is made
            absolute against the current directory when the request is sent, as the CLI does.
        mode: ``"direct"`` (read-write: changes reach the host at once) or ``"clone"``
            (read-only under a private overlay: see :meth:`Sandbox.diff` and
            :meth:`Sandbox.export`).
    """

    path: str
    mode: str = "direct"

    def to_json(self) -> Dict[str, Any]:
        """The API's ``WorkspaceSpec``."""
        return {"path": os.path.abspath(self.path), "mode": self.mode}


@dataclass(frozen=True)
class Mount:
    """A host directory shared at a guest path (one of ``mounts`` of a create).

    Attributes:
        host: Host path of a directory, inside one of the daemon's ``mount_roots`` (a relative
            one is made absolute against the current directory).
        guest: Absolute guest path (not ``/``).
        ro: Read-only, enforced by the VMM's file server.
    """

    host: str
    guest: str
    ro: bool = False

    def to_json(self) -> Dict[str, Any]:
        """The API's ``MountSpec``."""
        return {"host": os.path.abspath(self.host), "guest": self.guest, "ro": self.ro}


@dataclass(frozen=True)
class Network:
    """A sandbox's network (docs/network.md): every connection leaves through the host's egress
    proxy. Without one (``network=None``) a sandbox has no network at all.

    Attributes:
        mode: ``"allowlist"`` (only what the rules name; the daemon's default), ``"allow-all"``
            (any public address) or ``"none"``.
        allow: Allow rules ``HOST[:PORT]`` (``*.example.com``; ports 80 and 443 by default) or
            presets ``@NAME`` (``@pypi``).
        deny: Deny rules ``HOST[:PORT]`` or CIDRs; they beat allow rules.
        allow_cidr: Allow rules for raw IP addresses, ``CIDR[:PORT]``.
        rules: Rules with methods and path prefixes, as the API's ``NetworkRule`` objects
            (``{"host", "action", "methods", "paths"}``).
        secrets: Secrets of the daemon's ``[secrets]`` to inject, as ``{"name", "hosts"}``.
        hosts: Names the proxy resolves to these IP addresses.
    """

    mode: Optional[str] = None
    allow: Sequence[str] = ()
    deny: Sequence[str] = ()
    allow_cidr: Sequence[str] = ()
    rules: Sequence[Mapping[str, Any]] = ()
    secrets: Sequence[Mapping[str, Any]] = ()
    hosts: Mapping[str, Sequence[str]] = field(default_factory=dict)

    def to_json(self) -> Dict[str, Any]:
        """The API's ``NetworkRequest``."""
        doc: Dict[str, Any] = {
            "allow": list(self.allow),
            "deny": list(self.deny),
            "allow_cidr": list(self.allow_cidr),
            "rules": [dict(r) for r in self.rules],
            "secrets": [dict(s) for s in self.secrets],
            "hosts": {k: list(v) for k, v in self.hosts.items()},
        }
        if self.mode is not None:
            doc["mode"] = self.mode
        return doc


@dataclass(frozen=True)
class Failure:
    """Why a sandbox failed (``failure`` of a sandbox in state ``failed``).

    Attributes:
        reason: Short reason (``guest_shutdown``, ``guest_crash``, ``vmm_error``, ``killed``, ...).
        message: Human-readable detail.
        log_tail: The last lines of the VMM's output and the guest's console.
    """

    reason: str
    message: str
    log_tail: str


@dataclass(frozen=True)
class SandboxInfo:
    """A sandbox as the daemon reports it (the API's ``SandboxInfo``).

    Attributes:
        id: 12 lowercase hex digits.
        state: ``creating``, ``running``, ``pausing``, ``paused``, ``resuming``, ``failed`` or
            ``destroying``.
        created_at: Creation time, RFC 3339 UTC.
        expires_at: When the TTL destroys it (RFC 3339 UTC), or None.
        vcpus: vCPUs.
        memory_mib: Guest RAM, MiB.
        image: Root filesystem image name, or None (the initramfs).
        labels: Labels given at creation.
        hostname: The guest's hostname.
        vmm_pid: Host process ID of the VMM while it runs.
        failure: Set in state ``failed``.
        raw: The whole JSON document (workspace, mounts, network, limits, ...).
    """

    id: str
    state: str
    created_at: str
    expires_at: Optional[str]
    vcpus: int
    memory_mib: int
    image: Optional[str]
    labels: Dict[str, str]
    hostname: Optional[str]
    vmm_pid: Optional[int]
    failure: Optional[Failure]
    raw: Dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_json(cls, doc: Any) -> "SandboxInfo":
        """Parses the API's ``SandboxInfo`` document."""
        try:
            failure = doc.get("failure")
            return cls(
                id=str(doc["id"]),
                state=str(doc["state"]),
                created_at=str(doc["created_at"]),
                expires_at=doc.get("expires_at"),
                vcpus=int(doc["vcpus"]),
                memory_mib=int(doc["memory_mib"]),
                image=doc.get("image"),
                labels=dict(doc.get("labels") or {}),
                hostname=doc.get("hostname"),
                vmm_pid=doc.get("vmm_pid"),
                failure=Failure(**failure) if failure else None,
                raw=dict(doc),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ProtocolError(f"unexpected sandbox document: {err}", code="protocol") from err


@dataclass(frozen=True)
class ExecResult:
    """How a command ended and everything it wrote.

    Attributes:
        exit_code: Exit code (0-255) of a normal exit, None when a signal ended it.
        stdout: Everything the command wrote to stdout.
        stderr: Everything the command wrote to stderr.
        signal: Number of the signal that ended it, or None.
        timed_out: The ``timeout`` passed and the command's process group was killed.
    """

    exit_code: Optional[int]
    stdout: bytes
    stderr: bytes
    signal: Optional[int] = None
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        """Exit code 0 without a timeout."""
        return self.exit_code == 0 and not self.timed_out


@dataclass(frozen=True)
class Stdout:
    """Bytes the command wrote to stdout (an event of :meth:`Sandbox.exec_stream`)."""

    data: bytes


@dataclass(frozen=True)
class Stderr:
    """Bytes the command wrote to stderr (an event of :meth:`Sandbox.exec_stream`)."""

    data: bytes


@dataclass(frozen=True)
class Exit:
    """The command ended (the last event of :meth:`Sandbox.exec_stream`).

    Attributes:
        exit_code: Exit code of a normal exit, None when a signal ended it.
        signal: Number of the signal that ended it, or None.
        timed_out: The ``timeout`` passed and the process group was killed.
    """

    exit_code: Optional[int]
    signal: Optional[int] = None
    timed_out: bool = False


#: One event of an exec stream.
ExecEvent = Union[Stdout, Stderr, Exit]


def byte_string(value: Any) -> str:
    """An API byte string (a JSON string, or ``{"base64": ...}`` for bytes that are not UTF-8)
    as ``str``; bytes that are not UTF-8 are decoded as :func:`os.fsdecode` does (surrogate
    escapes), so :func:`os.fsencode` gives them back exactly."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("base64"), str):
        return os.fsdecode(base64.b64decode(value["base64"], validate=True))
    raise ValueError(f"not a byte string: {value!r}")


@dataclass(frozen=True)
class FileInfo:
    """A guest file (``sb.files.stat``, ``sb.files.list``); symlinks are not followed.

    Attributes:
        name: Last path component. Names that are not UTF-8 are decoded with surrogate escapes
            (``os.fsencode(name)`` gives the guest's bytes back).
        path: The whole guest path, as ``name``.
        type: ``"file"``, ``"dir"``, ``"symlink"`` or ``"other"``.
        size: Size in bytes (a symlink's: the length of its target).
        mode: Permission bits (``0o644``).
        mtime: Last modification, seconds since the Unix epoch.
        link_target: A symlink's target, as ``name``; None for other types.
    """

    name: str
    path: str
    type: str
    size: int
    mode: int
    mtime: int
    link_target: Optional[str] = None

    @classmethod
    def from_json(cls, doc: Any) -> "FileInfo":
        """Parses the API's ``FileInfo`` document."""
        try:
            target = doc.get("link_target")
            return cls(
                name=byte_string(doc["name"]),
                path=byte_string(doc["path"]),
                type=str(doc["type"]),
                size=int(doc["size"]),
                mode=int(doc["mode"]),
                mtime=int(doc["mtime"]),
                link_target=None if target is None else byte_string(target),
            )
        except (KeyError, TypeError, ValueError, AttributeError, binascii.Error) as err:
            raise ProtocolError(f"unexpected file document: {err}", code="protocol") from err


@dataclass(frozen=True)
class Change:
    """One changed path of a workspace.

    Attributes:
        path: Relative to the workspace root.
        status: ``"A"`` (added), ``"M"`` (modified) or ``"D"`` (deleted).
        kind: ``"file"``, ``"symlink"`` or ``"dir"``.
        flagged: The path runs code on the host implicitly (git hooks, Makefiles, CI, ...):
            review it before applying.
        reason: Why it is flagged.
    """

    path: str
    status: str
    kind: str
    flagged: bool = False
    reason: Optional[str] = None


@dataclass(frozen=True)
class SkippedPath:
    """An entry of the workspace that cannot be exported (needs review).

    Attributes:
        path: The path (invalid UTF-8 replaced by U+FFFD).
        reason: Why it was left out.
    """

    path: str
    reason: str


@dataclass(frozen=True)
class WorkspaceDiff:
    """What changed in a sandbox's workspace (the API's ``WorkspaceDiffInfo``).

    Attributes:
        mode: ``"direct"`` or ``"clone"``.
        path: The host directory.
        flagged_only: True for direct workspaces: only flagged paths are tracked.
        complete: False when a direct workspace's snapshot stopped at its entry limit.
        changes: Every change, sorted by path.
        skipped: Entries that cannot be exported.
    """

    mode: str
    path: str
    flagged_only: bool
    complete: bool
    changes: List[Change]
    skipped: List[SkippedPath]

    @classmethod
    def from_json(cls, doc: Any) -> "WorkspaceDiff":
        """Parses the API's ``WorkspaceDiffInfo`` document."""
        try:
            return cls(
                mode=str(doc["mode"]),
                path=str(doc["path"]),
                flagged_only=bool(doc["flagged_only"]),
                complete=bool(doc["complete"]),
                changes=[Change(**c) for c in doc["changes"]],
                skipped=[SkippedPath(**s) for s in doc["skipped"]],
            )
        except (KeyError, TypeError) as err:
            raise ProtocolError(f"unexpected workspace diff: {err}", code="protocol") from err


@dataclass(frozen=True)
class ExportReview:
    """What an export needs reviewed (the ``x-bulkhead-review`` header of an export).

    Attributes:
        flagged: Flagged changes (at most 200; the export's own header/manifest has them all).
        flagged_total: How many changes are flagged in all.
        skipped: Entries that could not be exported (at most 200).
        skipped_total: How many were skipped in all.
    """

    flagged: List[Change]
    flagged_total: int
    skipped: List[SkippedPath]
    skipped_total: int

    @classmethod
    def from_json(cls, doc: Any) -> "ExportReview":
        """Parses the API's ``ExportReview`` document."""
        try:
            return cls(
                flagged=[Change(**c) for c in doc["flagged"]],
                flagged_total=int(doc["flagged_total"]),
                skipped=[SkippedPath(**s) for s in doc["skipped"]],
                skipped_total=int(doc["skipped_total"]),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise ProtocolError(f"unexpected export review: {err}", code="protocol") from err
