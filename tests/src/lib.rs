//! End-to-end tests of llms live in `tests/tests/`; this library holds their shared helpers.
