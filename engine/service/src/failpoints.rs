//! Named failpoints (the `fail` crate, as kvfs has them) at each step of the Load and of the AoT
//! writer, which `engine/service/tests/failpoints.rs` drives; docs/service.md ("Failpoints")
//! lists them. With the `failpoints` feature a test arms one: `return` makes the step fail with
//! the error it would have there, `panic` kills the thread right there. Without the feature
//! [`check`] is `Ok(())`, inlined: the name is never looked up and the error never built.

use crate::ServiceError;

/// Passes failpoint `name`: `Err(err(name))` when a test armed it with `return`, a panic when it
/// armed it with `panic`, else `Ok(())`.
#[cfg(feature = "failpoints")]
pub(crate) fn check<E>(name: &'static str, err: impl FnOnce(&'static str) -> E) -> Result<(), E> {
    match fail::eval(name, |_| ()) {
        Some(()) => Err(err(name)),
        None => Ok(()),
    }
}

/// Passes failpoint `name`: without the `failpoints` feature, nothing.
#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub(crate) fn check<E>(_name: &'static str, _err: impl FnOnce(&'static str) -> E) -> Result<(), E> {
    Ok(())
}

/// The error a service failpoint armed with `return` injects where the step's own error is a
/// [`ServiceError`].
pub(crate) fn injected(name: &'static str) -> ServiceError {
    ServiceError::Internal {
        what: format!("failpoint {name}"),
    }
}
