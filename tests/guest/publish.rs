//! `bulkhead run -p`: a guest TCP server reached from the host's port over vsock (ingress), and a
//! host port in use refused with the address.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bulkhead_tests::{artifacts, guest_test};

/// `bulkhead run ARGS...` with the test kernel and agent image, stdout and stderr piped.
fn run(args: &[&str]) -> Command {
    let a = artifacts();
    let mut command = a.cli_command();
    command
        .arg("run")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

/// The body of `GET path` from 127.0.0.1:`port` (HTTP/1.0, so the server closes), or None when
/// the connection is refused or closed without a reply.
fn http_get(port: u16, path: &str) -> Option<String> {
    let mut conn = TcpStream::connect(("127.0.0.1", port)).ok()?;
    conn.set_read_timeout(Some(Duration::from_secs(20))).ok()?;
    conn.write_all(format!("GET {path} HTTP/1.0\r\n\r\n").as_bytes())
        .ok()?;
    let mut reply = String::new();
    conn.read_to_string(&mut reply).ok()?;
    reply
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
}

/// A TCP port on 127.0.0.1 that was free a moment ago.
fn free_port() -> u16 {
    let probe = TcpListener::bind("127.0.0.1:0").unwrap();
    probe.local_addr().unwrap().port()
}

guest_test!(
    fn run_p_serves_a_guest_server_on_the_host_port_and_a_port_in_use_is_refused() {
        // Arrange
        let port = free_port();
        let publish = format!("{port}:8000");
        let taken = TcpListener::bind("127.0.0.1:0").unwrap();
        let busy = format!("{}:8000", taken.local_addr().unwrap().port());
        let server = "echo hello-from-guest > /tmp/index.html; exec httpd -f -p 8000 -h /tmp";

        // Act: busybox httpd in the guest, reached through the host's port.
        let serving = run(&["-p", &publish, "--timeout", "300", "--", "sh", "-c", server])
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(180);
        let mut page = None;
        while page.is_none() && Instant::now() < deadline {
            page = http_get(port, "/index.html");
            if page.is_none() {
                std::thread::sleep(Duration::from_millis(200));
            }
        }
        // SAFETY: SIGTERM to our own child process, not yet reaped.
        unsafe { libc::kill(serving.id() as libc::pid_t, libc::SIGTERM) };
        let served = serving.wait_with_output().unwrap();
        let refused = run(&["-p", &busy, "--", "true"]).output().unwrap();

        // Assert
        let stderr = String::from_utf8_lossy(&served.stderr);
        assert_eq!(page.as_deref(), Some("hello-from-guest\n"), "{stderr}");
        assert!(
            http_get(port, "/index.html").is_none(),
            "the port is still served after the run ended"
        );
        let refused_err = String::from_utf8_lossy(&refused.stderr);
        assert!(!refused.status.success());
        assert!(
            refused_err.contains(&format!("listen on 127.0.0.1:{}", &busy[..busy.len() - 5])),
            "{refused_err}"
        );
    }
);
