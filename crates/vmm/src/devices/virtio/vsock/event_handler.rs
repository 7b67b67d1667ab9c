//! Routes the event loop's events to the [`Vsock`] device's methods.
//!
//! Registration: [`MutEventSubscriber::init`] watches the activation eventfd and the timeout
//! timer. When the driver activates the device, the activation event adds the three queue
//! notification eventfds; the host listener and the connection sockets are then added, modified
//! and removed after every event to match what the device wants to hear about.

use event_manager::{EventOps, EventSet, Events, MutEventSubscriber};

use super::device::{EventSource, Vsock};

impl MutEventSubscriber for Vsock {
    fn process(&mut self, events: Events, ops: &mut EventOps) {
        let fd = events.fd();
        match self.event_source(fd) {
            EventSource::Activate => self.on_activate_event(ops),
            EventSource::Queue(index) => self.on_queue_event(index),
            EventSource::Listener => self.on_listener_event(),
            EventSource::Timer => self.on_timer_event(),
            EventSource::Socket => self.on_socket_event(fd, events.event_set()),
        }
        self.after_event(ops);
    }

    fn init(&mut self, ops: &mut EventOps) {
        if let Err(e) = ops.add(Events::new(self.activate_evt(), EventSet::IN)) {
            tracing::error!("vsock: cannot watch the activation event: {e}");
        }
        if let Err(e) = ops.add(Events::new(self.timer(), EventSet::IN)) {
            tracing::error!("vsock: cannot watch the connection timer: {e}");
        }
    }
}
