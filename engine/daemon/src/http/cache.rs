//! The contexts chat completions keep: the API is stateless, but a request whose messages
//! extend a conversation this uid already holds continues that context, so only its new turn is
//! prefilled. Matched on the turns (the text the context's tokens came from, the answers as the
//! model said them), not on tokens made again from the text: an answer's text does not always
//! encode to the tokens the model generated, and the context holds the latter.
//!
//! A context in use by a request is taken out of the cache until its answer is done, so two
//! requests never continue the same context. The cache holds at most the app's contexts
//! (`--max-contexts-per-app`); the least recently used idle one makes room, and when every one
//! is in use a new conversation waits until one comes back ([`ChatCache::returned`]). After a
//! restart the cache is rebuilt from the daemon's contexts of the app, read once per uid
//! (`list`, `export`).

use std::collections::HashMap;
use std::time::Instant;

use parking_lot::Mutex;
use protocol::{Tool, Turn};
use std::sync::Arc;

use tokio::sync::Notify;

use crate::http::wire::same_turn;

/// A context of the cache and what it holds.
#[derive(Clone, Debug)]
pub struct Held {
    pub context: u64,
    /// Its turns, tools turns left out.
    pub turns: Vec<Turn>,
    /// The tools in force.
    pub tools: Vec<Tool>,
    used: Instant,
}

impl Held {
    /// A context's entry from the turns its transcript records.
    pub fn new(context: u64, recorded: &[Turn]) -> Held {
        let tools = recorded
            .iter()
            .rev()
            .find(|t| t.role == "tools")
            .and_then(|t| serde_json::from_str(&t.text).ok())
            .unwrap_or_default();
        Held {
            context,
            turns: recorded
                .iter()
                .filter(|t| t.role != "tools")
                .cloned()
                .collect(),
            tools,
            used: Instant::now(),
        }
    }
}

#[derive(Default)]
struct Contexts {
    /// Read from the daemon since it started.
    loaded: bool,
    idle: Vec<Held>,
    /// Told, one waiter at a time in the order they began to wait, when a context comes back
    /// idle or is deleted: room for a conversation waiting for one.
    back: Arc<Notify>,
}

/// The chat completions' contexts of every uid (one app name each).
#[derive(Default)]
pub struct ChatCache {
    by_owner: Mutex<HashMap<(u32, String), Contexts>>,
}

impl ChatCache {
    /// Whether the contexts of `owner` were read since the daemon started.
    pub fn loaded(&self, owner: &(u32, String)) -> bool {
        self.by_owner.lock().get(owner).is_some_and(|c| c.loaded)
    }

    /// Records the contexts of `owner` read from the daemon (those in use stay out).
    pub fn load(&self, owner: (u32, String), held: Vec<Held>) {
        let mut m = self.by_owner.lock();
        let c = m.entry(owner).or_default();
        if !c.loaded {
            c.loaded = true;
            c.idle.extend(held);
        }
    }

    /// Takes the idle context whose turns are exactly `prefix` (the request's turns before its
    /// last) with exactly `tools` in force, if any: the request continues it. (Tools are part of
    /// the context's tokens: a context with other tools would answer otherwise.)
    pub fn take(&self, owner: &(u32, String), prefix: &[Turn], tools: &[Tool]) -> Option<Held> {
        let mut m = self.by_owner.lock();
        let c = m.get_mut(owner)?;
        let i = c.idle.iter().position(|h| {
            h.tools == tools
                && h.turns.len() == prefix.len()
                && h.turns.iter().zip(prefix).all(|(a, b)| same_turn(a, b))
        })?;
        Some(c.idle.swap_remove(i))
    }

    /// Takes the least recently used idle context of `owner`, to be deleted for room.
    pub fn take_oldest(&self, owner: &(u32, String)) -> Option<Held> {
        let mut m = self.by_owner.lock();
        let c = m.get_mut(owner)?;
        let i = c
            .idle
            .iter()
            .enumerate()
            .min_by_key(|(_, h)| h.used)
            .map(|(i, _)| i)?;
        Some(c.idle.swap_remove(i))
    }

    /// What tells `owner`'s waiting conversations that a context came back ([`ChatCache::put`],
    /// [`ChatCache::freed`]): one per return, the longest waiting first. Enable its `notified()`
    /// before looking for room, so no return is missed in between.
    pub fn returned(&self, owner: &(u32, String)) -> Arc<Notify> {
        let mut m = self.by_owner.lock();
        Arc::clone(&m.entry(owner.clone()).or_default().back)
    }

    /// A context of `owner` was deleted while in use: one more may be made.
    pub fn freed(&self, owner: &(u32, String)) {
        self.returned(owner).notify_one();
    }

    /// Puts a context back, idle, holding `turns` (tools left out) with `tools` in force.
    pub fn put(&self, owner: (u32, String), context: u64, turns: Vec<Turn>, tools: Vec<Tool>) {
        let held = Held {
            context,
            turns: turns.into_iter().filter(|t| t.role != "tools").collect(),
            tools,
            used: Instant::now(),
        };
        let mut m = self.by_owner.lock();
        let c = m.entry(owner).or_default();
        c.idle.push(held);
        c.back.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::wire::turn;

    #[test]
    fn a_context_is_taken_by_its_exact_turns_once() {
        let cache = ChatCache::default();
        let o = (1000, "http.chat".to_owned());
        let a = vec![turn("user", "hi"), turn("assistant", "hello")];
        cache.put(o.clone(), 1, a.clone(), Vec::new());
        cache.put(o.clone(), 2, vec![turn("user", "other")], Vec::new());
        assert!(cache.take(&o, &a[..1], &[]).is_none());
        assert!(cache.take(&(1001, o.1.clone()), &a, &[]).is_none());
        let tool = Tool {
            name: "f".into(),
            description: String::new(),
            parameters: serde_json::json!({}),
        };
        assert!(cache.take(&o, &a, &[tool]).is_none(), "other tools");
        assert_eq!(cache.take(&o, &a, &[]).map(|h| h.context), Some(1));
        assert!(cache.take(&o, &a, &[]).is_none(), "in use: not taken twice");
        assert_eq!(cache.take_oldest(&o).map(|h| h.context), Some(2));
        assert!(cache.take_oldest(&o).is_none());
    }

    /// Whether `f` is still pending 20 ms on.
    async fn pending<F: std::future::Future>(f: std::pin::Pin<&mut F>) -> bool {
        tokio::time::timeout(std::time::Duration::from_millis(20), f)
            .await
            .is_err()
    }

    #[test]
    fn a_return_wakes_the_longest_waiting_conversation_of_its_owner_only() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        rt.block_on(async {
            let cache = ChatCache::default();
            let (a, b) = ((1000, "a.chat".to_owned()), (1000, "b.chat".to_owned()));
            let back = cache.returned(&a);
            let first = back.notified();
            let second = back.notified();
            tokio::pin!(first, second);
            first.as_mut().enable();
            second.as_mut().enable();
            cache.put(b.clone(), 9, Vec::new(), Vec::new());
            assert!(pending(first.as_mut()).await, "another owner's return");
            cache.put(a.clone(), 1, Vec::new(), Vec::new());
            assert!(!pending(first.as_mut()).await, "the first waiter");
            assert!(
                pending(second.as_mut()).await,
                "one return wakes one waiter"
            );
            cache.freed(&a);
            assert!(!pending(second.as_mut()).await);
        });
    }

    #[test]
    fn tools_turns_are_kept_apart() {
        let tools = r#"[{"name":"f","parameters":{}}]"#;
        let h = Held::new(
            3,
            &[
                turn("tools", tools),
                turn("user", "u"),
                turn("assistant", "a"),
            ],
        );
        assert_eq!(h.turns.len(), 2);
        assert_eq!(h.tools[0].name, "f");
    }
}
