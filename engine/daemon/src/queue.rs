//! The daemon's bounded, fair queue: calls wait in one lane per app and are taken round-robin
//! across apps (not first-come across connections), so one busy app cannot starve the others;
//! quick requests (new, list, info, stats, delete) go in a control lane served first; idle work
//! (`prewarm`) waits in lanes of its own, round-robin across apps too, taken only when no
//! control request and no call waits, so it never delays a call that is queued. A full lane
//! refuses (the caller answers `busy`) instead of growing.
//!
//! Generic over its [`Primitives`] (std's by default) so that `engine/daemon/tests/models.rs`
//! drives this same code under shuttle's scheduler.

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;

use service::sync::{Primitives, Std};

/// Why a push was refused; the item comes back to be answered.
#[derive(Debug, PartialEq, Eq)]
pub enum Refused {
    /// The lane is full.
    Busy,
    /// The queue is closed (the daemon is shutting down).
    Closed,
}

/// Where a request waits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Lane<K> {
    /// Quick requests, served first, in order.
    Control,
    /// A call of app `K`: round-robin across apps.
    Call(K),
    /// Idle work of app `K` (prewarm): round-robin across apps, only when no control request
    /// and no call waits.
    Idle(K),
}

/// One app lane per key, served round-robin.
struct Fair<K, T> {
    lanes: HashMap<K, VecDeque<T>>,
    /// Apps with queued items, in the order they are served next.
    ring: VecDeque<K>,
    len: usize,
}

impl<K: Eq + Hash + Clone, T> Fair<K, T> {
    fn new() -> Self {
        Self {
            lanes: HashMap::new(),
            ring: VecDeque::new(),
            len: 0,
        }
    }

    fn push(&mut self, k: K, item: T) {
        self.len += 1;
        let lane = self.lanes.entry(k.clone()).or_default();
        lane.push_back(item);
        if lane.len() == 1 {
            self.ring.push_back(k);
        }
    }

    fn take(&mut self) -> Option<T> {
        let k = self.ring.pop_front()?;
        let lane = self
            .lanes
            .get_mut(&k)
            .expect("a key in the ring has a lane");
        let t = lane.pop_front().expect("a lane in the ring is not empty");
        if lane.is_empty() {
            self.lanes.remove(&k);
        } else {
            self.ring.push_back(k);
        }
        self.len -= 1;
        Some(t)
    }
}

struct State<K, T> {
    control: VecDeque<T>,
    calls: Fair<K, T>,
    idle: Fair<K, T>,
    closed: bool,
}

/// A bounded queue, fair across keys.
pub struct FairQueue<K: Send, T: Send, S: Primitives = Std> {
    state: S::Mutex<State<K, T>>,
    ready: S::Condvar,
    capacity: usize,
}

impl<K: Eq + Hash + Clone + Send, T: Send, S: Primitives> FairQueue<K, T, S> {
    /// A queue holding at most `capacity` calls, `capacity` control requests and `capacity`
    /// idle requests.
    pub fn new(capacity: usize) -> Self {
        Self {
            state: S::mutex(State {
                control: VecDeque::new(),
                calls: Fair::new(),
                idle: Fair::new(),
                closed: false,
            }),
            ready: S::condvar(),
            capacity,
        }
    }

    fn lock(&self) -> S::Guard<'_, State<K, T>> {
        S::lock(&self.state)
    }

    /// Queues `item` in `lane`.
    pub fn push(&self, lane: Lane<K>, item: T) -> Result<(), (T, Refused)> {
        let mut s = self.lock();
        if s.closed {
            return Err((item, Refused::Closed));
        }
        let held = match &lane {
            Lane::Control => s.control.len(),
            Lane::Call(_) => s.calls.len,
            Lane::Idle(_) => s.idle.len,
        };
        if held >= self.capacity {
            return Err((item, Refused::Busy));
        }
        match lane {
            Lane::Control => s.control.push_back(item),
            Lane::Call(k) => s.calls.push(k, item),
            Lane::Idle(k) => s.idle.push(k, item),
        }
        drop(s);
        S::notify_one(&self.ready);
        Ok(())
    }

    fn take(s: &mut State<K, T>) -> Option<T> {
        s.control
            .pop_front()
            .or_else(|| s.calls.take())
            .or_else(|| s.idle.take())
    }

    /// The next item, waiting for one; `None` once the queue is closed.
    pub fn pop(&self) -> Option<T> {
        let mut s = self.lock();
        loop {
            if s.closed {
                return None;
            }
            if let Some(t) = Self::take(&mut s) {
                return Some(t);
            }
            s = S::wait(&self.ready, s);
        }
    }

    /// The next item if there is one.
    pub fn try_pop(&self) -> Option<T> {
        Self::take(&mut self.lock())
    }

    /// Closes the queue and returns what was still queued, to be answered.
    pub fn close(&self) -> Vec<T> {
        let mut s = self.lock();
        s.closed = true;
        let mut left = Vec::new();
        while let Some(t) = Self::take(&mut s) {
            left.push(t);
        }
        drop(s);
        S::notify_all(&self.ready);
        left
    }

    /// Items queued now.
    pub fn len(&self) -> usize {
        let s = self.lock();
        s.control.len() + s.calls.len + s.idle.len
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_robin_across_apps() {
        let q: FairQueue<_, _> = FairQueue::new(100);
        for i in 0..4 {
            q.push(Lane::Call("a"), format!("a{i}")).unwrap();
        }
        q.push(Lane::Call("b"), "b0".to_owned()).unwrap();
        q.push(Lane::Call("c"), "c0".to_owned()).unwrap();
        q.push(Lane::Control, "list".to_owned()).unwrap();
        q.push(Lane::Call("b"), "b1".to_owned()).unwrap();
        let order: Vec<String> = std::iter::from_fn(|| q.try_pop()).collect();
        assert_eq!(order, ["list", "a0", "b0", "c0", "a1", "b1", "a2", "a3"]);
    }

    #[test]
    fn idle_work_waits_for_every_call_and_control_request() {
        let q: FairQueue<_, _> = FairQueue::new(100);
        q.push(Lane::Idle("a"), "warm a0").unwrap();
        q.push(Lane::Idle("a"), "warm a1").unwrap();
        q.push(Lane::Idle("b"), "warm b0").unwrap();
        q.push(Lane::Call("b"), "call b0").unwrap();
        q.push(Lane::Control, "list").unwrap();
        assert_eq!(q.try_pop(), Some("list"));
        assert_eq!(q.try_pop(), Some("call b0"));
        assert_eq!(q.try_pop(), Some("warm a0"));
        // A call queued after idle work is still served first.
        q.push(Lane::Call("a"), "call a0").unwrap();
        let order: Vec<&str> = std::iter::from_fn(|| q.try_pop()).collect();
        assert_eq!(order, ["call a0", "warm b0", "warm a1"]);
    }

    #[test]
    fn full_and_closed() {
        let q: FairQueue<_, _> = FairQueue::new(2);
        q.push(Lane::Call(1), 1).unwrap();
        q.push(Lane::Call(2), 2).unwrap();
        assert_eq!(q.push(Lane::Call(3), 3), Err((3, Refused::Busy)));
        q.push(Lane::Idle(3), 7).unwrap();
        q.push(Lane::Idle(3), 8).unwrap();
        assert_eq!(q.push(Lane::Idle(1), 6), Err((6, Refused::Busy)));
        q.push(Lane::Control, 9).unwrap();
        assert_eq!(q.try_pop(), Some(9));
        assert_eq!(q.close(), vec![1, 2, 7, 8]);
        assert_eq!(q.push(Lane::Control, 4), Err((4, Refused::Closed)));
        assert_eq!(q.pop(), None);
    }

    /// The naive oracle's app lanes: served in first-queued order, an app that still has items
    /// goes to the back.
    fn oracle_take(lanes: &mut Vec<(u8, VecDeque<u32>)>) -> Option<u32> {
        if lanes.is_empty() {
            return None;
        }
        let (k, mut lane) = lanes.remove(0);
        let t = lane.pop_front();
        if !lane.is_empty() {
            lanes.push((k, lane));
        }
        t
    }

    fn oracle_push(lanes: &mut Vec<(u8, VecDeque<u32>)>, app: u8, n: u32) {
        match lanes.iter_mut().find(|l| l.0 == app) {
            Some(l) => l.1.push_back(n),
            None => lanes.push((app, VecDeque::from([n]))),
        }
    }

    fn held(lanes: &[(u8, VecDeque<u32>)]) -> usize {
        lanes.iter().map(|l| l.1.len()).sum()
    }

    proptest! {
        /// Against a naive oracle: serve control first, then the app after the last one served
        /// (in first-queued order) that has a call queued, then likewise for idle work.
        #[test]
        fn matches_oracle(ops in proptest::collection::vec((0u8..7, any::<bool>()), 0..200)) {
            let q: FairQueue<_, _> = FairQueue::new(8);
            let mut control: VecDeque<u32> = VecDeque::new();
            let mut calls: Vec<(u8, VecDeque<u32>)> = Vec::new();
            let mut idle: Vec<(u8, VecDeque<u32>)> = Vec::new();
            for (n, (op, pop)) in ops.into_iter().enumerate() {
                let n = n as u32;
                if pop {
                    let want = control
                        .pop_front()
                        .or_else(|| oracle_take(&mut calls))
                        .or_else(|| oracle_take(&mut idle));
                    prop_assert_eq!(q.try_pop(), want);
                } else if op == 6 {
                    let r = q.push(Lane::Control, n);
                    prop_assert_eq!(r.is_ok(), control.len() < 8);
                    if r.is_ok() {
                        control.push_back(n);
                    }
                } else {
                    let (app, lanes, lane) = if op < 3 {
                        (op, &mut calls, Lane::Call(op))
                    } else {
                        (op - 3, &mut idle, Lane::Idle(op - 3))
                    };
                    let room = held(lanes) < 8;
                    let r = q.push(lane, n);
                    prop_assert_eq!(r.is_ok(), room);
                    if r.is_ok() {
                        oracle_push(lanes, app, n);
                    }
                }
                let total = control.len() + held(&calls) + held(&idle);
                prop_assert_eq!(q.len(), total);
            }
        }
    }
}
