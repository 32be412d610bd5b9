//! The daemon's bounded, fair queue: calls wait in one lane per app and are taken round-robin
//! across apps (not first-come across connections), so one busy app cannot starve the others;
//! quick requests (new, list, info, stats, delete) go in a control lane served first. A full lane
//! refuses (the caller answers `busy`) instead of growing.

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;

use parking_lot::{Condvar, Mutex};

/// Why a push was refused; the item comes back to be answered.
#[derive(Debug, PartialEq, Eq)]
pub enum Refused {
    /// The lane is full.
    Busy,
    /// The queue is closed (the daemon is shutting down).
    Closed,
}

struct State<K, T> {
    control: VecDeque<T>,
    lanes: HashMap<K, VecDeque<T>>,
    /// Apps with queued calls, in the order they are served next.
    ring: VecDeque<K>,
    calls: usize,
    closed: bool,
}

/// A bounded queue, fair across keys.
pub struct FairQueue<K, T> {
    state: Mutex<State<K, T>>,
    ready: Condvar,
    capacity: usize,
}

impl<K: Eq + Hash + Clone, T> FairQueue<K, T> {
    /// A queue holding at most `capacity` calls and `capacity` control requests.
    pub fn new(capacity: usize) -> Self {
        Self {
            state: Mutex::new(State {
                control: VecDeque::new(),
                lanes: HashMap::new(),
                ring: VecDeque::new(),
                calls: 0,
                closed: false,
            }),
            ready: Condvar::new(),
            capacity,
        }
    }

    /// Queues a control request (`key` None) or a call of app `key`.
    pub fn push(&self, key: Option<K>, item: T) -> Result<(), (T, Refused)> {
        let mut s = self.state.lock();
        if s.closed {
            return Err((item, Refused::Closed));
        }
        match key {
            None => {
                if s.control.len() >= self.capacity {
                    return Err((item, Refused::Busy));
                }
                s.control.push_back(item);
            }
            Some(k) => {
                if s.calls >= self.capacity {
                    return Err((item, Refused::Busy));
                }
                s.calls += 1;
                let lane = s.lanes.entry(k.clone()).or_default();
                lane.push_back(item);
                if lane.len() == 1 {
                    s.ring.push_back(k);
                }
            }
        }
        drop(s);
        self.ready.notify_one();
        Ok(())
    }

    fn take(s: &mut State<K, T>) -> Option<T> {
        if let Some(t) = s.control.pop_front() {
            return Some(t);
        }
        let k = s.ring.pop_front()?;
        let lane = s.lanes.get_mut(&k).expect("a key in the ring has a lane");
        let t = lane.pop_front().expect("a lane in the ring is not empty");
        if lane.is_empty() {
            s.lanes.remove(&k);
        } else {
            s.ring.push_back(k);
        }
        s.calls -= 1;
        Some(t)
    }

    /// The next item, waiting for one; `None` once the queue is closed.
    pub fn pop(&self) -> Option<T> {
        let mut s = self.state.lock();
        loop {
            if s.closed {
                return None;
            }
            if let Some(t) = Self::take(&mut s) {
                return Some(t);
            }
            self.ready.wait(&mut s);
        }
    }

    /// The next item if there is one.
    pub fn try_pop(&self) -> Option<T> {
        Self::take(&mut self.state.lock())
    }

    /// Closes the queue and returns what was still queued, to be answered.
    pub fn close(&self) -> Vec<T> {
        let mut s = self.state.lock();
        s.closed = true;
        let mut left = Vec::new();
        while let Some(t) = Self::take(&mut s) {
            left.push(t);
        }
        drop(s);
        self.ready.notify_all();
        left
    }

    /// Items queued now.
    pub fn len(&self) -> usize {
        let s = self.state.lock();
        s.control.len() + s.calls
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
        let q = FairQueue::new(100);
        for i in 0..4 {
            q.push(Some("a"), format!("a{i}")).unwrap();
        }
        q.push(Some("b"), "b0".to_owned()).unwrap();
        q.push(Some("c"), "c0".to_owned()).unwrap();
        q.push(None, "list".to_owned()).unwrap();
        q.push(Some("b"), "b1".to_owned()).unwrap();
        let order: Vec<String> = std::iter::from_fn(|| q.try_pop()).collect();
        assert_eq!(order, ["list", "a0", "b0", "c0", "a1", "b1", "a2", "a3"]);
    }

    #[test]
    fn full_and_closed() {
        let q = FairQueue::new(2);
        q.push(Some(1), 1).unwrap();
        q.push(Some(2), 2).unwrap();
        assert_eq!(q.push(Some(3), 3), Err((3, Refused::Busy)));
        q.push(None, 9).unwrap();
        assert_eq!(q.try_pop(), Some(9));
        assert_eq!(q.close(), vec![1, 2]);
        assert_eq!(q.push(None, 4), Err((4, Refused::Closed)));
        assert_eq!(q.pop(), None);
    }

    proptest! {
        /// Against a naive oracle: serve control first, then the app after the last one served
        /// (in first-queued order) that has something queued.
        #[test]
        fn matches_oracle(ops in proptest::collection::vec((0u8..4, any::<bool>()), 0..200)) {
            let q = FairQueue::new(8);
            let mut control: VecDeque<u32> = VecDeque::new();
            let mut lanes: Vec<(u8, VecDeque<u32>)> = Vec::new();
            for (n, (app, pop)) in ops.into_iter().enumerate() {
                let n = n as u32;
                if pop {
                    let want = if let Some(c) = control.pop_front() {
                        Some(c)
                    } else if lanes.is_empty() {
                        None
                    } else {
                        let (k, mut lane) = lanes.remove(0);
                        let t = lane.pop_front();
                        if !lane.is_empty() {
                            lanes.push((k, lane));
                        }
                        t
                    };
                    prop_assert_eq!(q.try_pop(), want);
                } else if app == 3 {
                    let r = q.push(None, n);
                    prop_assert_eq!(r.is_ok(), control.len() < 8);
                    if r.is_ok() {
                        control.push_back(n);
                    }
                } else {
                    let queued: usize = lanes.iter().map(|l| l.1.len()).sum();
                    let r = q.push(Some(app), n);
                    prop_assert_eq!(r.is_ok(), queued < 8);
                    if r.is_ok() {
                        match lanes.iter_mut().find(|l| l.0 == app) {
                            Some(l) => l.1.push_back(n),
                            None => lanes.push((app, VecDeque::from([n]))),
                        }
                    }
                }
                let total = control.len() + lanes.iter().map(|l| l.1.len()).sum::<usize>();
                prop_assert_eq!(q.len(), total);
            }
        }
    }
}
