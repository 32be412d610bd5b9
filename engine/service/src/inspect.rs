//! What the service shows people who inspect its kvfs mount: the model's tokenizer as the store's
//! decoder (each context's `text`) and the pager's residency (each chunk's `resident`), given to
//! kvfs as closures so kvfs knows nothing of models or of the pager (docs/kvfs.md, "What a
//! person inspecting sees").

use std::sync::mpsc::{self, SyncSender};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use uffd_pager::{ChunkKey, ContextId, Pager};

use model::tokenizer::Tokenizer;

/// How long a mount thread waits for the pager's answer before showing residency as unknown.
const RESIDENCY_WAIT: Duration = Duration::from_millis(200);
/// Questions queued for the residency thread; past that a question is answered "unknown" at once.
const RESIDENCY_QUEUE: usize = 8;

/// The tokenizer as a kvfs decoder: the context's text as the model sees it, control tokens
/// (`<|im_start|>`, `<|im_end|>`, ...) kept visible as their text, so chat turns show with their
/// roles.
pub fn decoder(tokenizer: Arc<Tokenizer>) -> kvfs::Decoder {
    Arc::new(move |ids: &[u32]| tokenizer.decode(ids))
}

type Question = (ContextId, SyncSender<Option<Vec<bool>>>);

/// The pager's residency as a kvfs hook. A mount thread never waits on the pager itself: it
/// hands the question to a thread of its own and waits at most [`RESIDENCY_WAIT`], so a busy
/// pager never holds a thread the mount needs (the chunk reads and write-backs go through it).
/// That thread holds the pager weakly (the mount never keeps it alive) and ends when the hook is
/// dropped.
pub fn residency(pager: Weak<Pager>) -> std::io::Result<kvfs::Residency> {
    let (ask, questions) = mpsc::sync_channel::<Question>(RESIDENCY_QUEUE);
    std::thread::Builder::new()
        .name("llms-residency".into())
        .spawn(move || {
            for (ctx, reply) in questions {
                let answer = pager.upgrade().and_then(|p| resident_chunks(&p, ctx));
                let _ = reply.send(answer);
            }
        })?;
    let ask = Mutex::new(ask);
    Ok(Arc::new(move |ctx: kvfs::ContextId| {
        let (reply, answer) = mpsc::sync_channel(1);
        ask.lock().try_send((ctx, reply)).ok()?;
        answer.recv_timeout(RESIDENCY_WAIT).ok().flatten()
    }))
}

/// Which of a context's chunks are resident now; `None` for a context the pager does not hold.
fn resident_chunks(pager: &Pager, ctx: ContextId) -> Option<Vec<bool>> {
    let n = pager.context_chunks(ctx).ok()?;
    Some(
        (0..n)
            .map(|index| {
                pager
                    .chunk_info(ChunkKey { ctx, index })
                    .is_ok_and(|c| c.state == uffd_pager::MemoryState::Resident)
            })
            .collect(),
    )
}
