"""Unit tests of the SDK against a fake daemon on a Unix socket (no VM, no bulkheadd)."""

from __future__ import annotations

import base64
import io
import json
import os
import struct
import tempfile
import unittest
from typing import BinaryIO, List, Tuple
from unittest import mock

import bulkhead
from bulkhead import _ndjson
from bulkhead import Sandbox, Workspace, Mount

from .fake_daemon import Answer, FakeDaemon, error_answer, json_answer, sandbox_doc

SB = "3fa8c01d92be"
SB_PATH = f"/v1/sandboxes/{SB}"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def ndjson(*docs: object) -> bytes:
    return b"".join(json.dumps(d).encode() + b"\n" for d in docs)


class DaemonTest(unittest.TestCase):
    """Starts a fake daemon per test; ``self.sb`` is a sandbox object of it."""

    def setUp(self) -> None:
        self.daemon = FakeDaemon().__enter__()
        self.addCleanup(self.daemon.__exit__, None, None, None)
        self.client = bulkhead.Client(self.daemon.socket)
        self.daemon.route("GET", SB_PATH, json_answer(200, sandbox_doc(SB)))
        self.sb = self.client.get(SB)
        self.daemon.requests.clear()


class CreateAndListTest(DaemonTest):
    def test_create_sends_only_the_given_fields_with_the_api_names(self) -> None:
        # Arrange
        self.daemon.route("POST", "/v1/sandboxes", json_answer(201, sandbox_doc(SB)))

        # Act
        sb = Sandbox.create(
            memory_mib=512,
            vcpus=2,
            ttl=60,
            env={"A": "1"},
            workspace=Workspace("/src/project", mode="clone"),
            mounts=[Mount("/data", "/data", ro=True)],
            network=bulkhead.Network(allow=["@pypi"]),
            client=self.client,
        )

        # Assert
        self.assertEqual(sb.id, SB)
        self.assertEqual(sb.info.state, "running")
        self.assertEqual(sb.info.labels, {"team": "a"})
        self.assertEqual(sb.info.raw["limits"]["pids_max"], 64)
        sent = json.loads(self.daemon.requests[0].body)
        self.assertEqual(
            sent,
            {
                "memory_mib": 512,
                "vcpus": 2,
                "ttl_s": 60,
                "env": {"A": "1"},
                "workspace": {"path": "/src/project", "mode": "clone"},
                "mounts": [{"host": "/data", "guest": "/data", "ro": True}],
                "network": {
                    "allow": ["@pypi"],
                    "deny": [],
                    "allow_cidr": [],
                    "rules": [],
                    "secrets": [],
                    "hosts": {},
                },
            },
        )

    def test_a_workspace_given_as_a_path_is_a_direct_workspace_and_defaults_are_the_daemons(self) -> None:
        # Arrange
        self.daemon.route("POST", "/v1/sandboxes", json_answer(201, sandbox_doc(SB)))

        # Act
        Sandbox.create(workspace="/src/p", client=self.client)
        Sandbox.create(client=self.client)

        # Assert
        self.assertEqual(
            json.loads(self.daemon.requests[0].body), {"workspace": {"path": "/src/p", "mode": "direct"}}
        )
        self.assertEqual(json.loads(self.daemon.requests[1].body), {})

    def test_relative_host_paths_are_made_absolute_against_the_current_directory(self) -> None:
        # Arrange
        self.daemon.route("POST", "/v1/sandboxes", json_answer(201, sandbox_doc(SB)))

        # Act
        Sandbox.create(workspace=Workspace("proj", "clone"), mounts=[Mount("data", "/data")], client=self.client)

        # Assert
        sent = json.loads(self.daemon.requests[0].body)
        self.assertEqual(sent["workspace"]["path"], os.path.join(os.getcwd(), "proj"))
        self.assertEqual(sent["mounts"][0]["host"], os.path.join(os.getcwd(), "data"))

    def test_list_filters_by_labels_and_returns_sandboxes(self) -> None:
        # Arrange
        docs = "[%s, %s]" % (sandbox_doc("aaaaaaaaaaaa"), sandbox_doc("bbbbbbbbbbbb", "paused"))
        self.daemon.route("GET", "/v1/sandboxes", json_answer(200, docs))

        # Act
        found = Sandbox.list(labels={"team": "a b"}, socket=self.daemon.socket)

        # Assert
        self.assertEqual([(s.id, s.info.state) for s in found], [("aaaaaaaaaaaa", "running"), ("bbbbbbbbbbbb", "paused")])
        self.assertEqual(self.daemon.requests[0].target, "/v1/sandboxes?label=team%3Da+b")

    def test_the_socket_comes_from_bulkhead_socket_when_none_is_given(self) -> None:
        # Arrange
        self.daemon.route("GET", "/v1/sandboxes", json_answer(200, "[]"))

        # Act
        with mock.patch.dict(os.environ, {"BULKHEAD_SOCKET": self.daemon.socket}):
            found = Sandbox.list()
            client = bulkhead.Client()

        # Assert
        self.assertEqual(found, [])
        self.assertEqual(client.socket, self.daemon.socket)
        with mock.patch.dict(os.environ, {"BULKHEAD_SOCKET": ""}):
            self.assertEqual(bulkhead.Client().socket, "/run/bulkhead/bulkheadd.sock")

    def test_an_empty_socket_argument_is_refused_by_name(self) -> None:
        # Act
        with self.assertRaises(ValueError) as raised:
            bulkhead.Client(socket="")

        # Assert
        self.assertIn("socket", str(raised.exception))


class ErrorTest(DaemonTest):
    def test_error_documents_map_to_exception_classes_with_status_code_and_message(self) -> None:
        # Arrange
        cases = [
            (400, "invalid_request", bulkhead.InvalidRequest),
            (404, "not_found", bulkhead.NotFound),
            (409, "conflict", bulkhead.Conflict),
            (413, "payload_too_large", bulkhead.TooLarge),
            (429, "too_many_sandboxes", bulkhead.InsufficientResources),
            (502, "vm_exited", bulkhead.SandboxError),
            (504, "boot_timeout", bulkhead.SandboxError),
            (500, "start_failed", bulkhead.ServerError),
            (503, "shutting_down", bulkhead.ServerError),
        ]
        for status, code, cls in cases:
            with self.subTest(status=status):
                self.daemon.route("POST", "/v1/sandboxes", error_answer(status, code, f"it said {code}"))

                # Act
                with self.assertRaises(cls) as caught:
                    Sandbox.create(memory_mib=0, client=self.client)

                # Assert
                err = caught.exception
                self.assertIsInstance(err, bulkhead.BulkheadError)
                self.assertEqual((err.status, err.code, err.message), (status, code, f"it said {code}"))
                self.assertIn(f"it said {code} ({status} {code})", str(err))

    def test_a_missing_sandbox_is_not_found(self) -> None:
        # Arrange: no route for this ID: the fake answers 404 not_found.

        # Act / Assert
        with self.assertRaises(bulkhead.NotFound):
            Sandbox.get("ffffffffffff", client=self.client)

    def test_an_error_answer_that_is_not_json_keeps_its_text(self) -> None:
        # Arrange
        self.daemon.route("GET", "/healthz", Answer(500, [b"proxy broke"]))

        # Act
        with self.assertRaises(bulkhead.ServerError) as caught:
            self.client.health()

        # Assert
        self.assertEqual((caught.exception.status, caught.exception.code), (500, "http_error"))
        self.assertEqual(caught.exception.message, "proxy broke")

    def test_a_missing_socket_is_daemon_unavailable_naming_the_socket(self) -> None:
        # Arrange
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "nothing.sock")

            # Act
            with self.assertRaises(bulkhead.DaemonUnavailable) as caught:
                Sandbox.list(socket=path)

        # Assert
        self.assertIn(path, str(caught.exception))
        self.assertIn("BULKHEAD_SOCKET", str(caught.exception))
        self.assertIsNone(caught.exception.status)

    def test_too_much_stdin_is_refused_before_anything_is_sent(self) -> None:
        # Act
        with self.assertRaises(bulkhead.TooLarge):
            self.sb.exec(["cat"], stdin=b"x" * (bulkhead.MAX_EXEC_STDIN_BYTES + 1))

        # Assert
        self.assertEqual(self.daemon.requests, [])


class ExecTest(DaemonTest):
    def stream(self, *chunks: bytes) -> None:
        self.daemon.route("POST", SB_PATH + "/exec", Answer(200, chunks, {"Content-Type": "application/x-ndjson"}))

    def test_callbacks_get_stdout_and_stderr_apart_even_with_lines_split_across_chunks(self) -> None:
        # Arrange
        body = ndjson(
            {"stdout": b64(b"hello ")},
            {"stderr": b64(b"warn\n")},
            {"stdout": b64(b"world\n")},
            {"exit": {"code": 3, "signal": None, "timed_out": False}},
        )
        self.stream(body[:5], body[5:31], body[31:32], body[32:])
        out: List[bytes] = []
        err: List[bytes] = []

        # Act
        result = self.sb.exec(["sh", "-c", "x"], on_stdout=out.append, on_stderr=err.append)

        # Assert
        self.assertEqual(out, [b"hello ", b"world\n"])
        self.assertEqual(err, [b"warn\n"])
        self.assertEqual(result, bulkhead.ExecResult(3, b"hello world\n", b"warn\n", None, False))
        self.assertFalse(result.ok)

    def test_the_request_carries_argv_env_cwd_user_timeout_and_base64_stdin(self) -> None:
        # Arrange
        self.stream(ndjson({"exit": {"code": 0, "signal": None, "timed_out": False}}))

        # Act
        result = self.sb.exec(["cat"], stdin=b"\x00\xff", env={"K": "v"}, cwd="/tmp", user="1000", timeout=2.5)
        self.sb.exec("echo $K")

        # Assert
        self.assertTrue(result.ok)
        first, second = (json.loads(r.body) for r in self.daemon.requests)
        self.assertEqual(
            first,
            {"argv": ["cat"], "env": {"K": "v"}, "cwd": "/tmp", "user": "1000", "timeout_s": 2.5, "stdin": "AP8="},
        )
        self.assertEqual(second, {"argv": ["sh", "-c", "echo $K"]})
        self.assertEqual(self.daemon.requests[0].target, SB_PATH + "/exec")

    def test_bytes_that_are_not_utf8_go_as_base64_objects_and_utf8_bytes_as_strings(self) -> None:
        # Arrange
        self.stream(ndjson({"exit": {"code": 0, "signal": None, "timed_out": False}}))

        # Act
        self.sb.exec([b"printf", b"\xff", "text"], env={"V": b"\xfe", "W": b"ok"}, cwd=b"/tmp/\xe9")

        # Assert
        self.assertEqual(
            json.loads(self.daemon.requests[0].body),
            {
                "argv": ["printf", {"base64": "/w=="}, "text"],
                "env": {"V": {"base64": "/g=="}, "W": "ok"},
                "cwd": {"base64": "L3RtcC/p"},
            },
        )

    def test_the_stream_form_yields_events_in_order_ending_with_exit(self) -> None:
        # Arrange
        self.stream(
            ndjson({"stdout": b64(b"a")}, {"stderr": b64(b"b")}),
            ndjson({"exit": {"code": None, "signal": 9, "timed_out": True}}),
        )

        # Act
        events = list(self.sb.exec_stream(["sleep", "9"], timeout=1))

        # Assert
        self.assertEqual(events, [bulkhead.Stdout(b"a"), bulkhead.Stderr(b"b"), bulkhead.Exit(None, 9, True)])

    def test_an_error_line_raises_the_error_of_its_code(self) -> None:
        # Arrange
        self.stream(
            ndjson({"stdout": b64(b"partial")}, {"error": {"code": "agent_unreachable", "message": "VM died"}})
        )
        seen: List[bytes] = []

        # Act
        with self.assertRaises(bulkhead.SandboxError) as caught:
            self.sb.exec(["x"], on_stdout=seen.append)

        # Assert
        self.assertEqual(seen, [b"partial"])
        self.assertEqual((caught.exception.code, caught.exception.message), ("agent_unreachable", "VM died"))

    def test_a_stream_that_ends_without_exit_is_interrupted(self) -> None:
        # Arrange
        self.stream(ndjson({"stdout": b64(b"a")}))

        # Act / Assert
        with self.assertRaises(bulkhead.ExecInterrupted):
            self.sb.exec(["x"])

    def test_a_connection_that_breaks_mid_stream_is_interrupted(self) -> None:
        # Arrange
        self.daemon.route("POST", SB_PATH + "/exec", Answer(200, [ndjson({"stdout": b64(b"a")})], cut=True))
        seen: List[bytes] = []

        # Act / Assert
        with self.assertRaises(bulkhead.ExecInterrupted):
            self.sb.exec(["x"], on_stdout=seen.append)
        self.assertEqual(seen, [b"a"])

    def test_a_line_that_is_not_the_protocol_is_a_protocol_error(self) -> None:
        # Arrange
        self.stream(b'{"stdout": "not base64!"}\n')

        # Act / Assert
        with self.assertRaises(bulkhead.ProtocolError):
            self.sb.exec(["x"])


def read_frame(rfile: BinaryIO) -> Tuple[int, bytes]:
    length, kind = struct.unpack("<IB", rfile.read(5))
    return kind, rfile.read(length - 1)


def frame(kind: int, payload: bytes = b"") -> bytes:
    return struct.pack("<IB", len(payload) + 1, kind) + payload


class AttachTest(DaemonTest):
    def test_stdin_streams_in_frames_and_the_output_comes_back_until_the_exit(self) -> None:
        # Arrange: a daemon side that echoes stdin to stdout until StdinEof.
        received: List[Tuple[int, bytes]] = []

        def echo(rfile: BinaryIO, wfile: BinaryIO) -> None:
            wfile.write(frame(0x10, b'{"pid": 7}'))
            wfile.flush()
            while True:
                kind, payload = read_frame(rfile)
                received.append((kind, payload))
                if kind == 0x12:
                    break
                wfile.write(frame(0x14, payload))
            wfile.write(frame(0x15, b"e") + frame(0x16, b'{"code": 3, "signal": null, "timed_out": false}'))
            wfile.flush()

        self.daemon.route("POST", SB_PATH + "/exec/attach", Answer(upgrade=echo))
        data = bytes(range(256)) * 160  # 40 KiB: three frames

        # Act
        with self.sb.attach(["cat"], env={"A": "1"}, tty=True, window=(30, 100)) as att:
            att.write(data)
            att.close_stdin()
            result = att.wait()

        # Assert
        self.assertEqual(att.pid, 7)
        self.assertEqual((result.exit_code, result.stdout, result.stderr), (3, data, b"e"))
        self.assertEqual([len(p) for k, p in received], [16384, 16384, 8192, 0])
        request = self.daemon.requests[0]
        self.assertEqual((request.headers["connection"], request.headers["upgrade"]), ("Upgrade", "bulkhead-exec"))
        self.assertEqual(
            json.loads(request.body),
            {"argv": ["cat"], "env": {"A": "1"}, "tty": True, "window": {"rows": 30, "cols": 100}},
        )

    def test_a_refused_attach_raises_the_api_error(self) -> None:
        # Arrange
        self.daemon.route("POST", SB_PATH + "/exec/attach", error_answer(409, "conflict", "sandbox is paused"))

        # Act / Assert
        with self.assertRaises(bulkhead.Conflict) as caught:
            self.sb.attach(["cat"])
        self.assertEqual(caught.exception.message, "sandbox is paused")

    def test_an_error_frame_raises_and_a_missing_started_frame_is_a_protocol_error(self) -> None:
        # Arrange
        def fail(rfile: BinaryIO, wfile: BinaryIO) -> None:
            wfile.write(frame(0x10, b'{"pid": 1}') + frame(0x7F, b'{"code": "other", "message": "VM died"}'))
            wfile.flush()

        def mute(rfile: BinaryIO, wfile: BinaryIO) -> None:
            wfile.write(frame(0x14, b"x"))
            wfile.flush()

        self.daemon.route("POST", SB_PATH + "/exec/attach", Answer(upgrade=fail))

        # Act / Assert
        with self.assertRaises(bulkhead.SandboxError) as caught:
            with self.sb.attach(["x"]) as att:
                att.wait()
        self.assertEqual(caught.exception.message, "VM died")
        self.daemon.route("POST", SB_PATH + "/exec/attach", Answer(upgrade=mute))
        with self.assertRaises(bulkhead.ProtocolError):
            self.sb.attach(["x"])


class NdjsonTest(unittest.TestCase):
    def test_lines_split_into_single_bytes_are_joined_and_a_last_unterminated_line_kept(self) -> None:
        # Arrange
        data = b'{"a": 1}\n\n{"b": 2}\n{"c": 3}'

        # Act
        got = list(_ndjson.lines(data[i : i + 1] for i in range(len(data))))

        # Assert
        self.assertEqual(got, [b'{"a": 1}', b'{"b": 2}', b'{"c": 3}'])

    def test_an_endless_line_is_refused(self) -> None:
        # Arrange
        chunks = (b"x" * (1 << 20) for _ in range(17))

        # Act / Assert
        with self.assertRaises(bulkhead.ProtocolError):
            list(_ndjson.lines(chunks))


class FilesWorkspaceAndLifecycleTest(DaemonTest):
    def test_files_write_puts_raw_bytes_with_the_mode_and_read_gets_them(self) -> None:
        # Arrange
        self.daemon.route("PUT", SB_PATH + "/files", json_answer(200, '{"bytes": 3}'))
        self.daemon.route("GET", SB_PATH + "/files", Answer(200, [b"\x00b", b"c"]))

        # Act
        written = self.sb.files.write("/tmp/a b", b"\x00bc", mode=0o755)
        data = self.sb.files.read("/tmp/a b")

        # Assert
        self.assertEqual((written, data), (3, b"\x00bc"))
        put, get = self.daemon.requests
        self.assertEqual(put.target, SB_PATH + "/files?path=%2Ftmp%2Fa+b")
        self.assertEqual((put.body, put.headers["x-bulkhead-mode"]), (b"\x00bc", "755"))
        self.assertEqual(get.method, "GET")

    def test_list_stat_exists_make_dir_and_remove_use_the_files_endpoints(self) -> None:
        # Arrange
        entry = {"name": {"base64": "/w=="}, "path": {"base64": "L3RtcC//"}, "type": "file", "size": 3,
                 "mode": 420, "mtime": 1700000000}
        link = {"name": "l", "path": "/tmp/l", "type": "symlink", "size": 1, "mode": 511, "mtime": 0,
                "link_target": "x"}
        self.daemon.route("GET", SB_PATH + "/files/list", json_answer(200, json.dumps({"entries": [entry, link]})))
        self.daemon.route("GET", SB_PATH + "/files/stat", json_answer(200, json.dumps(link)))
        self.daemon.route("POST", SB_PATH + "/files/mkdir", Answer(204))
        self.daemon.route("DELETE", SB_PATH + "/files", Answer(204))

        # Act
        entries = self.sb.files.list("/tmp")
        found = self.sb.files.exists("/tmp/l")
        self.sb.files.make_dir("/tmp/a/b", parents=True)
        self.sb.files.remove(os.fsdecode(b"/tmp/\xff"), recursive=True)

        # Assert
        self.assertEqual(os.fsencode(entries[0].name), b"\xff")
        self.assertEqual(os.fsencode(entries[0].path), b"/tmp/\xff")
        self.assertEqual((entries[0].type, entries[0].mode, entries[0].link_target), ("file", 0o644, None))
        self.assertEqual((entries[1].type, entries[1].link_target), ("symlink", "x"))
        self.assertTrue(found)
        targets = [(r.method, r.target) for r in self.daemon.requests]
        self.assertEqual(
            targets,
            [
                ("GET", SB_PATH + "/files/list?path=%2Ftmp"),
                ("GET", SB_PATH + "/files/stat?path=%2Ftmp%2Fl"),
                ("POST", SB_PATH + "/files/mkdir?path=%2Ftmp%2Fa%2Fb&parents=true"),
                ("DELETE", SB_PATH + "/files?path=%2Ftmp%2F%FF&recursive=true"),
            ],
        )

    def test_exists_is_false_for_a_missing_path_but_a_missing_sandbox_still_raises(self) -> None:
        # Arrange
        self.daemon.route("GET", SB_PATH + "/files/stat", error_answer(404, "path_not_found", "no /x"))
        ghost = Sandbox.get(SB, client=self.client)
        ghost.info = bulkhead.SandboxInfo.from_json(json.loads(sandbox_doc("ffffffffffff")))

        # Act
        found = self.sb.files.exists("/x")

        # Assert
        self.assertFalse(found)
        with self.assertRaises(bulkhead.NotFound) as caught:
            ghost.files.exists("/x")
        self.assertEqual(caught.exception.code, "not_found")

    def test_diff_parses_the_changes(self) -> None:
        # Arrange
        doc = {
            "mode": "clone",
            "path": "/src/p",
            "flagged_only": False,
            "complete": True,
            "changes": [
                {"path": "Makefile", "status": "M", "kind": "file", "flagged": True, "reason": "build file"},
                {"path": "new.txt", "status": "A", "kind": "file", "flagged": False, "reason": None},
            ],
            "skipped": [],
        }
        self.daemon.route("GET", SB_PATH + "/workspace/diff", json_answer(200, json.dumps(doc)))

        # Act
        diff = self.sb.diff()

        # Assert
        self.assertEqual(diff.mode, "clone")
        self.assertEqual(
            [(c.path, c.status, c.flagged) for c in diff.changes], [("Makefile", "M", True), ("new.txt", "A", False)]
        )

    def test_export_writes_the_body_and_returns_the_review(self) -> None:
        # Arrange
        review = {"flagged": [], "flagged_total": 0, "skipped": [{"path": "fifo", "reason": "a FIFO"}], "skipped_total": 1}
        header = base64.b64encode(json.dumps(review).encode()).decode()
        self.daemon.route("GET", SB_PATH + "/workspace/export", Answer(200, [b"diff --git", b" a/x b/x\n"], {"x-bulkhead-review": header}))
        sink = io.BytesIO()

        # Act
        with tempfile.TemporaryDirectory() as d:
            got = self.sb.export(os.path.join(d, "out.patch"))
            with open(os.path.join(d, "out.patch"), "rb") as f:
                written = f.read()
        self.sb.export(sink, format="tar")

        # Assert
        self.assertEqual(written, b"diff --git a/x b/x\n")
        self.assertEqual(sink.getvalue(), written)
        self.assertEqual((got.skipped_total, got.skipped[0].path), (1, "fifo"))
        self.assertEqual(self.daemon.requests[1].target, SB_PATH + "/workspace/export?format=tar")

    def test_an_export_cut_short_is_an_error_not_a_truncated_file(self) -> None:
        # Arrange
        header = base64.b64encode(b'{"flagged": [], "flagged_total": 0, "skipped": [], "skipped_total": 0}').decode()
        answer = Answer(200, [b"diff --git"], {"x-bulkhead-review": header}, cut=True)
        self.daemon.route("GET", SB_PATH + "/workspace/export", answer)

        # Act / Assert
        with self.assertRaises(bulkhead.DaemonUnavailable) as caught:
            self.sb.export(io.BytesIO())
        self.assertEqual(caught.exception.code, "connection_lost")

    def test_the_context_manager_kills_the_sandbox_also_after_an_exception(self) -> None:
        # Arrange
        self.daemon.route("DELETE", SB_PATH, Answer(204))

        # Act
        with self.assertRaises(RuntimeError):
            with self.sb:
                raise RuntimeError("the agent's code failed")

        # Assert
        self.assertEqual([(r.method, r.target) for r in self.daemon.requests], [("DELETE", SB_PATH)])


if __name__ == "__main__":
    unittest.main()
