//! The synchronisation primitives the service's hand-made concurrent pieces are built on, as a
//! type parameter: parking_lot's in production ([`Std`], the name of the default), shuttle's in the model tests ([`Shuttle`], with
//! the `shuttle` feature), so a model test drives the very code that runs in production.
//!
//! The pieces generic over it: the AoT writer's queue and flush ([`crate::writer::WriteQueue`]),
//! the chunks' book ([`crate::chunks::ChunkBook`]) and the daemon's fair queue
//! (`daemon::queue::FairQueue`). Each defaults to [`Std`], so production code names none of this;
//! `engine/service/tests/models.rs` and `engine/daemon/tests/models.rs` are the models.
//! parking_lot's locks do not poison; shuttle's poisoned lock is taken as it is: every piece keeps
//! its state consistent between statements that could panic.

use std::ops::DerefMut;

/// A mutex and a condition variable, as a family of types.
pub trait Primitives: 'static {
    /// A mutex holding a `T`.
    type Mutex<T: Send>: Send + Sync;
    /// A held lock of a [`Primitives::Mutex`].
    type Guard<'a, T: Send + 'a>: DerefMut<Target = T>;
    /// A condition variable.
    type Condvar: Send + Sync;

    /// A mutex holding `value`.
    fn mutex<T: Send>(value: T) -> Self::Mutex<T>;
    /// Takes the lock (a poisoned one too).
    fn lock<T: Send>(mutex: &Self::Mutex<T>) -> Self::Guard<'_, T>;
    /// A condition variable.
    fn condvar() -> Self::Condvar;
    /// Releases `guard`, waits for a notification (or a spurious wake-up), takes the lock again.
    fn wait<'a, T: Send>(condvar: &Self::Condvar, guard: Self::Guard<'a, T>) -> Self::Guard<'a, T>;
    /// Wakes one waiter.
    fn notify_one(condvar: &Self::Condvar);
    /// Wakes every waiter.
    fn notify_all(condvar: &Self::Condvar);
}

/// parking_lot's primitives: what production uses (no poisoning to recover from).
#[derive(Debug)]
pub enum Std {}

impl Primitives for Std {
    type Mutex<T: Send> = parking_lot::Mutex<T>;
    type Guard<'a, T: Send + 'a> = parking_lot::MutexGuard<'a, T>;
    type Condvar = parking_lot::Condvar;

    fn mutex<T: Send>(value: T) -> Self::Mutex<T> {
        parking_lot::Mutex::new(value)
    }

    fn lock<T: Send>(mutex: &Self::Mutex<T>) -> Self::Guard<'_, T> {
        mutex.lock()
    }

    fn condvar() -> Self::Condvar {
        parking_lot::Condvar::new()
    }

    fn wait<'a, T: Send>(
        condvar: &Self::Condvar,
        mut guard: Self::Guard<'a, T>,
    ) -> Self::Guard<'a, T> {
        condvar.wait(&mut guard);
        guard
    }

    fn notify_one(condvar: &Self::Condvar) {
        condvar.notify_one();
    }

    fn notify_all(condvar: &Self::Condvar) {
        condvar.notify_all();
    }
}

/// shuttle's primitives, whose every lock, wait and notification is a scheduling point of
/// shuttle's randomized scheduler; they work only inside a shuttle test (`shuttle::check_random`).
#[cfg(feature = "shuttle")]
#[derive(Debug)]
pub enum Shuttle {}

#[cfg(feature = "shuttle")]
impl Primitives for Shuttle {
    type Mutex<T: Send> = shuttle::sync::Mutex<T>;
    type Guard<'a, T: Send + 'a> = shuttle::sync::MutexGuard<'a, T>;
    type Condvar = shuttle::sync::Condvar;

    fn mutex<T: Send>(value: T) -> Self::Mutex<T> {
        shuttle::sync::Mutex::new(value)
    }

    fn lock<T: Send>(mutex: &Self::Mutex<T>) -> Self::Guard<'_, T> {
        mutex.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn condvar() -> Self::Condvar {
        shuttle::sync::Condvar::new()
    }

    fn wait<'a, T: Send>(condvar: &Self::Condvar, guard: Self::Guard<'a, T>) -> Self::Guard<'a, T> {
        condvar.wait(guard).unwrap_or_else(|e| e.into_inner())
    }

    fn notify_one(condvar: &Self::Condvar) {
        condvar.notify_one();
    }

    fn notify_all(condvar: &Self::Condvar) {
        condvar.notify_all();
    }
}
