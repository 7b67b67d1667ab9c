use super::rules::Arg;
use super::*;

#[test]
#[cfg(target_arch = "x86_64")]
fn every_filter_compiles_for_x86_64_in_both_modes() {
    for kind in ThreadKind::ALL {
        for mismatch in [SeccompAction::Trap, SeccompAction::Log] {
            let program = compile(kind, TargetArch::x86_64, mismatch).unwrap();

            // An arch check, one comparison per call at least, and the actions.
            assert!(program.len() > kind.allowed_syscall_count(), "{kind}");
        }
    }
}

#[test]
fn filters_for_this_host_build_in_every_mode() {
    for mode in [SeccompMode::Log, SeccompMode::Off] {
        let filters = ThreadFilters::new(mode).unwrap();

        assert_eq!(filters.mode(), mode);
    }
}

#[test]
fn no_filter_allows_starting_programs_processes_or_tracing() {
    let forbidden = [
        libc::SYS_execve,
        libc::SYS_execveat,
        libc::SYS_clone,
        libc::SYS_clone3,
        libc::SYS_ptrace,
        libc::SYS_mount,
        libc::SYS_umount2,
        libc::SYS_bpf,
        libc::SYS_open_by_handle_at,
        libc::SYS_process_vm_writev,
        libc::SYS_kill,
        libc::SYS_bind,
        libc::SYS_listen,
        libc::SYS_seccomp,
        libc::SYS_prctl,
    ];
    for kind in ThreadKind::ALL {
        for nr in forbidden {
            assert!(!kind.allows(nr), "{kind} allows syscall {nr}");
        }
    }
}

#[test]
fn every_filter_lets_the_sigsys_handler_report_and_exit() {
    for kind in ThreadKind::ALL {
        let list = kind.allowlist();
        for nr in [
            libc::SYS_write,
            libc::SYS_exit_group,
            libc::SYS_rt_sigreturn,
        ] {
            assert_eq!(list.rules_of(nr), Some(&[][..]), "{kind}: syscall {nr}");
        }
    }
}

#[test]
fn vcpu_ioctls_are_limited_to_kvm_run_and_state_reads() {
    let list = ThreadKind::Vcpu.allowlist();

    let rules = list.rules_of(libc::SYS_ioctl).unwrap();

    // KVM_RUN, KVM_GET_REGS, KVM_GET_SREGS (values from Linux's kvm.h on x86_64).
    assert_eq!(
        &rules[..3],
        &[
            vec![Arg::Eq(1, 0xae80)],
            vec![Arg::Eq(1, 0x8090_ae81)],
            vec![Arg::Eq(1, 0x8138_ae83)],
        ][..]
    );
    #[cfg(target_arch = "x86_64")]
    {
        // A snapshot's reads: KVM_GET_MSRS, KVM_GET_LAPIC, KVM_GET_XSAVE, KVM_KVMCLOCK_CTRL.
        for allowed in [0xc008_ae88, 0x8400_ae8e, 0x9000_aea4, 0xaead] {
            assert!(rules.contains(&vec![Arg::Eq(1, allowed)]), "{allowed:#x}");
        }
        // Never a write of vCPU state: KVM_SET_REGS, _SREGS, _MSRS, _CPUID2, _LAPIC.
        for refused in [
            0x4090_ae82,
            0x4138_ae84,
            0x4008_ae89,
            0x4008_ae90,
            0x4400_ae8f,
        ] {
            assert!(!rules.contains(&vec![Arg::Eq(1, refused)]), "{refused:#x}");
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        // A snapshot's reads: KVM_GET_REG_LIST, KVM_GET_ONE_REG, KVM_GET_MP_STATE.
        for allowed in [0xc008_aeb0, 0x4010_aeab, 0x8004_ae98] {
            assert!(rules.contains(&vec![Arg::Eq(1, allowed)]), "{allowed:#x}");
        }
        // Never a write of vCPU state: KVM_SET_ONE_REG, KVM_SET_MP_STATE, KVM_ARM_VCPU_INIT.
        for refused in [0x4010_aeac, 0x4004_ae99, 0x4020_aeae] {
            assert!(!rules.contains(&vec![Arg::Eq(1, refused)]), "{refused:#x}");
        }
    }
}

#[test]
fn only_unix_sockets_can_be_created_and_only_by_the_event_loop() {
    let rules = ThreadKind::EventLoop.allowlist();

    assert_eq!(
        rules.rules_of(libc::SYS_socket),
        Some(&[vec![Arg::Eq(0, libc::AF_UNIX as u64)]][..])
    );
    assert!(!ThreadKind::Vcpu.allows(libc::SYS_socket));
    assert!(!ThreadKind::Signal.allows(libc::SYS_socket));
}

#[test]
fn memory_can_never_be_made_executable() {
    for kind in ThreadKind::ALL {
        let list = kind.allowlist();
        for nr in [libc::SYS_mmap, libc::SYS_mprotect] {
            assert_eq!(
                list.rules_of(nr),
                Some(&[vec![Arg::Clear(2, libc::PROT_EXEC as u64)]][..]),
                "{kind}: syscall {nr}"
            );
        }
    }
}

#[test]
fn a_conditional_rule_never_narrows_an_unconditional_one() {
    let mut list = rules::Allowlist::default();

    list.allow(&[libc::SYS_read])
        .allow_if(libc::SYS_read, &[Arg::Eq(0, 3)]);

    assert_eq!(list.rules_of(libc::SYS_read), Some(&[][..]));
}

#[test]
fn a_rule_given_twice_is_kept_once() {
    let mut list = rules::Allowlist::default();

    list.allow_values(libc::SYS_fcntl, 1, &[1, 2])
        .allow_values(libc::SYS_fcntl, 1, &[1]);

    assert_eq!(
        list.rules_of(libc::SYS_fcntl),
        Some(&[vec![Arg::Eq(1, 1)], vec![Arg::Eq(1, 2)]][..])
    );
}

#[test]
fn modes_parse_and_print_as_on_off_log() {
    for (text, mode) in [
        ("on", SeccompMode::On),
        ("off", SeccompMode::Off),
        ("log", SeccompMode::Log),
    ] {
        assert_eq!(text.parse::<SeccompMode>().unwrap(), mode);
        assert_eq!(mode.to_string(), text);
    }
    let err = "trap".parse::<SeccompMode>().unwrap_err();
    assert!(err.to_string().contains("`trap`"), "{err}");
}

#[test]
fn disabled_filters_install_nothing() {
    let filters = ThreadFilters::disabled();

    std::thread::spawn(move || {
        filters.install(ThreadKind::Vcpu).unwrap();
        let status = std::fs::read_to_string("/proc/thread-self/status").unwrap();
        assert!(status.contains("Seccomp:\t0"), "{status}");
    })
    .join()
    .unwrap();
}
