//! `boot_params`: the boot-parameter codec of `bulkhead_protocol::boot`, which the guest agent
//! runs on the kernel command line before anything else.
//!
//! The input is a command line (bytes as UTF-8, lossily). The harness checks that parsing never
//! panics and that whatever parses encodes again and parses back to the same values (the
//! encoder is the parser's exact inverse), and that no encoded parameter contains white space
//! (which would split it on the kernel's command line).

use bulkhead_protocol::boot::BootParams;

/// Runs one input.
///
/// # Panics
/// On a finding: a value that parses but does not encode, or does not round-trip.
pub fn run(data: &[u8]) {
    let cmdline = String::from_utf8_lossy(data);
    let Ok(params) = BootParams::parse(&cmdline) else {
        return;
    };
    let encoded = params
        .to_params()
        .unwrap_or_else(|e| panic!("parsed values do not encode: {e}: {params:?}"));
    assert!(
        encoded
            .iter()
            .all(|p| !p.chars().any(char::is_whitespace) && !p.is_empty()),
        "an encoded parameter holds white space: {encoded:?}"
    );
    let again = BootParams::parse(&encoded.join(" "))
        .unwrap_or_else(|e| panic!("encoded values do not parse: {e}: {encoded:?}"));
    assert_eq!(again, params, "round trip changed the values");
}
