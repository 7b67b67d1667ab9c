"""Sandboxes of a bulkheadd daemon: create, run commands, move files, review a workspace, destroy."""

from __future__ import annotations

import base64
import json
import os
from typing import (
    IO,
    Any,
    Callable,
    Dict,
    Generator,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    Union,
)
from urllib.parse import quote, urlencode

from . import _attach, _ndjson
from ._attach import Attached
from ._transport import Response, Transport, socket_path
from .errors import DaemonUnavailable, ExecInterrupted, NotFound, ProtocolError, TooLarge
from .types import (
    ExecEvent,
    ExecResult,
    Exit,
    ExportReview,
    FileInfo,
    Mount,
    Network,
    SandboxInfo,
    Workspace,
    WorkspaceDiff,
)

#: Most bytes ``stdin=`` may carry (756 KiB): the daemon's 1 MiB JSON body limit, less room for
#: the rest of the request, after base64. Larger inputs go in as a file (``sb.files.write``).
MAX_EXEC_STDIN_BYTES = ((1 << 20) - (16 << 10)) // 4 * 3
#: Request header carrying a written file's permission bits (octal).
MODE_HEADER = "x-bulkhead-mode"
#: The error code of a guest path that does not exist (404) in the files API.
PATH_NOT_FOUND = "path_not_found"
#: Response header of an export carrying base64 of the review document.
REVIEW_HEADER = "x-bulkhead-review"

PathLike = Union[str, "os.PathLike[str]"]
#: A byte string of the API (argv entries, environment values, cwd): text, or bytes for values
#: that are not UTF-8 (Linux argv is bytes).
Bytes = Union[str, bytes]
Command = Union[str, bytes, Sequence[Bytes]]
Callback = Callable[[bytes], Any]


class Client:
    """A handle on one daemon: its socket (``socket``, else ``$BULKHEAD_SOCKET``, else
    ``/run/bulkhead/bulkheadd.sock``). Cheap; every call opens its own connection."""

    def __init__(self, socket: Optional[PathLike] = None, *, timeout: Optional[float] = None) -> None:
        #: The transport (socket path and timeout).
        self.transport = Transport(socket_path(socket), timeout)

    @property
    def socket(self) -> str:
        """The daemon's socket path."""
        return self.transport.path

    def health(self) -> Dict[str, Any]:
        """``GET /healthz``: ``{"status": "ok", "version", "sandboxes", ...}``."""
        doc = self.transport.request("GET", "/healthz").json()
        if not isinstance(doc, dict):
            raise ProtocolError("the health document is not a JSON object", code="protocol")
        return doc

    def create(self, **kwargs: Any) -> "Sandbox":
        """Creates a sandbox; the keyword arguments are :meth:`Sandbox.create`'s."""
        return Sandbox.create(client=self, **kwargs)

    def list(self, labels: Optional[Mapping[str, str]] = None) -> List["Sandbox"]:
        """The daemon's sandboxes, oldest first; with ``labels`` only those with every one."""
        query = urlencode([("label", f"{k}={v}") for k, v in (labels or {}).items()])
        target = "/v1/sandboxes" + (f"?{query}" if query else "")
        docs = self.transport.request("GET", target).json()
        if not isinstance(docs, list):
            raise ProtocolError("the sandbox list is not a JSON array", code="protocol")
        return [Sandbox(SandboxInfo.from_json(d), self) for d in docs]

    def get(self, sandbox_id: str) -> "Sandbox":
        """The sandbox ``sandbox_id`` (its ID or a unique prefix); raises
        :class:`~bulkhead.errors.NotFound` when there is none."""
        return Sandbox(self._info(sandbox_id), self)

    def _info(self, sandbox_id: str) -> SandboxInfo:
        doc = self.transport.request("GET", _sandbox_path(sandbox_id)).json()
        return SandboxInfo.from_json(doc)


class Sandbox:
    """One sandbox (a KVM microVM kept by the daemon). ``with Sandbox.create(...) as sb:``
    destroys it when the block ends, also on an exception."""

    def __init__(self, info: SandboxInfo, client: Client) -> None:
        #: The sandbox as last reported by the daemon (see :meth:`refresh`).
        self.info = info
        #: The client of its daemon.
        self.client = client
        #: Its guest files.
        self.files = Files(self)

    @property
    def id(self) -> str:
        """The sandbox's ID (12 hex digits)."""
        return self.info.id

    def __repr__(self) -> str:
        return f"Sandbox(id={self.id!r}, state={self.info.state!r})"

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()

    @classmethod
    def create(
        cls,
        *,
        memory_mib: Optional[int] = None,
        vcpus: Optional[int] = None,
        image: Optional[str] = None,
        disk_mib: Optional[int] = None,
        workspace: Union[Workspace, PathLike, None] = None,
        mounts: Sequence[Mount] = (),
        env: Optional[Mapping[str, str]] = None,
        ttl: Optional[int] = None,
        network: Optional[Network] = None,
        labels: Optional[Mapping[str, str]] = None,
        cpu_quota: Optional[float] = None,
        pids_max: Optional[int] = None,
        kernel: Optional[str] = None,
        hostname: Optional[str] = None,
        workdir: Optional[str] = None,
        user: Optional[str] = None,
        template: Optional[str] = None,
        socket: Optional[PathLike] = None,
        client: Optional[Client] = None,
    ) -> "Sandbox":
        """Boots a sandbox and returns once its guest agent is ready (``POST /v1/sandboxes``).

        Args:
            memory_mib: Guest RAM, MiB (daemon default 256, at least 16).
            vcpus: vCPUs (default 1).
            image: A root filesystem image of the daemon's store (``bulkhead image ls``); None:
                the busybox initramfs.
            disk_mib: Scratch disk for the image's writable layer, MiB (needs ``image``).
            workspace: A host directory shared at ``/workspace``: a path (direct mode) or a
                :class:`Workspace` (``mode="clone"`` for a private copy to diff and export).
            mounts: More host directories, each a :class:`Mount`.
            env: Environment every command starts with.
            ttl: Seconds after which the daemon destroys the sandbox.
            network: The sandbox's network; None: none at all.
            labels: Free-form labels (``Sandbox.list(labels=...)`` filters on them).
            cpu_quota: Host CPU time the VM may use, in CPUs (0.5 = half a CPU).
            pids_max: Most host tasks of the VMM process.
            kernel: Name of a kernel of the daemon's kernels directory.
            hostname: The guest's hostname (default ``bh-<id>``).
            workdir: Working directory of every exec that gives none.
            user: Guest user of every exec that gives none (name, uid or uid:gid).
            template: Restore this template of the daemon instead of booting.
            socket: The daemon's socket (when no ``client`` is given).
            client: The daemon's client.

        Raises:
            InvalidRequest: A value out of range, a share outside the daemon's mount roots, ...
            NotFound: An unknown image, kernel or template.
            SandboxError: The VM did not come up (``vm_exited``, ``boot_timeout``).
        """
        client = client or Client(socket)
        body: Dict[str, Any] = {}
        for key, value in (
            ("memory_mib", memory_mib),
            ("vcpus", vcpus),
            ("image", image),
            ("disk_mib", disk_mib),
            ("ttl_s", ttl),
            ("cpu_quota", cpu_quota),
            ("pids_max", pids_max),
            ("kernel", kernel),
            ("hostname", hostname),
            ("workdir", workdir),
            ("user", user),
            ("template", template),
        ):
            if value is not None:
                body[key] = value
        if env:
            body["env"] = dict(env)
        if labels:
            body["labels"] = dict(labels)
        if workspace is not None:
            if not isinstance(workspace, Workspace):
                workspace = Workspace(os.fspath(workspace))
            body["workspace"] = workspace.to_json()
        if mounts:
            body["mounts"] = [m.to_json() for m in mounts]
        if network is not None:
            body["network"] = network.to_json()
        doc = client.transport.request("POST", "/v1/sandboxes", json_body=body).json()
        return cls(SandboxInfo.from_json(doc), client)

    @classmethod
    def list(
        cls,
        labels: Optional[Mapping[str, str]] = None,
        *,
        socket: Optional[PathLike] = None,
        client: Optional[Client] = None,
    ) -> List["Sandbox"]:
        """The daemon's sandboxes, oldest first; with ``labels`` only those with every one."""
        return (client or Client(socket)).list(labels)

    @classmethod
    def get(
        cls,
        sandbox_id: str,
        *,
        socket: Optional[PathLike] = None,
        client: Optional[Client] = None,
    ) -> "Sandbox":
        """The sandbox ``sandbox_id`` (its ID or a unique prefix); raises
        :class:`~bulkhead.errors.NotFound` when there is none."""
        return (client or Client(socket)).get(sandbox_id)

    def refresh(self) -> SandboxInfo:
        """Asks the daemon for the sandbox's current state; updates and returns :attr:`info`."""
        self.info = self.client._info(self.id)
        return self.info

    def exec(
        self,
        cmd: Command,
        *,
        stdin: Union[bytes, str, None] = None,
        env: Optional[Mapping[str, Bytes]] = None,
        cwd: Optional[Bytes] = None,
        user: Optional[str] = None,
        timeout: Optional[float] = None,
        on_stdout: Optional[Callback] = None,
        on_stderr: Optional[Callback] = None,
    ) -> ExecResult:
        """Runs a command and waits for its end; returns its exit status and all its output.

        Args:
            cmd: The program and its arguments (``["ls", "-l"]``; ``argv[0]`` is looked up in
                ``PATH``), or a string run by ``sh -c``. Each entry is text or bytes (for
                arguments that are not UTF-8).
            stdin: Bytes (or text, as UTF-8) fed to stdin, then end of file; at most 756 KiB.
                None: stdin is ``/dev/null``.
            env: Environment added to the sandbox's (values text or bytes).
            cwd: Absolute working directory in the guest (text or bytes).
            user: Guest user: name, uid or uid:gid (default: the sandbox's, else root).
            timeout: Seconds after which the command's process group is killed
                (``ExecResult.timed_out``).
            on_stdout: Called with each piece of stdout as it arrives.
            on_stderr: Called with each piece of stderr as it arrives.

        A non-zero exit is a result, not an exception. Raises
        :class:`~bulkhead.errors.BulkheadError` subclasses: ``NotFound`` (no such sandbox),
        ``Conflict`` (not running), ``InvalidRequest``, ``SandboxError`` (the VM failed),
        ``ExecInterrupted`` (the daemon stopped mid-command).
        """
        stream = self.exec_stream(cmd, stdin=stdin, env=env, cwd=cwd, user=user, timeout=timeout)
        try:
            result = _attach.collect(stream, on_stdout, on_stderr)
        finally:
            stream.close()
        if result is None:
            raise ProtocolError("the exec stream ended without an exit event", code="protocol")
        return result

    def exec_stream(
        self,
        cmd: Command,
        *,
        stdin: Union[bytes, str, None] = None,
        env: Optional[Mapping[str, Bytes]] = None,
        cwd: Optional[Bytes] = None,
        user: Optional[str] = None,
        timeout: Optional[float] = None,
    ) -> Generator[ExecEvent, None, None]:
        """Runs a command and yields its output as it comes: :class:`~bulkhead.types.Stdout` and
        :class:`~bulkhead.types.Stderr` events, last an :class:`~bulkhead.types.Exit`. The
        arguments are :meth:`exec`'s. Leaving the loop early (or ``close()`` on the iterator)
        closes the connection, and the daemon kills the command."""
        spec = _exec_spec(cmd, stdin=stdin, env=env, cwd=cwd, user=user, timeout=timeout)
        response = self.client.transport.request(
            "POST", _sandbox_path(self.id) + "/exec", json_body=spec
        )
        try:
            yield from _ndjson.events(response.chunks())
        except DaemonUnavailable as err:
            raise ExecInterrupted(
                f"the exec stream broke before the command's exit status: {err.message}",
                code="interrupted",
            ) from err
        finally:
            response.close()

    def attach(
        self,
        cmd: Command,
        *,
        env: Optional[Mapping[str, Bytes]] = None,
        cwd: Optional[Bytes] = None,
        user: Optional[str] = None,
        timeout: Optional[float] = None,
        tty: bool = False,
        window: Optional[Tuple[int, int]] = None,
    ) -> Attached:
        """Starts a command with its stdin held open (``POST .../exec/attach``): feed it with
        ``write``/``close_stdin`` (no size limit), read its events by iterating or ``wait()``.
        ``tty=True`` runs it on a pseudo-terminal (one output stream, ``TERM=xterm``) of
        ``window`` = (rows, cols), default 24 × 80; ``resize`` changes it. The other arguments
        are :meth:`exec`'s."""
        spec = _exec_spec(cmd, stdin=None, env=env, cwd=cwd, user=user, timeout=timeout)
        if tty:
            spec["tty"] = True
        if window is not None:
            spec["window"] = {"rows": window[0], "cols": window[1]}
        sock = self.client.transport.connect()
        try:
            reader = _attach.upgrade(sock, _sandbox_path(self.id) + "/exec/attach", spec)
            return Attached(sock, reader)
        except BaseException:
            sock.close()
            raise

    def diff(self) -> WorkspaceDiff:
        """What changed in the sandbox's workspace: for a clone workspace every path the guest
        added, modified or deleted; for a direct one only the flagged paths. Raises
        :class:`~bulkhead.errors.Conflict` without a workspace."""
        doc = self.client.transport.request("GET", _sandbox_path(self.id) + "/workspace/diff").json()
        return WorkspaceDiff.from_json(doc)

    def export(self, dest: Union[PathLike, IO[bytes]], format: str = "patch") -> ExportReview:
        """Writes a clone workspace's changes to ``dest`` (a path or a binary file object) as a
        git patch (``format="patch"``, for ``git apply``) or a tar archive (``"tar"``), and
        returns what needs review (flagged and skipped paths)."""
        target = _sandbox_path(self.id) + "/workspace/export?" + urlencode({"format": format})
        with self.client.transport.request("GET", target) as response:
            review = _review(response.header(REVIEW_HEADER))
            if isinstance(dest, (str, os.PathLike)):
                with open(dest, "wb") as file:
                    _copy(response, file)
            else:
                _copy(response, dest)
        return review

    def logs(self, lines: int = 200) -> str:
        """The last ``lines`` lines of the VMM's output, which includes the guest's console."""
        target = _sandbox_path(self.id) + "/logs?" + urlencode({"lines": lines})
        return self.client.transport.request("GET", target).read().decode("utf-8", "replace")

    def pause(self) -> SandboxInfo:
        """Saves the VM to the daemon's state directory and stops it (``resume()`` continues it)."""
        self.info = SandboxInfo.from_json(
            self.client.transport.request("POST", _sandbox_path(self.id) + "/pause").json()
        )
        return self.info

    def resume(self) -> SandboxInfo:
        """Restores a paused sandbox where it was."""
        self.info = SandboxInfo.from_json(
            self.client.transport.request("POST", _sandbox_path(self.id) + "/resume").json()
        )
        return self.info

    def kill(self) -> None:
        """Destroys the sandbox: its VM, cgroup, files and record (``DELETE``). Idempotent:
        killing a sandbox that is already gone does nothing."""
        self.client.transport.request("DELETE", _sandbox_path(self.id)).read()


class Files:
    """A sandbox's guest files (``sb.files``), whole files streamed both ways."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sandbox = sandbox

    def write(self, path: str, data: Union[bytes, str], mode: int = 0o644) -> int:
        """Writes ``data`` (text as UTF-8) to the absolute guest ``path``, creating missing
        parent directories, with permission bits ``mode``; returns the bytes written."""
        body = data.encode() if isinstance(data, str) else bytes(data)
        answer = self._sandbox.client.transport.request(
            "PUT", self._target(path), body=body, headers={MODE_HEADER: format(mode, "o")}
        ).json()
        try:
            return int(answer["bytes"])
        except (KeyError, TypeError, ValueError) as err:
            raise ProtocolError(f"unexpected answer to a file write: {answer!r}", code="protocol") from err

    def read(self, path: str) -> bytes:
        """The contents of the guest file ``path``; raises
        :class:`~bulkhead.errors.NotFound` when it does not exist."""
        return self._sandbox.client.transport.request("GET", self._target(path)).read()

    def read_text(self, path: str, encoding: str = "utf-8") -> str:
        """The guest file ``path`` decoded as text."""
        return self.read(path).decode(encoding)

    def list(self, path: str) -> List[FileInfo]:
        """The entries of the guest directory ``path``, sorted by name (symlinks not
        followed); raises :class:`~bulkhead.errors.NotFound` (``path_not_found``) when it does
        not exist."""
        doc = self._request("GET", "/files/list", path).json()
        try:
            entries = doc["entries"]
        except (KeyError, TypeError) as err:
            raise ProtocolError(f"unexpected file list: {err}", code="protocol") from err
        return [FileInfo.from_json(e) for e in entries]

    def stat(self, path: str) -> FileInfo:
        """The guest path itself (a symlink is not followed); raises
        :class:`~bulkhead.errors.NotFound` (``path_not_found``) when it does not exist."""
        return FileInfo.from_json(self._request("GET", "/files/stat", path).json())

    def exists(self, path: str) -> bool:
        """Whether the guest path exists (a dangling symlink does). A missing sandbox still
        raises :class:`~bulkhead.errors.NotFound`."""
        try:
            self.stat(path)
        except NotFound as err:
            if err.code == PATH_NOT_FOUND:
                return False
            raise
        return True

    def make_dir(self, path: str, parents: bool = False) -> None:
        """Creates the guest directory ``path``; with ``parents``, missing parents too, and an
        existing directory is no error."""
        self._request("POST", "/files/mkdir", path, parents=parents).read()

    def remove(self, path: str, recursive: bool = False) -> None:
        """Removes the guest path (a symlink itself, never its target); a directory that is not
        empty needs ``recursive``."""
        self._request("DELETE", "/files", path, recursive=recursive).read()

    def _request(self, method: str, suffix: str, path: str, **flags: bool) -> Response:
        query = {"path": os.fsencode(path), **{k: b"true" for k, v in flags.items() if v}}
        target = _sandbox_path(self._sandbox.id) + suffix + "?" + urlencode(query)
        return self._sandbox.client.transport.request(method, target)

    def _target(self, path: str) -> str:
        return _sandbox_path(self._sandbox.id) + "/files?" + urlencode({"path": os.fsencode(path)})


def _sandbox_path(sandbox_id: str) -> str:
    if not sandbox_id:
        raise NotFound("a sandbox ID must not be empty", code="not_found")
    return "/v1/sandboxes/" + quote(sandbox_id, safe="")


def _exec_spec(
    cmd: Command,
    *,
    stdin: Union[bytes, str, None],
    env: Optional[Mapping[str, Bytes]],
    cwd: Optional[Bytes],
    user: Optional[str],
    timeout: Optional[float],
) -> Dict[str, Any]:
    """The API's ``ExecSpec`` for these arguments."""
    argv = ["sh", "-c", cmd] if isinstance(cmd, (str, bytes)) else list(cmd)
    spec: Dict[str, Any] = {"argv": [_byte_string(a) for a in argv]}
    if env:
        spec["env"] = {k: _byte_string(v) for k, v in env.items()}
    if cwd is not None:
        spec["cwd"] = _byte_string(cwd)
    if user is not None:
        spec["user"] = user
    if timeout is not None:
        spec["timeout_s"] = float(timeout)
    if stdin is not None:
        data = stdin.encode() if isinstance(stdin, str) else bytes(stdin)
        if len(data) > MAX_EXEC_STDIN_BYTES:
            raise TooLarge(
                f"stdin of {len(data)} bytes is more than the {MAX_EXEC_STDIN_BYTES} an exec "
                "may carry: write it to a file with sb.files.write instead",
                code="payload_too_large",
            )
        spec["stdin"] = base64.b64encode(data).decode()
    return spec


def _byte_string(value: Bytes) -> Union[str, Dict[str, str]]:
    """The API's byte string: a JSON string for text (and for bytes that are valid UTF-8), else
    ``{"base64": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            return {"base64": base64.b64encode(value).decode()}
    raise TypeError(f"expected str or bytes, got {type(value).__name__}")


def _review(header: Optional[str]) -> ExportReview:
    if header is None:
        raise ProtocolError(f"the export has no {REVIEW_HEADER} header", code="protocol")
    try:
        doc = json.loads(base64.b64decode(header))
    except ValueError as err:
        raise ProtocolError(f"unreadable {REVIEW_HEADER} header: {err}", code="protocol") from err
    return ExportReview.from_json(doc)


def _copy(response: Any, file: IO[bytes]) -> None:
    for piece in response.chunks():
        file.write(piece)


__all__ = ["Client", "Files", "Sandbox", "MAX_EXEC_STDIN_BYTES"]
