//! The value parsers of `bulkhead run`'s flags (shared with `create` and the machine flags):
//! each checks a value by the spec's rule and says what it must be.

use std::ffi::OsString;
use std::time::Duration;

use bulkhead_protocol::ByteString;
use bulkhead_sandbox::spec;
use bulkhead_sandbox::storage::MIN_SCRATCH_MIB;
use bulkhead_sandbox::ResourceLimits;
use bulkhead_vmm::vstate::memory::{MAX_MEMORY_MIB, MIN_MEMORY_MIB};

use super::MAX_VCPUS;

/// `-e KEY=VALUE`: a UTF-8 name without NUL, and a value of any bytes.
pub(crate) fn parse_env(s: OsString) -> Result<(String, ByteString), String> {
    let bytes = s.as_encoded_bytes();
    let Some(eq) = bytes.iter().position(|&b| b == b'=') else {
        return Err(format!("`{}` is not KEY=VALUE", s.to_string_lossy()));
    };
    match std::str::from_utf8(&bytes[..eq]) {
        Ok(key) if !key.is_empty() && !key.contains('\0') => {
            Ok((key.to_owned(), ByteString::from(&bytes[eq + 1..])))
        }
        _ => Err(format!(
            "`{}` is not KEY=VALUE with a UTF-8 name",
            s.to_string_lossy()
        )),
    }
}

/// `--kernel-arg`: one parameter of the guest kernel's command line, so no whitespace (which
/// would split it into several) and no NUL byte, and not one of the agent's `bulkhead.` keys
/// (the spec's rule, [`spec::check_kernel_arg`]).
pub(crate) fn parse_kernel_arg(s: &str) -> Result<String, String> {
    if s.is_empty() || s.chars().any(|c| c.is_whitespace() || c == '\0') {
        return Err(format!(
            "{s:?} is not one kernel parameter (it must be non-empty, without spaces); give \
             --kernel-arg once per parameter"
        ));
    }
    spec::check_kernel_arg(s).map_err(|e| e.reason())?;
    Ok(s.to_owned())
}

/// `--vcpus`: 1..=[`MAX_VCPUS`] ([`spec::check_vcpus`]).
pub(crate) fn parse_vcpus(s: &str) -> Result<u8, String> {
    let range = format!("between 1 and {MAX_VCPUS} (the VMM's limit)");
    let n = match s.parse::<u64>() {
        Ok(n) => u8::try_from(n).unwrap_or(0),
        Err(_) => return Err(format!("`{s}` is not a whole number; it must be {range}")),
    };
    spec::check_vcpus(n).map_err(|e| e.reason())?;
    Ok(n)
}

/// `--memory`: MiB within the VMM's limits ([`spec::check_memory_mib`]).
pub(crate) fn parse_memory(s: &str) -> Result<u32, String> {
    let n = match s.parse::<u64>() {
        Ok(n) => u32::try_from(n).unwrap_or(u32::MAX),
        Err(_) => {
            return Err(format!(
                "`{s}` is not a whole number of MiB; it must be between {MIN_MEMORY_MIB} and \
                 {MAX_MEMORY_MIB} MiB (the VMM's limits)"
            ))
        }
    };
    spec::check_memory_mib(n).map_err(|e| e.reason())?;
    Ok(n)
}

/// `--hostname`: 1-64 of `[A-Za-z0-9.-]` (the boot parameter's rule).
pub(crate) fn parse_hostname(s: &str) -> Result<String, String> {
    bulkhead_protocol::boot::check_hostname(s).map_err(|e| e.to_string())?;
    Ok(s.to_owned())
}

/// `--cpu-quota` (of `run` and `create`): a fraction of one host CPU within the spec's range
/// ([`spec::check_limits`]).
pub(crate) fn parse_cpu_quota(s: &str) -> Result<f64, String> {
    let quota: f64 = s
        .parse()
        .map_err(|_| format!("'{s}' is not a positive fraction of one CPU (e.g. 0.5)"))?;
    let limits = ResourceLimits {
        cpu_quota: Some(quota),
        pids_max: None,
    };
    spec::check_limits(&limits, 1).map_err(|e| e.reason())?;
    Ok(quota)
}

/// `--disk`: MiB, at least the sandbox's [`MIN_SCRATCH_MIB`] (whether the file system has room
/// is checked once the image is known).
pub(crate) fn parse_scratch_mib(s: &str) -> Result<u64, String> {
    let range = format!("a whole number of MiB, at least {MIN_SCRATCH_MIB}");
    match s.parse::<u64>() {
        Ok(n) if n >= MIN_SCRATCH_MIB => Ok(n),
        Ok(_) => Err(format!("the scratch disk must be {range}")),
        Err(_) if s.bytes().all(|b| b.is_ascii_digit()) && !s.is_empty() => {
            Err("it is too large: at most 18446744073709551615 MiB".to_owned())
        }
        Err(_) => Err(format!("`{s}` is not {range}")),
    }
}

/// `--timeout`, `--boot-timeout`: seconds (fractions allowed), more than 0 and at least 1 ms,
/// the unit of the agent's `timeout_ms`.
pub(crate) fn parse_positive_seconds(s: &str) -> Result<Duration, String> {
    let secs: f64 = s
        .parse()
        .map_err(|_| format!("`{s}` is not a number of seconds"))?;
    match Duration::try_from_secs_f64(secs) {
        Ok(d) if d >= Duration::from_millis(1) => Ok(d),
        Err(_) if secs > 1.0 => Err("it is too large: at most 1.8e19 seconds".to_owned()),
        _ => Err("it must be a number of seconds of at least 0.001".to_owned()),
    }
}
