//! Routes the event loop's events to the [`Block`] device's methods.
//!
//! Registration: [`MutEventSubscriber::init`] watches the activation eventfd. When the driver
//! activates the device, the activation event adds the request queue's notification eventfd
//! (replacing the one of an earlier activation after a reset).

use event_manager::{EventOps, EventSet, Events, MutEventSubscriber};

use super::device::{Block, EventSource};

impl MutEventSubscriber for Block {
    fn process(&mut self, events: Events, ops: &mut EventOps) {
        match self.event_source(events.fd()) {
            EventSource::Activate => self.on_activate_event(ops),
            EventSource::Queue => self.on_queue_event(),
            EventSource::Unknown => {
                tracing::debug!("virtio-blk: event on unknown fd {}", events.fd());
            }
        }
    }

    fn init(&mut self, ops: &mut EventOps) {
        if let Err(e) = ops.add(Events::new(self.activate_evt(), EventSet::IN)) {
            tracing::error!("virtio-blk: cannot watch the activation event: {e}");
        }
    }
}
