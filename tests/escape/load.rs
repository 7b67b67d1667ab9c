//! Exhaustion of guest resources: tasks (pids), memory and a fork bomb. The guest hits its own
//! limits; the host's process count, the VMM's threads and the VMM's memory do not move with it.

use std::time::{Duration, Instant};

use bulkhead_protocol::client::{ExecEvent, ExecOutput};
use bulkhead_sandbox::Sandbox;
use bulkhead_tests::hostcheck::{process_running, tree_status_sum, user_process_count};

use crate::fixture::MEMORY_MIB;
use crate::guest::{python, request, sh};

/// How much more than its guest RAM the VMM may hold resident, MiB: its own code (a debug
/// build's pages), heap, device buffers and stacks. Measured release overhead is ~2.5 MiB
/// (benches/results/README.md); the allowance is generous, not tight.
pub const RSS_ALLOWANCE_MIB: u64 = 64;

/// Extra user-space processes the host may show while the guest is loaded (none are the
/// guest's; the slack covers the test host's own short-lived helpers).
const HOST_PROCESS_SLACK: usize = 2;

/// What [`pids`] expects.
pub const EXPECT_PIDS: &str =
    "guest stops at its own task limit; host processes and VMM threads unchanged; VM answers";
/// What [`memory`] expects.
pub const EXPECT_MEMORY: &str =
    "allocating 4 GiB in 256 MiB: guest OOM-kills or fails it; VMM RSS <= guest RAM + allowance; VM answers";
/// What [`fork_bomb`] expects.
pub const EXPECT_BOMB: &str =
    "bomb killed at its 30 s timeout; host processes and VMM threads unchanged; VM answers or ends cleanly";

/// Peak resident memory (`VmHWM`, KiB) of the VMM process `pid` and the processes under it (a
/// jailed VMM runs as a child of the process the sandbox started), summed.
pub fn vmm_peak_rss(pid: u32) -> Option<u64> {
    tree_status_sum(pid, "VmHWM")
}

/// Whether a VMM's peak RSS (KiB) is within guest RAM + [`RSS_ALLOWANCE_MIB`], and a phrase
/// saying so.
pub fn judge_rss(peak_kib: Option<u64>) -> (bool, String) {
    let limit_mib = u64::from(MEMORY_MIB) + RSS_ALLOWANCE_MIB;
    match peak_kib {
        Some(kib) => (
            kib <= limit_mib * 1024,
            format!(
                "VMM peak RSS {:.1} MiB (limit {limit_mib})",
                kib as f64 / 1024.0
            ),
        ),
        None => (false, "VMM gone (no VmHWM)".to_owned()),
    }
}

/// Host-side counters sampled while a guest is under load (the VMM's threads counted over its
/// process tree).
#[derive(Debug, Clone, Copy)]
struct HostLoad {
    user_processes: usize,
    vmm_threads: u64,
}

impl HostLoad {
    fn sample(vmm: u32) -> HostLoad {
        HostLoad {
            user_processes: user_process_count(),
            vmm_threads: tree_status_sum(vmm, "Threads").unwrap_or(0),
        }
    }

    fn max(self, other: HostLoad) -> HostLoad {
        HostLoad {
            user_processes: self.user_processes.max(other.user_processes),
            vmm_threads: self.vmm_threads.max(other.vmm_threads),
        }
    }

    /// Whether `during` shows no host process or VMM thread the guest's load added.
    fn unchanged(self, during: HostLoad) -> bool {
        during.user_processes <= self.user_processes + HOST_PROCESS_SLACK
            && during.vmm_threads <= self.vmm_threads
    }
}

/// Starts threads (each a guest task with its own pid) until the guest kernel refuses, holds
/// them until stdin closes, then lets them go.
const PIDS_SCRIPT: &str = r#"
import sys, threading
threading.stack_size(65536)
stop = threading.Event(); n = 0; why = "no limit hit"
while n < 200000:
    t = threading.Thread(target=stop.wait)
    try:
        t.start()
    except RuntimeError as e:
        why = str(e); break
    n += 1
print(f"held {n} ({why})", flush=True)
sys.stdin.read()
stop.set()
print("released", flush=True)
"#;

/// The guest takes every task (pid) its kernel allows; while it holds them the host counts its
/// own processes and the VMM's threads.
pub fn pids(b: &Sandbox) -> (bool, String) {
    let Some(vmm) = b.vmm_pid() else {
        return (false, "sandbox B has no VMM pid".to_owned());
    };
    let before = HostLoad::sample(vmm);
    let mut req = request(&["python3", "-c", PIDS_SCRIPT], Duration::from_secs(600));
    req.stdin = true;
    let mut session = b.exec(&req).expect("start the pids script");
    let mut held = String::new();
    let mut during = before;
    while let Ok(Some(event)) = session.next_event() {
        match event {
            ExecEvent::Stdout(bytes) => held.push_str(&String::from_utf8_lossy(&bytes)),
            ExecEvent::Stderr(_) => {}
            ExecEvent::Exit(_) => break,
        }
        if held.contains("held") {
            during = HostLoad::sample(vmm);
            break;
        }
    }
    let _ = session.writer().close_stdin();
    let rest = session
        .wait_with_output()
        .map(|o| o.stdout)
        .unwrap_or_default();
    let answers = vm_answers(b, Duration::from_secs(120));

    let held_line = held
        .lines()
        .find(|l| l.starts_with("held"))
        .unwrap_or("never held");
    let released = String::from_utf8_lossy(&rest).contains("released");
    let observed = format!(
        "guest {held_line}; host user processes {} -> {}, VMM threads {} -> {}; released: {released}; VM answers: {answers}",
        before.user_processes, during.user_processes, before.vmm_threads, during.vmm_threads
    );
    let limit_hit = held_line.starts_with("held") && !held_line.contains("no limit hit");
    (
        limit_hit && before.unchanged(during) && released && answers,
        observed,
    )
}

/// Allocates and touches 16 MiB at a time, up to 4 GiB, printing the running total.
const MEMORY_SCRIPT: &str = r#"
chunks = []; total = 0
while total < 4096:
    chunks.append(b"\x01" * (16 << 20)); total += 16
    print(total, flush=True)
"#;

/// The guest allocates 16 times its RAM.
pub fn memory(b: &Sandbox) -> (bool, String) {
    let Some(vmm) = b.vmm_pid() else {
        return (false, "sandbox B has no VMM pid".to_owned());
    };

    let run = python(b, MEMORY_SCRIPT, &[], Duration::from_secs(600));
    let running = process_running(vmm);
    let (rss_ok, rss) = judge_rss(vmm_peak_rss(vmm));
    let oom = sh(
        b,
        "dmesg | grep -c 'Out of memory' || true",
        Duration::from_secs(60),
    );
    let answers = vm_answers(b, Duration::from_secs(120));

    let reached = run.stdout.lines().last().unwrap_or("0");
    let how = match (run.code, run.signal) {
        (_, Some(9)) => "killed by SIGKILL".to_owned(),
        (Some(0), _) => "COMPLETED".to_owned(),
        (Some(code), _) => format!("failed with exit {code}"),
        (None, signal) => format!("ended by signal {signal:?}"),
    };
    let observed = format!(
        "allocation {how} at {reached} MiB; guest OOM kills logged: {}; {rss}; VMM running: {running}; VM answers: {answers}",
        oom.stdout.trim()
    );
    (
        run.code != Some(0) && !run.timed_out && rss_ok && running && answers,
        observed,
    )
}

/// The classic bash fork bomb, run with a 30 s timeout (the agent then kills its cgroup); the
/// host samples its process count and the VMM's threads while it runs.
pub fn fork_bomb(b: &Sandbox) -> (bool, String) {
    let Some(vmm) = b.vmm_pid() else {
        return (false, "sandbox B has no VMM pid".to_owned());
    };
    let before = HostLoad::sample(vmm);
    let req = request(&["bash", "-c", ":(){ :|:& };:"], Duration::from_secs(30));
    let (_writer, reader) = b.exec(&req).expect("start the fork bomb").split();
    let bomb = std::thread::spawn(move || reader.collect_output());
    let mut peak = before;
    let mut samples = 0;
    while !bomb.is_finished() {
        peak = peak.max(HostLoad::sample(vmm));
        samples += 1;
        std::thread::sleep(Duration::from_millis(200));
    }
    let out = bomb.join().expect("bomb reader thread");

    let answers = vm_answers(b, Duration::from_secs(180));
    let running = process_running(vmm);
    let (rss_ok, rss) = if running {
        judge_rss(vmm_peak_rss(vmm))
    } else {
        (true, "VMM exited".to_owned())
    };
    let ended = describe_end(&out);
    let observed = format!(
        "bomb {ended}; host user processes {} -> peak {}, VMM threads {} -> peak {} ({samples} samples); {rss}; \
         VM answers: {answers}, VMM running: {running}",
        before.user_processes, peak.user_processes, before.vmm_threads, peak.vmm_threads
    );
    // Either the guest survived and answers, or its kernel gave up and the VM ended (the VMM
    // exited on its own; destroying it later must still be clean, see the last case).
    let survived_or_ended = answers || !running;
    (
        before.unchanged(peak) && survived_or_ended && rss_ok,
        observed,
    )
}

fn describe_end(out: &Result<ExecOutput, bulkhead_protocol::client::ClientError>) -> String {
    match out {
        Ok(o) if o.status.timed_out => "killed at its timeout".to_owned(),
        Ok(o) => format!("ended on its own ({:?})", o.status),
        Err(e) => format!("connection ended: {e}"),
    }
}

/// Whether the guest runs `echo alive` within `patience` (a guest just relieved of a load may
/// refuse a fork for a moment: each refusal is answered at once, so this retries until the
/// deadline).
fn vm_answers(b: &Sandbox, patience: Duration) -> bool {
    let deadline = Instant::now() + patience;
    loop {
        if b.vmm_pid().is_some_and(|pid| !process_running(pid)) {
            return false;
        }
        let attempt = b
            .exec(&request(&["echo", "alive"], Duration::from_secs(30)))
            .and_then(|s| s.wait_with_output().map_err(Into::into));
        if attempt.is_ok_and(|o| o.stdout == b"alive\n") {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_secs(1));
    }
}
