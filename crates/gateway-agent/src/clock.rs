//! Clocks for the shell. The engine itself never reads one: every engine operation
//! takes `now` in nanoseconds.
//!
//! Every clock here is monotonic (FIELD-NOTES: governor's TSC clock was not, across
//! cores, and rejected early). [`CoarseClock`] trades resolution (100 us by default)
//! for a read that is one atomic load.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A monotonic nanosecond clock.
pub trait Clock: Send + Sync {
    /// Nanoseconds since the clock's origin. Never decreases.
    fn now_ns(&self) -> u64;
}

/// `std::time::Instant`, from its creation.
#[derive(Debug, Clone, Copy)]
pub struct MonotonicClock {
    origin: Instant,
}

impl MonotonicClock {
    /// A clock whose origin is now.
    pub fn new() -> MonotonicClock {
        MonotonicClock {
            origin: Instant::now(),
        }
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    fn now_ns(&self) -> u64 {
        self.origin.elapsed().as_nanos() as u64
    }
}

/// A clock a test or the simulator sets by hand.
#[derive(Debug, Default)]
pub struct ManualClock {
    ns: AtomicU64,
}

impl ManualClock {
    /// A clock at `ns`.
    pub fn new(ns: u64) -> ManualClock {
        ManualClock {
            ns: AtomicU64::new(ns),
        }
    }

    /// Moves the clock forward by `ns` (never back).
    pub fn advance(&self, ns: u64) {
        self.ns.fetch_add(ns, Ordering::AcqRel);
    }
}

impl Clock for ManualClock {
    fn now_ns(&self) -> u64 {
        self.ns.load(Ordering::Acquire)
    }
}

/// A monotonic clock read with one atomic load; a background thread advances it every
/// `resolution`. Dropping the last handle's [`CoarseClockDriver`] stops the thread.
#[derive(Debug, Clone)]
pub struct CoarseClock {
    ns: Arc<AtomicU64>,
}

/// Owns the thread that advances a [`CoarseClock`].
#[derive(Debug)]
pub struct CoarseClockDriver {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl CoarseClock {
    /// Starts a coarse clock with the given resolution.
    pub fn start(resolution: Duration) -> (CoarseClock, CoarseClockDriver) {
        let origin = Instant::now();
        let ns = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let ns = Arc::clone(&ns);
            let stop = Arc::clone(&stop);
            std::thread::Builder::new()
                .name("bursar-clock".into())
                .spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        ns.fetch_max(origin.elapsed().as_nanos() as u64, Ordering::AcqRel);
                        std::thread::sleep(resolution);
                    }
                })
                .expect("spawn clock thread")
        };
        (
            CoarseClock { ns },
            CoarseClockDriver {
                stop,
                thread: Some(thread),
            },
        )
    }
}

impl Clock for CoarseClock {
    #[inline]
    fn now_ns(&self) -> u64 {
        self.ns.load(Ordering::Acquire)
    }
}

impl Drop for CoarseClockDriver {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coarse_clock_advances_and_never_goes_back() {
        let (clock, _driver) = CoarseClock::start(Duration::from_micros(100));
        let mut last = clock.now_ns();
        let deadline = Instant::now() + Duration::from_millis(50);
        while Instant::now() < deadline {
            let now = clock.now_ns();
            assert!(now >= last);
            last = now;
        }
        assert!(last > 0, "the clock must have advanced in 50 ms");
    }

    #[test]
    fn manual_clock_moves_only_forward() {
        let c = ManualClock::new(5);
        c.advance(10);
        assert_eq!(c.now_ns(), 15);
    }
}
