//! The AoT writer's queue and its flush, apart from what a write does: a bounded first-in,
//! first-out queue served by one worker thread, where a flush waits for every job queued before
//! it (not for those queued after, so a busy caller cannot starve it), a closed queue refuses new
//! jobs but its worker drains the queued ones, and a job whose write panics still counts as
//! finished (the worker goes on), so no flush waits forever.
//!
//! Generic over its [`Primitives`] so that `engine/service/tests/models.rs` drives this same code
//! under shuttle's scheduler; [`crate::writer::Writer`] is it with std's, around the real write.

use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::sync::{Primitives, Std};

/// A bounded queue of jobs for one worker, with flush and close.
pub struct WriteQueue<J: Send, S: Primitives = Std> {
    state: S::Mutex<State<J>>,
    /// Signalled when a job is queued and when the queue closes: what the worker waits for.
    work: S::Condvar,
    /// Signalled when a job is taken (room) or finished, and when the queue closes: what
    /// submitters waiting for room and flushes wait for.
    progress: S::Condvar,
    capacity: usize,
}

struct State<J> {
    jobs: VecDeque<J>,
    /// Jobs ever queued.
    submitted: u64,
    /// Jobs finished, written or not. One worker takes the jobs in order, so the first
    /// `finished` jobs queued are exactly the finished ones.
    finished: u64,
    closed: bool,
}

impl<J: Send, S: Primitives> std::fmt::Debug for WriteQueue<J, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteQueue")
            .field("capacity", &self.capacity)
            .finish_non_exhaustive()
    }
}

impl<J: Send, S: Primitives> WriteQueue<J, S> {
    /// A queue holding at most `capacity` jobs (at least one) besides the one being written.
    pub fn new(capacity: usize) -> Self {
        Self {
            state: S::mutex(State {
                jobs: VecDeque::new(),
                submitted: 0,
                finished: 0,
                closed: false,
            }),
            work: S::condvar(),
            progress: S::condvar(),
            capacity: capacity.max(1),
        }
    }

    /// Queues `job`, waiting for room while the queue is full; gives it back if the queue is
    /// closed (before or while it waited).
    pub fn submit(&self, job: J) -> Result<(), J> {
        let mut s = S::lock(&self.state);
        while s.jobs.len() >= self.capacity && !s.closed {
            s = S::wait(&self.progress, s);
        }
        if s.closed {
            return Err(job);
        }
        s.jobs.push_back(job);
        s.submitted += 1;
        drop(s);
        S::notify_one(&self.work);
        Ok(())
    }

    /// Waits until every job queued before this call is finished.
    pub fn flush(&self) {
        let mut s = S::lock(&self.state);
        let target = s.submitted;
        while s.finished < target {
            s = S::wait(&self.progress, s);
        }
    }

    /// Jobs queued or being written.
    pub fn pending(&self) -> u64 {
        let s = S::lock(&self.state);
        s.submitted - s.finished
    }

    /// Refuses new jobs from now on; the worker writes those already queued, then stops.
    pub fn close(&self) {
        S::lock(&self.state).closed = true;
        S::notify_all(&self.work);
        S::notify_all(&self.progress);
    }

    /// The worker's loop, for one thread: takes each job in turn and runs `write` on it, until
    /// the queue is closed and empty. A `write` that panics is caught, reported to `panicked`,
    /// and its job counted finished like any other. A job counts finished only once `write` (or
    /// `panicked`) returned, so whatever they record is there when a flush returns.
    pub fn serve(&self, mut write: impl FnMut(J), mut panicked: impl FnMut()) {
        while let Some(job) = self.take() {
            if catch_unwind(AssertUnwindSafe(|| write(job))).is_err() {
                panicked();
            }
            self.finish();
        }
    }

    /// The next job, waiting for one; `None` once the queue is closed and empty.
    fn take(&self) -> Option<J> {
        let mut s = S::lock(&self.state);
        loop {
            if let Some(job) = s.jobs.pop_front() {
                drop(s);
                S::notify_all(&self.progress);
                return Some(job);
            }
            if s.closed {
                return None;
            }
            s = S::wait(&self.work, s);
        }
    }

    /// Counts the job taken last as finished.
    fn finish(&self) {
        S::lock(&self.state).finished += 1;
        S::notify_all(&self.progress);
    }
}
