//! The allowlist type and the core every thread's filter shares.

use std::collections::btree_map::Entry;
use std::collections::BTreeMap;

use seccompiler::{BackendError, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompRule};

/// One condition on a system call argument.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Arg {
    /// The low 32 bits of argument `.0` equal `.1` (ints, flags, request numbers).
    Eq(u8, u64),
    /// All 64 bits of argument `.0` are zero (a null pointer).
    Null(u8),
    /// None of the bits of `.1` are set in argument `.0`.
    Clear(u8, u64),
}

impl Arg {
    fn condition(self) -> Result<SeccompCondition, BackendError> {
        let (index, len, op, value) = match self {
            Arg::Eq(i, v) => (i, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, v),
            Arg::Null(i) => (i, SeccompCmpArgLen::Qword, SeccompCmpOp::Eq, 0),
            Arg::Clear(i, mask) => (i, SeccompCmpArgLen::Qword, SeccompCmpOp::MaskedEq(mask), 0),
        };
        SeccompCondition::new(index, len, op, value)
    }
}

/// System calls a thread may make: each unconditionally, or when all conditions of one of its
/// rules hold.
#[derive(Debug, Default, Clone)]
pub(crate) struct Allowlist {
    /// An empty rule list means "always".
    calls: BTreeMap<i64, Vec<Vec<Arg>>>,
}

impl Allowlist {
    /// Allows `nrs` whatever their arguments.
    pub(crate) fn allow(&mut self, nrs: &[libc::c_long]) -> &mut Self {
        for &nr in nrs {
            self.calls.insert(nr, Vec::new());
        }
        self
    }

    /// Allows `nr` when every condition in `args` holds (in addition to its other rules). A call
    /// already allowed unconditionally stays so; a rule given twice is kept once.
    pub(crate) fn allow_if(&mut self, nr: libc::c_long, args: &[Arg]) -> &mut Self {
        match self.calls.entry(nr) {
            Entry::Vacant(slot) => {
                slot.insert(vec![args.to_vec()]);
            }
            Entry::Occupied(mut slot) => {
                let rules = slot.get_mut();
                if !rules.is_empty() && !rules.iter().any(|r| r == args) {
                    rules.push(args.to_vec());
                }
            }
        }
        self
    }

    /// Allows `nr` when argument `index` (32 bits) is one of `values`.
    pub(crate) fn allow_values(
        &mut self,
        nr: libc::c_long,
        index: u8,
        values: &[u64],
    ) -> &mut Self {
        for &value in values {
            self.allow_if(nr, &[Arg::Eq(index, value)]);
        }
        self
    }

    /// The number of distinct system calls allowed.
    pub(crate) fn len(&self) -> usize {
        self.calls.len()
    }

    /// Whether `nr` is allowed under some condition.
    pub(crate) fn contains(&self, nr: i64) -> bool {
        self.calls.contains_key(&nr)
    }

    /// The conditions `nr` is allowed under (empty: always), if it is allowed.
    #[cfg(test)]
    pub(crate) fn rules_of(&self, nr: i64) -> Option<&[Vec<Arg>]> {
        self.calls.get(&nr).map(Vec::as_slice)
    }

    /// The rule map seccompiler compiles.
    pub(crate) fn into_rules(self) -> Result<BTreeMap<i64, Vec<SeccompRule>>, BackendError> {
        self.calls
            .into_iter()
            .map(|(nr, rules)| {
                let rules = rules
                    .into_iter()
                    .map(|args| {
                        let conditions = args
                            .into_iter()
                            .map(Arg::condition)
                            .collect::<Result<Vec<_>, _>>()?;
                        SeccompRule::new(conditions)
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                Ok((nr, rules))
            })
            .collect()
    }
}

/// `(uid_t)-1`: "leave unchanged" for `setresuid`/`setresgid`.
pub(crate) const UNCHANGED_ID: u64 = u32::MAX as u64;

/// What every VMM thread needs, whatever its job.
pub(crate) fn common() -> Allowlist {
    let mut list = Allowlist::default();
    // Heap and stack management by the allocator and thread teardown. Never executable memory:
    // the VMM loads no code once it runs.
    list.allow(&[
        libc::SYS_brk,
        libc::SYS_munmap,
        libc::SYS_madvise,
        libc::SYS_mremap,
    ])
    .allow_if(libc::SYS_mmap, &[Arg::Clear(2, libc::PROT_EXEC as u64)])
    .allow_if(libc::SYS_mprotect, &[Arg::Clear(2, libc::PROT_EXEC as u64)]);
    // Locks, condition variables, thread joins and one-time initialisation in std.
    list.allow(&[libc::SYS_futex, libc::SYS_sched_yield]);
    // Returning from signal handlers (the vCPU kick, signal-hook's, SIGSYS), glibc masking
    // signals around thread exit and `pthread_kill`, Rust tearing down a thread's alternate
    // signal stack.
    list.allow(&[
        libc::SYS_rt_sigreturn,
        libc::SYS_rt_sigprocmask,
        libc::SYS_sigaltstack,
    ]);
    // Logging to stderr (tracing, the SIGSYS handler's message), and leaving: a thread's end and
    // the process's (also the SIGSYS handler's `_exit`).
    list.allow(&[libc::SYS_write, libc::SYS_exit, libc::SYS_exit_group]);
    // Clocks when the vDSO falls back to the kernel (log timestamps, deadlines), and the
    // random keys std's HashMap seeds on a thread's first map.
    list.allow(&[
        libc::SYS_clock_gettime,
        libc::SYS_gettimeofday,
        libc::SYS_getrandom,
    ]);
    // signal-hook's handler runs on whichever thread the signal lands on and wakes the signal
    // thread with `send(fd, .., MSG_DONTWAIT)` on its socket pair (no address).
    list.allow_if(
        libc::SYS_sendto,
        &[Arg::Eq(3, libc::MSG_DONTWAIT as u64), Arg::Null(4)],
    );
    // std's debug builds check that a descriptor is open (`fcntl(F_GETFD)`) before closing it.
    list.allow_values(libc::SYS_fcntl, 1, &[libc::F_GETFD as u64]);
    list
}
