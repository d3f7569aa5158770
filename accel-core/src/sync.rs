//! Locks that outlive a panic elsewhere.

use std::sync::{Mutex, MutexGuard};

/// [`Mutex::lock`] that takes a poisoned lock as it is. A thread that panicked while holding
/// one of accel's locks (a hook, a watchdog, a user's closure) has already made the run
/// fail with its own message; every other thread must still reach its error path (report,
/// abort the communicators, exit) instead of panicking on the poison in turn.
pub(crate) trait Locked<T: ?Sized> {
    /// The guard, poisoned or not.
    fn locked(&self) -> MutexGuard<'_, T>;
}

impl<T: ?Sized> Locked<T> for Mutex<T> {
    fn locked(&self) -> MutexGuard<'_, T> {
        self.lock().unwrap_or_else(|e| e.into_inner())
    }
}
