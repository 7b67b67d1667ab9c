//! The legacy devices in a snapshot: the serial console's UART registers and the i8042.

use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use crate::devices::legacy::i8042::{I8042State, I8042};
use crate::devices::legacy::serial::{SerialDevice, SerialDeviceState};

/// The saved legacy devices.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LegacyState {
    /// The serial console (8250/16550A UART registers and receive FIFO).
    pub serial: SerialDeviceState,
    /// The i8042 (x86_64 only).
    pub i8042: Option<I8042State>,
}

/// The legacy devices of a running VM (the same objects that sit on its buses).
#[derive(Debug, Clone)]
pub(crate) struct LegacyHandles {
    pub(crate) serial: Arc<Mutex<SerialDevice>>,
    pub(crate) i8042: Option<Arc<Mutex<I8042>>>,
}

impl LegacyHandles {
    /// The devices' state.
    pub(crate) fn save(&self) -> LegacyState {
        LegacyState {
            serial: lock(&self.serial).state(),
            i8042: self.i8042.as_ref().map(|i| lock(i).state()),
        }
    }

    /// Puts `state` into the devices.
    ///
    /// # Errors
    /// The device's refusal (an impossible register value, a FIFO over its size), or a state
    /// with or without an i8042 where this VM has none or one.
    pub(crate) fn restore(&self, state: &LegacyState) -> Result<(), String> {
        lock(&self.serial)
            .restore(&state.serial)
            .map_err(|e| format!("serial console: {e}"))?;
        match (&self.i8042, &state.i8042) {
            (Some(dev), Some(saved)) => lock(dev).restore(saved).map_err(|e| format!("i8042: {e}")),
            (None, None) => Ok(()),
            _ => Err("the snapshot's i8042 does not match this VM's".into()),
        }
    }
}

fn lock<T: ?Sized>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
