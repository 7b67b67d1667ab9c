//! The network on the host's terms (issue 27), from inside a guest: `curl` in the Debian test
//! image reaches an HTTPS test server on the test host's loopback only through the egress
//! proxy, only where the allow-list says, with a secret injected on the host that the guest never
//! sees.
//!
//! The test server (`bulkhead_egress::testing`) has a certificate of its own test CA for
//! `api.test` and `other.test`; `--add-host` pins both names to 127.0.0.1, which
//! `--allow-cidr 127.0.0.1/32` lifts from the blocked ranges, and `SSL_CERT_FILE` makes the
//! proxy (in the `bulkhead run` process) trust the test CA for its upstream connections.

use std::path::Path;
use std::process::{Command, Output};

use bulkhead_egress::policy::Verdict;
use bulkhead_egress::testing::{TestCa, TestServer};
use bulkhead_egress::LogEntry;
use bulkhead_tests::{artifacts, describe, field, in_vm_host, scratch_dir};

/// The secret's value: the test server must see it, the guest never.
const SECRET: &str = "bulkhead-test-secret-7f3a9c";

/// A guest test on the Debian test image (built outside the test host before delegating).
macro_rules! net_test {
    (fn $name:ident() $body:block) => {
        #[test]
        fn $name() {
            artifacts().debian_image();
            let path = concat!(module_path!(), "::", stringify!($name));
            let name = path.split_once("::").map(|(_, rest)| rest).unwrap_or(path);
            in_vm_host(name, || $body);
        }
    };
}

/// The test server, served by a runtime of its own for as long as this value lives.
struct Server {
    server: TestServer,
    ca_file: std::path::PathBuf,
    _runtime: tokio::runtime::Runtime,
    _dir: tempfile::TempDir,
}

impl Server {
    fn start() -> Server {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let ca = TestCa::new();
        let server = runtime.block_on(TestServer::start(&ca));
        let dir = scratch_dir();
        let ca_file = dir.path().join("test-ca.pem");
        std::fs::write(&ca_file, ca.cert_pem()).unwrap();
        Server {
            server,
            ca_file,
            _runtime: runtime,
            _dir: dir,
        }
    }

    /// The `Authorization` headers of every request the server received, in order.
    fn authorizations(&self) -> Vec<String> {
        self.server
            .state
            .seen()
            .iter()
            .filter_map(|s| s.headers.get("authorization"))
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
            .collect()
    }
}

/// `bulkhead run --image <debian> ARGS -- sh -c SCRIPT` with the secret in the environment and
/// the test CA as the proxy's upstream roots.
fn run(server: &Server, args: &[&str], script: &str) -> Output {
    bulkhead_run(server, args, script)
        .output()
        .expect("run bulkhead")
}

/// The command of [`run`], not started.
fn bulkhead_run(server: &Server, args: &[&str], script: &str) -> Command {
    let a = artifacts();
    let mut command = a.cli_command();
    command
        .arg("run")
        .arg("--image")
        .arg(a.debian_image())
        .args([
            "--memory",
            "256",
            "--boot-timeout",
            "300",
            "--timeout",
            "240",
        ])
        .args(args)
        .args(["--", "sh", "-c", script])
        .env("TOKEN", SECRET)
        .env("SSL_CERT_FILE", &server.ca_file);
    command
}

fn read_log(path: &Path) -> Vec<LogEntry> {
    bulkhead_egress::read_log(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

net_test!(
    fn an_allowed_host_gets_the_secret_and_everything_else_is_refused_with_a_reason() {
        // Arrange
        let server = Server::start();
        let tls = server.server.tls_port;
        let http = server.server.http_port;
        let dir = scratch_dir();
        let log = dir.path().join("egress.jsonl");
        let (api_tls, api_http) = (format!("api.test:{tls}"), format!("api.test:{http}"));
        let script = format!(
            "echo ok=$(curl -sS -o /dev/null -w '%{{http_code}}' \
                 -H \"Authorization: Bearer $TOKEN\" https://{api_tls}/echo-auth)
             curl -sS https://other.test:{tls}/ >/dev/null 2>&1; echo other_exit=$?
             echo plain=$(curl -s -o /dev/null -w '%{{http_code}}' \
                 -H \"Authorization: Bearer $TOKEN\" http://{api_http}/echo-auth)
             echo denial=$(curl -s http://other.test:{http}/)
             echo placeholder=$TOKEN
             echo env_hits=$(cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n' \
                 | grep -c {SECRET})
             echo file_hits=$(grep -rl {SECRET} /etc /root /tmp /run /var 2>/dev/null | wc -l)
             getent hosts example.com >/dev/null; echo getent_exit=$?"
        );
        let log_arg = log.display().to_string();
        // A host pattern without a port covers 80 and 443 only: the test server's are others.
        let secret = format!("TOKEN={api_tls},{api_http}");
        let args = [
            "--allow",
            &api_tls,
            "--allow",
            &api_http,
            "--allow-cidr",
            "127.0.0.1/32",
            "--add-host",
            "api.test:127.0.0.1",
            "--add-host",
            "other.test:127.0.0.1",
            "--secret",
            &secret,
            "--egress-log",
            &log_arg,
        ];

        // Act
        let out = run(&server, &args, &script);

        // Assert
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let log_text = std::fs::read_to_string(&log).unwrap_or_default();
        assert!(
            out.status.success(),
            "{}\n--- egress log\n{log_text}",
            describe(&out)
        );
        assert_eq!(
            field(&stdout, "ok"),
            "200",
            "{}\n--- egress log\n{log_text}",
            describe(&out)
        );
        let auth = server.authorizations();
        assert_eq!(
            auth,
            [format!("Bearer {SECRET}")],
            "the server saw {auth:?}"
        );
        assert_ne!(field(&stdout, "other_exit"), "0", "other.test was reached");
        assert_eq!(
            field(&stdout, "plain"),
            "403",
            "a placeholder over plain HTTP"
        );
        assert!(
            field(&stdout, "denial").contains(&format!(
                "egress to other.test:{http} denied: no allow rule matches"
            )),
            "{stdout}"
        );
        let placeholder = field(&stdout, "placeholder");
        assert!(!placeholder.is_empty() && !placeholder.contains(SECRET));
        assert_eq!(field(&stdout, "env_hits"), "0");
        assert_eq!(field(&stdout, "file_hits"), "0");
        assert_ne!(
            field(&stdout, "getent_exit"),
            "0",
            "the guest resolved a name"
        );
        let entries = read_log(&log);
        let decided = |host: &str, port: u16, decision: Verdict| {
            entries
                .iter()
                .any(|e| e.host == host && e.port == port && e.decision == decision)
        };
        assert!(decided("api.test", tls, Verdict::Allow), "{entries:?}");
        assert!(decided("other.test", tls, Verdict::Deny), "{entries:?}");
        assert!(decided("api.test", http, Verdict::Deny), "{entries:?}");
    }
);

net_test!(
    fn without_a_network_flag_there_is_no_proxy_and_no_way_out() {
        // Arrange
        let server = Server::start();
        let script = "echo proxy_vars=$(env | grep -ci _proxy)
             curl -sS --max-time 20 http://127.0.0.1:3128/ >/dev/null 2>&1; echo curl_exit=$?";

        // Act
        let out = run(&server, &[], script);

        // Assert
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{}", describe(&out));
        assert_eq!(field(&stdout, "proxy_vars"), "0");
        assert_ne!(
            field(&stdout, "curl_exit"),
            "0",
            "something listens on 3128"
        );
        assert!(server.server.state.seen().is_empty());
    }
);

/// The children of process `pid`, forked by any of its threads (`/proc/PID/task/*/children`).
fn children_of(pid: u32) -> Vec<u32> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten();
    tasks
        .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
        .flat_map(|text| {
            text.split_whitespace()
                .filter_map(|c| c.parse().ok())
                .collect::<Vec<u32>>()
        })
        .collect()
}

/// The processes below `pid` (children, grandchildren, ...) whose command name is `name`.
fn descendants_named(pid: u32, name: &str) -> Vec<u32> {
    let mut parents = vec![pid];
    let mut found = Vec::new();
    while let Some(parent) = parents.pop() {
        for child in children_of(parent) {
            let comm = std::fs::read_to_string(format!("/proc/{child}/comm")).unwrap_or_default();
            if comm.trim() == name {
                found.push(child);
            }
            parents.push(child);
        }
    }
    found
}

/// Whether `needle` is in any writable mapping of process `pid` larger than 16 MiB (guest RAM),
/// read through `/proc/PID/mem`.
fn in_guest_memory(pid: u32, needle: &[u8]) -> bool {
    use std::io::{Read, Seek, SeekFrom};
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
    let Ok(mut mem) = std::fs::File::open(format!("/proc/{pid}/mem")) else {
        return false;
    };
    let mut buf = vec![0u8; 1 << 20];
    for line in maps.lines().filter(|l| {
        l.split_whitespace()
            .nth(1)
            .is_some_and(|p| p.starts_with("rw"))
    }) {
        let (start, end) = line
            .split_whitespace()
            .next()
            .and_then(|r| r.split_once('-'))
            .and_then(|(a, b)| {
                Some((
                    u64::from_str_radix(a, 16).ok()?,
                    u64::from_str_radix(b, 16).ok()?,
                ))
            })
            .unwrap_or((0, 0));
        if end - start < 16 << 20 {
            continue;
        }
        let mut at = start;
        while at < end {
            let len = buf.len().min((end - at) as usize);
            if mem.seek(SeekFrom::Start(at)).is_err() || mem.read_exact(&mut buf[..len]).is_err() {
                break;
            }
            if buf[..len].windows(needle.len()).any(|w| w == needle) {
                return true;
            }
            // Overlap the next chunk by the needle's length, so no match straddles two reads.
            at += (len - needle.len()) as u64;
        }
    }
    false
}

net_test!(
    fn the_secret_is_nowhere_in_guest_memory_after_it_was_injected() {
        // Arrange: a request with the placeholder, then the guest waits while its memory is read.
        let server = Server::start();
        let tls = server.server.tls_port;
        let api = format!("api.test:{tls}");
        let script = format!(
            "curl -sS -o /dev/null -H \"Authorization: Bearer $TOKEN\" https://{api}/echo-auth
             echo placeholder=$TOKEN; echo ready; sleep 30"
        );
        let secret = format!("TOKEN={api}");
        let args = [
            "--allow",
            &api,
            "--allow-cidr",
            "127.0.0.1/32",
            "--add-host",
            "api.test:127.0.0.1",
            "--secret",
            &secret,
        ];
        let mut child = bulkhead_run(&server, &args, &script)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("run bulkhead");
        let mut lines =
            std::io::BufRead::lines(std::io::BufReader::new(child.stdout.take().unwrap()));
        let mut placeholder = String::new();
        for line in lines.by_ref() {
            let line = line.unwrap();
            if let Some(p) = line.strip_prefix("placeholder=") {
                placeholder = p.to_owned();
            }
            if line == "ready" {
                break;
            }
        }

        // Act
        let vmms = descendants_named(child.id(), "bulkhead-vmm");
        let placeholder_seen = vmms
            .iter()
            .any(|&p| in_guest_memory(p, placeholder.as_bytes()));
        let secret_seen = vmms.iter().any(|&p| in_guest_memory(p, SECRET.as_bytes()));
        let _ = child.kill();
        let _ = child.wait();

        // Assert: the scan finds what the guest has (the placeholder), never the value, which
        // the server did receive.
        assert!(
            !vmms.is_empty(),
            "no bulkhead-vmm process below bulkhead run"
        );
        assert!(!placeholder.is_empty(), "the guest printed no placeholder");
        assert!(
            placeholder_seen,
            "the scan did not find the placeholder in guest RAM"
        );
        assert!(!secret_seen, "the secret's value is in the VMM's memory");
        let received = server.authorizations();
        assert_eq!(received, [format!("Bearer {SECRET}")]);
    }
);

net_test!(
    fn a_download_through_a_spliced_tunnel_arrives_whole_in_the_guest() {
        // Arrange: 16 MiB behind an allowed host with no secret and no method or path rule, so
        // its tunnel is spliced, not intercepted: the guest's curl checks the test server's
        // own certificate (its CA given to curl) through the VMM's vsock and the proxy.
        use sha2::{Digest, Sha256};
        let server = Server::start();
        let big: Vec<u8> = (0..16usize << 20).map(|i| b'a' + (i % 26) as u8).collect();
        server.server.set_big(big.clone().into());
        let want: String = Sha256::digest(&big)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let tls = server.server.tls_port;
        let api = format!("api.test:{tls}");
        let ca_pem = std::fs::read_to_string(&server.ca_file).unwrap();
        let script = format!(
            "cat > /tmp/test-ca.pem <<'PEM'\n{ca_pem}PEM\n\
             echo sum=$(curl -sS --cacert /tmp/test-ca.pem https://{api}/big | sha256sum)"
        );
        let dir = scratch_dir();
        let log = dir.path().join("egress.jsonl");
        let log_arg = log.display().to_string();
        let args = [
            "--allow",
            &api,
            "--allow-cidr",
            "127.0.0.1/32",
            "--add-host",
            "api.test:127.0.0.1",
            "--egress-log",
            &log_arg,
        ];

        // Act
        let out = run(&server, &args, &script);

        // Assert
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{}", describe(&out));
        assert_eq!(
            field(&stdout, "sum").split_whitespace().next(),
            Some(want.as_str()),
            "{}",
            describe(&out)
        );
        let entries = read_log(&log);
        let tunnel = entries
            .iter()
            .find(|e| e.host == "api.test" && e.port == tls)
            .unwrap_or_else(|| panic!("no line for {api}: {entries:?}"));
        assert_eq!(tunnel.decision, Verdict::Allow, "{tunnel:?}");
        assert!(tunnel.method.is_none(), "intercepted: {tunnel:?}");
        assert!(tunnel.bytes_down >= big.len() as u64, "{tunnel:?}");
    }
);
