"""Integration tests of the SDK against a real bulkheadd that boots real VMs.

Not part of the unit tests (``test_*.py``): run by ``crates/daemon/tests/guest.rs``
(``the_python_sdk_passes_its_integration_tests_against_real_vms``), which starts the daemon (in
the nested test host where this machine's KVM cannot boot guests) and runs
``python3 -m unittest tests.integration_real`` with:

- ``BULKHEAD_SOCKET``: the daemon's socket;
- ``BULKHEAD_SDK_TEST_ROOT``: a directory inside the daemon's ``mount_roots``, for the workspace.

By hand: ``BULKHEAD_SOCKET=... BULKHEAD_SDK_TEST_ROOT=... PYTHONPATH=src:. python3 -m unittest
-v tests.integration_real`` in ``sdk/python``. Three sandboxes boot (64-128 MiB each); the
contract test checks what the SDK sends against the daemon's OpenAPI document.
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import tempfile
import unittest
from typing import Any, Callable, Dict, List, Set, Tuple

import bulkhead
from bulkhead import Sandbox, Workspace
from bulkhead._transport import Response, Transport

SOCKET_ENV = "BULKHEAD_SOCKET"
ROOT_ENV = "BULKHEAD_SDK_TEST_ROOT"
LABELS = {"suite": "python-sdk"}
#: Longest the whole suite may take, seconds: past it the stacks are printed and the process
#: exits (a hung guest fails the suite instead of stalling it).
SUITE_TIMEOUT_S = 270


def setUpModule() -> None:
    missing = [v for v in (SOCKET_ENV, ROOT_ENV) if not os.environ.get(v)]
    if missing:
        raise RuntimeError(
            f"set {' and '.join(missing)}: these tests need a running bulkheadd (its socket) and "
            "a directory inside its mount_roots; see this module's docstring"
        )
    faulthandler.dump_traceback_later(SUITE_TIMEOUT_S, exit=True)


def tearDownModule() -> None:
    faulthandler.cancel_dump_traceback_later()


class OneSandboxTest(unittest.TestCase):
    """Tests sharing one sandbox with a clone workspace of a small project."""

    sb: Sandbox
    project: str

    @classmethod
    def setUpClass(cls) -> None:
        cls.project = tempfile.mkdtemp(prefix="project-", dir=os.environ[ROOT_ENV])
        # A daemon running as root jails each VMM as an unprivileged user, which must read it.
        os.chmod(cls.project, 0o755)
        for name, text in (("README.txt", "original\n"), ("old.txt", "to be deleted\n")):
            with open(os.path.join(cls.project, name), "w") as f:
                f.write(text)
        cls.sb = Sandbox.create(memory_mib=128, workspace=Workspace(cls.project, mode="clone"), labels=LABELS)

    @classmethod
    def tearDownClass(cls) -> None:
        cls.sb.kill()
        shutil.rmtree(cls.project)

    def test_exec_calls_back_with_stdout_and_stderr_apart_and_returns_the_exit_code(self) -> None:
        # Arrange
        out: List[bytes] = []
        err: List[bytes] = []

        # Act
        result = self.sb.exec(
            ["sh", "-c", "echo to-out; echo to-err >&2; echo $GREETING; exit 7"],
            env={"GREETING": "hi"},
            on_stdout=out.append,
            on_stderr=err.append,
        )

        # Assert
        self.assertEqual(b"".join(out), b"to-out\nhi\n")
        self.assertEqual(b"".join(err), b"to-err\n")
        self.assertEqual((result.exit_code, result.signal, result.timed_out), (7, None, False))
        self.assertEqual((result.stdout, result.stderr), (b"to-out\nhi\n", b"to-err\n"))

    def test_arguments_and_environment_values_may_be_bytes_that_are_not_utf8(self) -> None:
        # Act
        result = self.sb.exec([b"printf", b"%s|%s", b"\xff\xfe", b"\xe9"])
        env = self.sb.exec(["sh", "-c", 'printf %s "$V"'], env={"V": b"\x80x"})

        # Assert
        self.assertEqual((result.exit_code, result.stdout), (0, b"\xff\xfe|\xe9"))
        self.assertEqual(env.stdout, b"\x80x")

    def test_an_attached_exec_streams_stdin_past_the_exec_limit_and_runs_on_a_terminal(self) -> None:
        # Arrange
        data = bytes(range(256)) * 8192  # 2 MiB, beyond an exec's 756 KiB stdin

        # Act
        with self.sb.attach(["wc", "-c"]) as att:
            att.write(data)
            att.close_stdin()
            counted = att.wait()
        with self.sb.attach(["sh", "-c", "test -t 0 && test -t 1 && echo on-a-tty"], tty=True) as term:
            shown = term.wait()

        # Assert
        self.assertEqual((counted.exit_code, counted.stdout.strip()), (0, str(len(data)).encode()))
        self.assertGreater(att.pid or 0, 0)
        self.assertEqual(shown.exit_code, 0)
        self.assertIn(b"on-a-tty", shown.stdout)

    def test_the_stream_form_feeds_stdin_and_ends_with_the_exit(self) -> None:
        # Act
        events = list(self.sb.exec_stream(["cat"], stdin=b"\x00bytes\xff"))

        # Assert
        data = b"".join(e.data for e in events if isinstance(e, bulkhead.Stdout))
        self.assertEqual(data, b"\x00bytes\xff")
        self.assertEqual(events[-1], bulkhead.Exit(0, None, False))

    def test_a_timeout_kills_the_command(self) -> None:
        # Act
        result = self.sb.exec(["sleep", "60"], timeout=1)

        # Assert
        self.assertTrue(result.timed_out)
        self.assertFalse(result.ok)

    def test_files_round_trip_with_their_mode(self) -> None:
        # Arrange
        data = bytes(range(256)) * 64

        # Act
        written = self.sb.files.write("/tmp/sdk/dir/data.bin", data, mode=0o600)
        back = self.sb.files.read("/tmp/sdk/dir/data.bin")
        mode = self.sb.exec(["stat", "-c", "%a", "/tmp/sdk/dir/data.bin"]).stdout

        # Assert
        self.assertEqual(written, len(data))
        self.assertEqual(back, data)
        self.assertEqual(mode, b"600\n")
        with self.assertRaises(bulkhead.NotFound):
            self.sb.files.read("/tmp/sdk/no-such-file")

    def test_directories_are_made_listed_and_removed(self) -> None:
        # Arrange
        self.sb.files.make_dir("/tmp/tree/sub", parents=True)
        self.sb.files.write("/tmp/tree/a.txt", b"abc", mode=0o640)
        self.sb.exec(["ln", "-s", "a.txt", "/tmp/tree/link"])

        # Act
        entries = self.sb.files.list("/tmp/tree")
        link = self.sb.files.stat("/tmp/tree/link")
        self.sb.files.remove("/tmp/tree", recursive=True)

        # Assert
        self.assertEqual(
            [(e.name, e.type) for e in entries], [("a.txt", "file"), ("link", "symlink"), ("sub", "dir")]
        )
        self.assertEqual((entries[0].size, entries[0].mode, entries[0].path), (3, 0o640, "/tmp/tree/a.txt"))
        self.assertEqual(link.link_target, "a.txt")
        self.assertFalse(self.sb.files.exists("/tmp/tree"))
        with self.assertRaises(bulkhead.NotFound) as caught:
            self.sb.files.list("/tmp/tree")
        self.assertEqual(caught.exception.code, "path_not_found")

    def test_the_clone_workspace_diff_and_patch_list_the_guests_changes_only(self) -> None:
        # Arrange
        script = "cd /workspace && echo changed > README.txt && echo new > added.txt && rm old.txt"
        self.assertEqual(self.sb.exec(script).exit_code, 0)

        # Act
        diff = self.sb.diff()
        with tempfile.TemporaryDirectory() as d:
            review = self.sb.export(os.path.join(d, "out.patch"))
            with open(os.path.join(d, "out.patch")) as f:
                patch = f.read()

        # Assert
        self.assertEqual((diff.mode, diff.path), ("clone", self.project))
        self.assertEqual(
            [(c.path, c.status, c.kind) for c in diff.changes],
            [("README.txt", "M", "file"), ("added.txt", "A", "file"), ("old.txt", "D", "file")],
        )
        self.assertIn("+changed", patch)
        self.assertIn("added.txt", patch)
        self.assertEqual(review.flagged_total, 0)
        with open(os.path.join(self.project, "README.txt")) as f:
            self.assertEqual(f.read(), "original\n")

    def test_list_finds_it_by_label(self) -> None:
        # Act
        found = Sandbox.list(labels=LABELS)

        # Assert
        self.assertIn(self.sb.id, [s.id for s in found])
        self.assertEqual(Sandbox.get(self.sb.id).info.state, "running")

    def test_a_bad_request_is_invalid_request(self) -> None:
        # Act
        with self.assertRaises(bulkhead.InvalidRequest) as caught:
            Sandbox.create(memory_mib=0)

        # Assert
        self.assertEqual((caught.exception.status, caught.exception.code), (400, "invalid_request"))
        self.assertIn("memory_mib", caught.exception.message)

    def test_a_missing_sandbox_is_not_found(self) -> None:
        # Arrange
        ghost = Sandbox(bulkhead.SandboxInfo.from_json(dict(self.sb.info.raw, id="0" * 12)), self.sb.client)

        # Act / Assert
        with self.assertRaises(bulkhead.NotFound) as caught:
            Sandbox.get("0" * 12)
        self.assertEqual((caught.exception.status, caught.exception.code), (404, "not_found"))
        with self.assertRaises(bulkhead.NotFound):
            ghost.exec(["true"])


class _Recorded(Exception):
    """Raised by :class:`_RecordingTransport` in place of sending a request."""


class _RecordingTransport(Transport):
    """Records the JSON bodies the SDK would send, and sends nothing."""

    def __init__(self) -> None:
        super().__init__("/nonexistent")
        self.sent: List[Tuple[str, str, Any]] = []

    def request(self, method: str, target: str, **kwargs: Any) -> Response:
        self.sent.append((method, target, kwargs.get("json_body")))
        raise _Recorded()


class ContractTest(unittest.TestCase):
    """What the SDK sends matches the daemon's own OpenAPI document (no VM)."""

    def test_every_field_and_route_the_sdk_uses_is_in_the_daemons_openapi_document(self) -> None:
        # Arrange
        doc = bulkhead.Client().transport.request("GET", "/openapi.json").json()
        schemas = doc["components"]["schemas"]
        recorder = bulkhead.Client()
        transport = _RecordingTransport()
        recorder.transport = transport
        network = bulkhead.Network(
            mode="allowlist", allow=["a.example"], deny=["b.example"], allow_cidr=["10.0.0.0/8"],
            rules=[], secrets=[], hosts={"a.example": ["10.0.0.1"]},
        )
        everything: Dict[str, Any] = dict(
            memory_mib=64, vcpus=1, image="debian", disk_mib=64, workspace=Workspace("/p", "clone"),
            mounts=[bulkhead.Mount("/d", "/d", ro=True)], env={"A": "1"}, ttl=60, network=network,
            labels={"a": "b"}, cpu_quota=0.5, pids_max=64, kernel="k", hostname="h", workdir="/",
            user="root", template="t",
        )
        sb = Sandbox(bulkhead.SandboxInfo.from_json({"id": "0" * 12, "state": "running", "created_at": "",
                                                     "vcpus": 1, "memory_mib": 64}), recorder)

        # Act
        calls: List[Callable[[], object]] = [
            lambda: Sandbox.create(client=recorder, **everything),
            lambda: sb.exec(["true"], stdin=b"x", env={"A": b"\xff"}, cwd="/", user="root", timeout=1),
            lambda: sb.files.write("/x", b""),
            lambda: sb.files.read("/x"),
            lambda: sb.diff(),
            lambda: sb.export("/dev/null"),
            lambda: sb.logs(),
            lambda: sb.pause(),
            lambda: sb.resume(),
            lambda: sb.kill(),
            lambda: Sandbox.list(client=recorder),
        ]
        for call in calls:
            with self.assertRaises(_Recorded):
                call()
        sent = transport.sent

        # Assert
        def keys(name: str) -> Set[str]:
            return set(schemas[name]["properties"])

        create = sent[0][2]
        self.assertEqual(set(create), keys("CreateSandbox"))  # every field, and only those
        self.assertLessEqual(set(create["workspace"]), keys("WorkspaceSpec"))
        self.assertLessEqual(set(create["mounts"][0]), keys("MountSpec"))
        self.assertLessEqual(set(create["network"]), keys("NetworkRequest"))
        self.assertLessEqual(set(sent[1][2]), keys("ExecSpec"))
        for method, target, _ in sent:
            path = target.split("?", 1)[0].replace("0" * 12, "{id}")
            self.assertIn(method.lower(), doc["paths"].get(path, {}), f"{method} {path}")


class LifecycleTest(unittest.TestCase):
    def test_kill_destroys_the_sandbox(self) -> None:
        # Arrange
        sb = Sandbox.create(memory_mib=64)

        # Act
        sb.kill()

        # Assert
        self.assertNotIn(sb.id, [s.id for s in Sandbox.list()])
        with self.assertRaises(bulkhead.NotFound):
            sb.exec(["true"])
        sb.kill()  # idempotent

    def test_the_context_manager_destroys_the_sandbox_on_exit(self) -> None:
        # Act
        with Sandbox.create(memory_mib=64) as sb:
            said = sb.exec(["echo", "inside"]).stdout
            listed = [s.id for s in Sandbox.list()]

        # Assert
        self.assertEqual(said, b"inside\n")
        self.assertIn(sb.id, listed)
        with self.assertRaises(bulkhead.NotFound):
            sb.refresh()


if __name__ == "__main__":
    unittest.main()
