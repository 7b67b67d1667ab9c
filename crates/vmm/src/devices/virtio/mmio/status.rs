//! The device status field and the transitions a driver may make (virtio 1.2 §2.1 and the
//! initialization sequence of §3.1.1).
//!
//! The driver sets the initialization bits one step at a time, in the order ACKNOWLEDGE → DRIVER
//! → FEATURES_OK → DRIVER_OK; it never clears a bit (§2.1.1) except by writing 0, which resets the
//! device. FAILED may be set at any time; DEVICE_NEEDS_RESET belongs to the device (the driver
//! only echoes it back when it writes status | new_bit). After FAILED or DEVICE_NEEDS_RESET only
//! a reset is accepted.
//!
//! This module only decides whether a write is a valid transition; the transport performs the
//! side effects (feature negotiation, activation, reset).

use virtio_bindings::virtio_config as cfg;

use super::Error;

/// The driver has noticed the device.
pub(super) const ACKNOWLEDGE: u32 = cfg::VIRTIO_CONFIG_S_ACKNOWLEDGE;
/// The driver knows how to drive the device.
pub(super) const DRIVER: u32 = cfg::VIRTIO_CONFIG_S_DRIVER;
/// The driver is set up and ready to drive the device.
pub(super) const DRIVER_OK: u32 = cfg::VIRTIO_CONFIG_S_DRIVER_OK;
/// Feature negotiation is complete.
pub(super) const FEATURES_OK: u32 = cfg::VIRTIO_CONFIG_S_FEATURES_OK;
/// The device hit an error it can only leave through a reset (set by the device).
pub(super) const DEVICE_NEEDS_RESET: u32 = cfg::VIRTIO_CONFIG_S_NEEDS_RESET;
/// The driver has given up on the device.
pub(super) const FAILED: u32 = cfg::VIRTIO_CONFIG_S_FAILED;

/// The initialization bits, in the order the driver must set them (virtio 1.2 §3.1.1).
pub(super) const INIT_STEPS: [u32; 4] = [ACKNOWLEDGE, DRIVER, FEATURES_OK, DRIVER_OK];

/// Every bit virtio 1.2 defines in the status field.
const KNOWN_BITS: u32 =
    ACKNOWLEDGE | DRIVER | DRIVER_OK | FEATURES_OK | DEVICE_NEEDS_RESET | FAILED;

/// What a driver's write to the Status register asks the transport to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Transition {
    /// Nothing new: the write repeats bits already set.
    Unchanged,
    /// The driver wrote 0: reset the device (virtio 1.2 §2.4).
    Reset,
    /// The driver set FAILED.
    Fail,
    /// The driver set these initialization bits (a subset of [`INIT_STEPS`]), to be applied in
    /// [`INIT_STEPS`] order.
    Advance(u32),
}

/// Checks a driver's write of `written` to the Status register, whose value is `current`.
///
/// # Errors
/// [`Error::StatusTransition`] when the write sets undefined bits, clears a bit, skips or
/// reorders an initialization step, or continues initialization after FAILED or
/// DEVICE_NEEDS_RESET.
pub(super) fn transition(current: u32, written: u32) -> Result<Transition, Error> {
    if written == 0 {
        return Ok(Transition::Reset);
    }
    let refuse = |reason| Error::StatusTransition {
        current,
        written,
        reason,
    };
    if written & !KNOWN_BITS != 0 {
        return Err(refuse("undefined status bits"));
    }
    // DEVICE_NEEDS_RESET is the device's bit: ignore it in what the driver writes.
    let held = current & !DEVICE_NEEDS_RESET;
    let wanted = written & !DEVICE_NEEDS_RESET;
    if held & !wanted != 0 {
        return Err(refuse("the driver may only clear status bits by writing 0"));
    }
    let added = wanted & !held;
    if added == 0 {
        return Ok(Transition::Unchanged);
    }
    if added & FAILED != 0 {
        return Ok(Transition::Fail);
    }
    if current & (FAILED | DEVICE_NEEDS_RESET) != 0 {
        return Err(refuse("the device must be reset first"));
    }
    if !is_init_prefix(wanted) {
        return Err(refuse("initialization steps out of order"));
    }
    Ok(Transition::Advance(added))
}

/// Whether `status` is a value the transport can reach (virtio 1.2 §2.1): only defined bits, and
/// the initialization bits none or a prefix of [`INIT_STEPS`]. Checked on restore, where the
/// value comes from a snapshot file.
pub(super) fn is_reachable(status: u32) -> bool {
    let init = status & !(FAILED | DEVICE_NEEDS_RESET);
    status & !KNOWN_BITS == 0 && (init == 0 || is_init_prefix(init))
}

/// Whether `bits` are exactly the first few of [`INIT_STEPS`] (ACKNOWLEDGE, ACKNOWLEDGE | DRIVER,
/// ...), the only shapes a correctly initializing driver produces.
fn is_init_prefix(bits: u32) -> bool {
    let mut prefix = 0;
    INIT_STEPS.iter().any(|step| {
        prefix |= step;
        bits == prefix
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writing_zero_is_a_reset_from_any_state() {
        let from_driver_ok = transition(ACKNOWLEDGE | DRIVER | FEATURES_OK | DRIVER_OK, 0);
        let from_needs_reset = transition(DEVICE_NEEDS_RESET, 0);

        assert_eq!(from_driver_ok.unwrap(), Transition::Reset);
        assert_eq!(from_needs_reset.unwrap(), Transition::Reset);
    }

    #[test]
    fn next_step_in_order_advances() {
        let ack = transition(0, ACKNOWLEDGE);
        let driver_ok = transition(
            ACKNOWLEDGE | DRIVER | FEATURES_OK,
            ACKNOWLEDGE | DRIVER | FEATURES_OK | DRIVER_OK,
        );

        assert_eq!(ack.unwrap(), Transition::Advance(ACKNOWLEDGE));
        assert_eq!(driver_ok.unwrap(), Transition::Advance(DRIVER_OK));
    }

    #[test]
    fn several_steps_in_order_at_once_advance_together() {
        let result = transition(0, ACKNOWLEDGE | DRIVER);

        assert_eq!(result.unwrap(), Transition::Advance(ACKNOWLEDGE | DRIVER));
    }

    #[test]
    fn skipped_step_is_refused() {
        let result = transition(ACKNOWLEDGE, ACKNOWLEDGE | FEATURES_OK);

        assert!(matches!(result, Err(Error::StatusTransition { .. })));
    }

    #[test]
    fn clearing_a_bit_is_refused() {
        let result = transition(ACKNOWLEDGE | DRIVER, ACKNOWLEDGE);

        assert!(matches!(result, Err(Error::StatusTransition { .. })));
    }

    #[test]
    fn undefined_bits_are_refused() {
        let result = transition(ACKNOWLEDGE, ACKNOWLEDGE | DRIVER | 0x10);

        assert!(matches!(result, Err(Error::StatusTransition { .. })));
    }

    #[test]
    fn failed_is_accepted_in_any_state() {
        let result = transition(ACKNOWLEDGE | DRIVER, ACKNOWLEDGE | DRIVER | FAILED);

        assert_eq!(result.unwrap(), Transition::Fail);
    }

    #[test]
    fn continuing_after_needs_reset_is_refused() {
        let current = ACKNOWLEDGE | DRIVER | DEVICE_NEEDS_RESET;

        let result = transition(current, current | FEATURES_OK);

        assert!(matches!(result, Err(Error::StatusTransition { .. })));
    }

    #[test]
    fn echoing_needs_reset_back_changes_nothing() {
        let current = ACKNOWLEDGE | DRIVER | FEATURES_OK | DRIVER_OK | DEVICE_NEEDS_RESET;

        let result = transition(current, current);

        assert_eq!(result.unwrap(), Transition::Unchanged);
    }

    #[test]
    fn continuing_after_failed_is_refused() {
        let result = transition(ACKNOWLEDGE | FAILED, ACKNOWLEDGE | DRIVER | FAILED);

        assert!(matches!(result, Err(Error::StatusTransition { .. })));
    }
    #[test]
    fn reachable_statuses_are_init_prefixes_with_any_failure_bits() {
        let reachable = [
            0,
            ACKNOWLEDGE | DRIVER,
            ACKNOWLEDGE | DRIVER | FEATURES_OK | DRIVER_OK | DEVICE_NEEDS_RESET,
            FAILED,
            ACKNOWLEDGE | FAILED,
        ];
        let unreachable = [
            DRIVER,
            ACKNOWLEDGE | FEATURES_OK,
            DRIVER_OK,
            ACKNOWLEDGE | 0x100,
        ];

        assert!(reachable.into_iter().all(is_reachable));
        assert!(!unreachable.into_iter().any(is_reachable));
    }
}
