//! Reaching out: the network, another sandbox over vsock, and the host's KVM.

use std::collections::BTreeSet;
use std::io::ErrorKind;
use std::net::{TcpListener, UdpSocket};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::time::Duration;

use bulkhead_protocol::client::AgentClient;
use bulkhead_sandbox::Sandbox;

use crate::guest::{collect, python, request, sh};

/// Longest any of these guest commands may take.
const TIMEOUT: Duration = Duration::from_secs(180);

/// What [`network`] expects.
pub const EXPECT_NETWORK: &str =
    "only lo exists; TCP/UDP to 10.0.2.2, 1.1.1.1 and every host address fail; host listeners get nothing";
/// What [`vsock`] expects.
pub const EXPECT_VSOCK: &str =
    "A reaches only its own host side; B's host listener and B's guest listener see nothing from A";
/// What [`kvm`] expects.
pub const EXPECT_KVM: &str = "no /dev/kvm; a node made with mknod 10:232 does not open";

/// The guest's network attempts: TCP connects and UDP sends to well-known outside addresses and
/// to every address of the host (argv: the host listeners' port, then the addresses), then
/// IPv6 and packet sockets. One line per attempt.
const NET_SCRIPT: &str = r#"
import errno, socket, sys
port = int(sys.argv[1]); hosts = sys.argv[2:]
def why(e):
    return errno.errorcode.get(e.errno, str(e)) if e.errno else type(e).__name__
tcp = [("10.0.2.2", 80), ("10.0.2.2", port), ("10.0.2.3", 53), ("1.1.1.1", 443), ("1.1.1.1", 53),
       ("8.8.8.8", 53), ("192.168.0.1", 80)] + [(h, port) for h in hosts]
for host, p in tcp:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM); s.settimeout(10)
    try:
        s.connect((host, p)); print(f"CONNECTED tcp {host}:{p}")
    except OSError as e:
        print(f"FAILED tcp {host}:{p} {why(e)}")
    s.close()
for host, p in [("1.1.1.1", 53), ("10.0.2.3", 53)] + [(h, port) for h in hosts]:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.sendto(b"x", (host, p)); print(f"SENT udp {host}:{p}")
    except OSError as e:
        print(f"FAILED udp {host}:{p} {why(e)}")
    s.close()
for label, fam, kind in [("ipv6", 10, socket.SOCK_STREAM), ("packet", 17, socket.SOCK_RAW)]:
    try:
        socket.socket(fam, kind).close(); print(f"OPENED {label} socket")
    except OSError as e:
        print(f"NOSOCKET {label} {why(e)}")
"#;

/// The guest tries the network: which interfaces exist, then [`NET_SCRIPT`] against outside
/// addresses and the host's own, where a TCP and a UDP listener wait on the same port.
pub fn network(a: &Sandbox) -> (bool, String) {
    let tcp = TcpListener::bind("0.0.0.0:0").expect("host TCP listener");
    let port = tcp.local_addr().expect("listener address").port();
    let udp = UdpSocket::bind(("0.0.0.0", port)).expect("host UDP socket");
    tcp.set_nonblocking(true).expect("nonblocking");
    udp.set_nonblocking(true).expect("nonblocking");
    let hosts = host_addresses();
    let port_arg = port.to_string();
    let mut args = vec![port_arg.as_str()];
    args.extend(hosts.iter().map(String::as_str));

    let interfaces = sh(a, "ls /sys/class/net", TIMEOUT);
    let run = python(a, NET_SCRIPT, &args, TIMEOUT);

    let tcp_got = !matches!(tcp.accept(), Err(ref e) if e.kind() == ErrorKind::WouldBlock);
    let udp_got =
        !matches!(udp.recv_from(&mut [0u8; 16]), Err(ref e) if e.kind() == ErrorKind::WouldBlock);
    let interfaces: Vec<&str> = interfaces.stdout.split_whitespace().collect();
    let lines: Vec<&str> = run.stdout.lines().collect();
    let failed = lines.iter().filter(|l| l.starts_with("FAILED")).count();
    let reached: Vec<&&str> = lines
        .iter()
        .filter(|l| l.starts_with("CONNECTED") || l.starts_with("SENT"))
        .collect();
    let reasons: BTreeSet<&str> = lines
        .iter()
        .filter(|l| l.starts_with("FAILED"))
        .filter_map(|l| l.split_whitespace().last())
        .collect();
    let sockets: Vec<String> = lines
        .iter()
        .filter(|l| l.starts_with("NOSOCKET") || l.starts_with("OPENED"))
        .map(|l| l.replace("NOSOCKET ", "no ").replace(" socket", ""))
        .collect();
    let observed = format!(
        "interfaces {interfaces:?}; {failed} attempts failed ({reasons:?}), {} succeeded{}; host addresses {hosts:?}; \
         host listeners got {}; {sockets:?}",
        reached.len(),
        if reached.is_empty() { String::new() } else { format!(" {reached:?}") },
        if tcp_got || udp_got { "SOMETHING" } else { "nothing" },
    );
    let passed = interfaces == ["lo"]
        && reached.is_empty()
        && failed == 7 + 2 + 2 * hosts.len()
        && !tcp_got
        && !udp_got;
    (passed, observed)
}

/// The host's IPv4 addresses outside 127/8 (the guest's loopback is its own), from the
/// kernel's local routing table (`/proc/net/fib_trie`: an address line followed by
/// `/32 host LOCAL`).
fn host_addresses() -> Vec<String> {
    let text = std::fs::read_to_string("/proc/net/fib_trie").unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    let mut out = BTreeSet::new();
    for pair in lines.windows(2) {
        if pair[1].trim() == "/32 host LOCAL" {
            if let Some(addr) = pair[0].trim().strip_prefix("|-- ") {
                if !addr.starts_with("127.") {
                    out.insert(addr.to_owned());
                }
            }
        }
    }
    out.into_iter().collect()
}

/// Vsock port B's host side listens on (`<B's vm.sock>_5000`).
const B_HOST_PORT: u32 = 5000;
/// Vsock port A's own host side listens on: the control that A's attempts can connect at all.
const A_HOST_PORT: u32 = 5001;
/// Vsock port B's guest listens on.
const B_GUEST_PORT: u32 = 6000;

/// B's guest listener: prints the CID of every peer; ends after a peer from the host (CID 2),
/// which the host sends when A is done.
const LISTEN_SCRIPT: &str = r#"
import socket
s = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
s.bind((socket.VMADDR_CID_ANY, 6000)); s.listen(64)
open("/tmp/vsock-listening", "w").close()
while True:
    c, (cid, port) = s.accept(); c.close(); print(cid, flush=True)
    if cid == 2:
        break
"#;

/// A's attempts: every CID (the hypervisor, local, the host, A's and B's CID 3, other guest
/// CIDs, the largest ones) on the agent's, the readiness, B's host and B's guest ports, and the
/// control port on the host.
const ATTACK_SCRIPT: &str = r#"
import errno, socket
targets = [(c, p) for c in (0, 1, 2, 3, 4, 5, 100, 0xFFFFFFFE, 0xFFFFFFFF) for p in (1024, 1025, 5000, 6000)]
for cid, port in targets + [(2, 5001)]:
    s = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM); s.settimeout(10)
    try:
        s.connect((cid, port)); print(f"CONNECTED {cid}:{port}")
    except OSError as e:
        print(f"FAILED {cid}:{port} {errno.errorcode.get(e.errno, type(e).__name__)}")
    s.close()
"#;

/// A tries to connect to B over vsock, by every CID and port, while B's host side listens on
/// its `vm.sock_5000` and B's guest on port 6000. Controls show both listeners reachable by
/// their own VM: a host listener on A's own `vm.sock_5001` takes A's call, and B's `vm.sock_5000`
/// takes a call from B after A is done. Both sandboxes have CID 3, each behind its own vsock
/// device.
pub fn vsock(a: &Sandbox, b: &Sandbox) -> (bool, String) {
    let b_host = HostPort::listen(b, B_HOST_PORT);
    let a_host = HostPort::listen(a, A_HOST_PORT);
    let listener = b
        .exec(&request(&["python3", "-c", LISTEN_SCRIPT], TIMEOUT))
        .expect("start B's listener");
    let wait =
        "for i in $(seq 600); do [ -e /tmp/vsock-listening ] && exit 0; sleep 0.1; done; exit 1";
    let ready = sh(b, wait, TIMEOUT);
    if ready.code != Some(0) {
        return (
            false,
            format!("B's guest listener did not start: {}", ready.all()),
        );
    }

    let attack = python(a, ATTACK_SCRIPT, &[], TIMEOUT);
    let b_host_from_a = b_host.accepted();
    let a_host_got = a_host.accepted();
    // The host's own connection ends B's listener; B prints every peer's CID.
    let ended = AgentClient::connect_hybrid(b.vsock_path(), B_GUEST_PORT, Duration::from_secs(30));
    let peers = collect(listener);
    let b_self = python(b, SELF_CONNECT_SCRIPT, &[], TIMEOUT);
    let b_host_from_b = b_host.accepted();

    let lines: Vec<&str> = attack.stdout.lines().collect();
    let connected: Vec<&str> = lines
        .iter()
        .filter_map(|l| l.strip_prefix("CONNECTED "))
        .collect();
    let reasons: BTreeSet<&str> = lines
        .iter()
        .filter(|l| l.starts_with("FAILED"))
        .filter_map(|l| l.split_whitespace().last())
        .collect();
    let failed = lines.iter().filter(|l| l.starts_with("FAILED")).count();
    // Connections A may make: its own host side (the control), and its own agent (port 1024)
    // through a loopback transport (CID 1, its own CID 3, or "any"), if the kernel has one.
    // Nothing listens on the other ports in A, so any other connection would be B.
    let own = ["2:5001", "1:1024", "3:1024", "4294967295:1024"];
    let foreign: Vec<&&str> = connected.iter().filter(|t| !own.contains(t)).collect();
    let b_peers: Vec<&str> = peers.stdout.split_whitespace().collect();
    let observed = format!(
        "A: {failed} of {} attempts failed {reasons:?}, connected {connected:?} (A's own host side and agent); \
         B's host side accepted {b_host_from_a} from A, {b_host_from_b} from B itself (control); \
         B's guest saw peers {b_peers:?} (2 = the host's closing call); A's host side accepted {a_host_got} (control)",
        lines.len(),
    );
    let passed = foreign.is_empty()
        && connected.contains(&"2:5001")
        && a_host_got == 1
        && b_host_from_a == 0
        && b_host_from_b == 1
        && b_self.stdout.contains("CONNECTED")
        && ended.is_ok()
        && b_peers == ["2"]
        && lines.len() == 37;
    (passed, observed)
}

/// B connects to its own host side's port 5000 (the control for B's host listener).
const SELF_CONNECT_SCRIPT: &str = r#"
import socket
s = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM); s.settimeout(10)
s.connect((2, 5000)); print("CONNECTED"); s.close()
"#;

/// A host listener on `<sandbox's vm.sock>_PORT`, where guest connections to CID 2 PORT go.
struct HostPort {
    listener: UnixListener,
    path: PathBuf,
}

impl HostPort {
    fn listen(sandbox: &Sandbox, port: u32) -> HostPort {
        let path = PathBuf::from(format!("{}_{port}", sandbox.vsock_path().display()));
        let listener =
            UnixListener::bind(&path).unwrap_or_else(|e| panic!("bind {}: {e}", path.display()));
        listener.set_nonblocking(true).expect("nonblocking");
        // A jailed VMM connects as its own unprivileged uid (crates/sandbox/src/jail.rs).
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666))
            .expect("chmod the listener");
        HostPort { listener, path }
    }

    /// Connections waiting to be accepted (accepting them).
    fn accepted(&self) -> usize {
        std::iter::from_fn(|| self.listener.accept().ok()).count()
    }
}

impl Drop for HostPort {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The guest looks for the host's KVM: `/dev/kvm`, `/proc/misc`, then a device node with KVM's
/// numbers (misc 10:232) made by guest root in `/dev` (devtmpfs, which allows device nodes),
/// opened read-write.
pub fn kvm(a: &Sandbox) -> (bool, String) {
    let script = r#"if [ -e /dev/kvm ]; then echo "present /dev/kvm"; else echo "absent /dev/kvm"; fi
echo "misc: $(grep -w kvm /proc/misc || echo no kvm)"
echo "cpu flags: $(grep -cwE 'vmx|svm' /proc/cpuinfo) cpus with vmx/svm"
mknod /dev/kvm c 10 232
python3 -c '
import errno, os
try:
    os.open("/dev/kvm", os.O_RDWR); print("OPENED /dev/kvm")
except OSError as e:
    print("open of a mknod 10:232:", errno.errorcode.get(e.errno, e.errno))
'
rm -f /dev/kvm"#;

    let run = sh(a, script, TIMEOUT);

    let absent = run.stdout.contains("absent /dev/kvm");
    let opened = run.stdout.contains("OPENED");
    let line = |prefix: &str| {
        run.stdout
            .lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or("?")
            .to_owned()
    };
    let open_result = line("open of");
    let observed = format!(
        "/dev/kvm {}; {}; {open_result}; {}",
        if absent { "absent" } else { "PRESENT" },
        line("misc:"),
        line("cpu flags:"),
    );
    let passed = absent
        && !opened
        && open_result.starts_with("open of")
        && run.stdout.contains("misc: no kvm");
    (passed, observed)
}
