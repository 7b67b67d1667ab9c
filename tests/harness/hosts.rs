//! The test hosts of one test process: up to [`count`] of them, each booted when a test first
//! needs it, each running several delegated tests at a time.
//!
//! One test host keeps about one of this machine's CPUs busy however many nested guests run in
//! it (measured 2026-12-05: the two vCPU threads of its QEMU added up to ~100 % of one core,
//! with one test or with four), so on a 2-core machine two test hosts run the guest tests about
//! twice as fast as one. A test takes the least busy one ([`lease`]); a test that needs a whole
//! test host (twenty guests at once, a CPU measurement) gets one that runs nothing else.

use std::env;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};

use bulkhead_testhost::{TcgThreads, TestHost, TestHostConfig};

use crate::{artifacts, containerd, python, target_dir, workspace_root};

/// Test hosts booted by this process so far (a dead one replaced counts again); a host's number
/// in the test log is this count at its boot.
static STARTED: AtomicUsize = AtomicUsize::new(0);

/// One place for a test host: the host once booted, with its number.
type Slot = Mutex<Option<(Arc<TestHost>, usize)>>;

/// Who uses one place.
#[derive(Clone, Copy, Default)]
struct PlaceUse {
    /// Tests holding a [`Lease`] on it.
    busy: usize,
    /// One of them holds it alone.
    alone: bool,
    /// A test waits to hold it alone: no new tests go there meanwhile.
    draining: bool,
}

/// Who uses which place, by slot.
struct Use(Vec<PlaceUse>);

impl Use {
    /// The least busy place open to new tests (the first one on a tie).
    fn open(&self) -> Option<usize> {
        (0..self.0.len())
            .filter(|&i| !self.0[i].alone && !self.0[i].draining)
            .min_by_key(|&i| self.0[i].busy)
    }
}

/// How many test hosts a test process boots at most: `BULKHEAD_TEST_HOSTS`, or this machine's
/// CPU count (one test host keeps about one CPU busy), at most 4.
pub fn count() -> usize {
    env::var("BULKHEAD_TEST_HOSTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .clamp(1, 4)
}

fn slots() -> &'static [Slot] {
    static SLOTS: OnceLock<Vec<Slot>> = OnceLock::new();
    SLOTS.get_or_init(|| (0..count()).map(|_| Mutex::new(None)).collect())
}

/// [`Use`] of the [`slots`], and the wake-up of tests waiting for a place.
fn usage() -> &'static (Mutex<Use>, Condvar) {
    static USAGE: OnceLock<(Mutex<Use>, Condvar)> = OnceLock::new();
    USAGE.get_or_init(|| {
        let usage = Use(vec![PlaceUse::default(); count()]);
        (Mutex::new(usage), Condvar::new())
    })
}

/// A test's hold on one test host.
pub(crate) struct Lease {
    place: Place,
    host: Arc<TestHost>,
    number: usize,
}

/// A test's place in [`Use`], given back when dropped (also when booting its host panicked).
struct Place {
    slot: usize,
    alone: bool,
}

/// A place on the least busy test host (booted now when its place is empty); with `alone`, a
/// test host that runs nothing else meanwhile (the least busy one stops taking new tests and is
/// waited for until its tests are done).
///
/// # Panics
/// When the test host cannot be started.
pub(crate) fn lease(alone: bool) -> Lease {
    let (usage, changed) = usage();
    let mut u = usage.lock().unwrap_or_else(|p| p.into_inner());
    let slot = loop {
        match u.open() {
            Some(i) => break i,
            None => u = changed.wait(u).unwrap_or_else(|p| p.into_inner()),
        }
    };
    if alone {
        u.0[slot].draining = true;
        while u.0[slot].busy > 0 {
            u = changed.wait(u).unwrap_or_else(|p| p.into_inner());
        }
        u.0[slot].draining = false;
        u.0[slot].alone = true;
    }
    u.0[slot].busy += 1;
    drop(u);
    let place = Place { slot, alone };
    let (host, number) = current_or_new(&slots()[slot], None);
    Lease {
        place,
        host,
        number,
    }
}

impl Lease {
    /// The test host held.
    pub(crate) fn host(&self) -> &Arc<TestHost> {
        &self.host
    }

    /// The host's number in the test log (`test host #N`).
    pub(crate) fn number(&self) -> usize {
        self.number
    }

    /// Moves to a new test host in the same place after this one died (unless another test
    /// already replaced it).
    pub(crate) fn replace(&mut self) {
        (self.host, self.number) = current_or_new(&slots()[self.place.slot], Some(&self.host));
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        let (usage, changed) = usage();
        let mut u = usage.lock().unwrap_or_else(|p| p.into_inner());
        let place = &mut u.0[self.slot];
        place.busy -= 1;
        if self.alone {
            place.alone = false;
        }
        changed.notify_all();
    }
}

/// The slot's host, booted when there is none or it is `dead`. The slot's lock is held during a
/// boot, so tests that lease the same place meanwhile wait for that one boot.
fn current_or_new(slot: &Slot, dead: Option<&Arc<TestHost>>) -> (Arc<TestHost>, usize) {
    let mut current = slot.lock().unwrap_or_else(|p| p.into_inner());
    if let (Some(dead), Some((host, _))) = (dead, current.as_ref()) {
        if Arc::ptr_eq(dead, host) {
            *current = None;
        }
    }
    let (host, number) = current.get_or_insert_with(|| {
        let number = STARTED.fetch_add(1, Ordering::SeqCst) + 1;
        (Arc::new(start()), number)
    });
    (host.clone(), *number)
}

/// What every test host of this process shares and loads, prepared once (the Python home and
/// containerd's binaries are copied into the target directory: two boots at once must not copy
/// over each other).
fn config() -> TestHostConfig {
    static CONFIG: OnceLock<TestHostConfig> = OnceLock::new();
    CONFIG
        .get_or_init(|| {
            let a = artifacts();
            let mut shares = vec![target_dir(), crate::artifacts::data_home().join("bulkhead")];
            let mut extra_libs_for = vec![
                env::current_exe().expect("test exe"),
                a.vmm.clone(),
                a.cli.clone(),
            ];
            // Python for the Python SDK's integration test (its standard library and the SDK
            // shared, the interpreter's libraries added); without it that test fails with the
            // reason.
            if let Some(py) = python::prepare() {
                shares.extend(py.shares);
                extra_libs_for.push(py.interpreter);
            }
            // containerd for the shim's end-to-end test; without it that test fails with the
            // reason.
            if let Some(binaries) = containerd::prepare() {
                extra_libs_for.extend(binaries);
                shares.push(workspace_root().join("scripts"));
            }
            TestHostConfig {
                // Multi-threaded TCG: with one TCG thread, about 1 in 7 nested guest boots
                // stalled before init (measured here); the rare test-host boot livelock of
                // MTTCG is covered by the test host's boot retry.
                tcg_threads: TcgThreads::Multi,
                // Room for the guests of the tests that run in it at once (scripts/test.sh
                // runs four tests at a time over two test hosts).
                memory_mib: 3072,
                shares,
                extra_libs_for,
                ..TestHostConfig::default()
            }
        })
        .clone()
}

fn start() -> TestHost {
    TestHost::start(config()).unwrap_or_else(|e| panic!("cannot start the nested test host: {e}"))
}

#[cfg(test)]
mod tests {
    use super::{PlaceUse, Use};

    fn usage(busy: &[usize]) -> Use {
        Use(busy
            .iter()
            .map(|&busy| PlaceUse {
                busy,
                ..PlaceUse::default()
            })
            .collect())
    }

    #[test]
    fn a_new_test_goes_to_the_least_busy_test_host_open_to_it() {
        // Arrange
        let mut u = usage(&[1, 0, 2]);
        let even = usage(&[1, 1]);

        // Act / Assert
        assert_eq!(u.open(), Some(1), "the least busy one");
        assert_eq!(even.open(), Some(0), "the first one on a tie");
        u.0[1].draining = true;
        assert_eq!(u.open(), Some(0), "not one that drains for a test alone");
        u.0[0].alone = true;
        assert_eq!(u.open(), Some(2), "not one that a test holds alone");
        u.0[2].alone = true;
        assert_eq!(u.open(), None, "none open: the test waits");
    }
}
