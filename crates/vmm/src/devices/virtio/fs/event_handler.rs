//! Routes the event loop's events to the [`Fs`] device's methods.
//!
//! Registration: [`MutEventSubscriber::init`] watches the activation eventfd. When the driver
//! activates the device, the activation event adds the notification eventfds of the hiprio and
//! request queues (replacing those of an earlier activation after a reset).

use event_manager::{EventOps, EventSet, Events, MutEventSubscriber};

use super::device::{EventSource, Fs};

impl MutEventSubscriber for Fs {
    fn process(&mut self, events: Events, ops: &mut EventOps) {
        match self.event_source(events.fd()) {
            EventSource::Activate => self.on_activate_event(ops),
            EventSource::Queue(index) => self.on_queue_event(index),
            EventSource::Unknown => {
                tracing::debug!("virtio-fs: event on unknown fd {}", events.fd());
            }
        }
    }

    fn init(&mut self, ops: &mut EventOps) {
        if let Err(e) = ops.add(Events::new(self.activate_evt(), EventSet::IN)) {
            tracing::error!("virtio-fs: cannot watch the activation event: {e}");
        }
    }
}
