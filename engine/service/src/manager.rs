//! The context manager: runs one call of one context against managed memory.
//!
//! A call, top-down (docs/service.md numbers the same steps):
//! 1. Load: the context is pinned (its pager region locked against reclaim) and its missing
//!    chunks come back ([`crate::load`]), while the engine thread encodes a text prompt
//!    ([`Prompt::Later`]); the switch latency is measured from the request's arrival to the end of
//!    the Load.
//! 2. Run: the tokens left open at the end of the last call, then the prompt, are prefilled and
//!    the answer generated; new chunks are Claimed in the pager under the budget.
//! 3. Compress: the call's attention is merged into the context's densities (Eq. 1) and
//!    `policy::assign_levels` (Eq. 2-3) moves chunks down a level (by default from int8 to
//!    k8v8, k4v4 or k4v3, at most 4.5 stored bits per value on average); their slots shrink.
//! 4. AoT: the tokens are made durable, then `policy::plan_writeout` lists the chunks to write
//!    and the background writer writes them; the call returns without waiting for it.
//! 5. The context is unpinned; its chunks are now candidates for Reclaim (LCTRU order).

use protocol::{Latency, ServiceStats, ServiceWeights};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use kvfs::{Fingerprint, NewContext, Store, StoreOptions};
use policy::{CostModel, Level, LinearCost};
use uffd_pager::{
    ChunkKey, ContextId, ContextSpec, Histogram, HistogramSummary, Pager, PagerConfig,
};

use crate::ServiceError;
use crate::call::{Call, CallOptions, CallReport, Compression, Context, Owner, Prompt, Ran};
use crate::chooser::PolicyChooser;
use crate::chunk_io::ChunkIo;
use crate::chunks::{ChunkBook, StoredCopy};
use crate::config::{ManagerConfig, VictimPolicy, WriteOut};
use crate::load::{self, LoadMode, LoadReport};
use crate::memory::PagerChunks;
use crate::source::{FormatLevels, StoreSource, model_fingerprint};
use crate::writer::Writer;
use model::Model;
use model::kv::KvCache;
use model::tokenizer::Tokenizer;

/// The manager's parts a call of context `$id` works with ([`Call`]), borrowed field by field so
/// that one of the manager's contexts can be borrowed mutably beside them.
macro_rules! call_parts {
    ($m:expr, $id:expr) => {
        Call {
            model: &$m.model,
            cfg: &$m.cfg,
            io: &$m.io,
            pager: &$m.pager,
            cost: &$m.cost,
            book: &$m.book,
            writer: &$m.writer,
            compression: &$m.compression,
            tokenizer: $m.tokenizer.as_deref(),
            id: $id,
        }
    };
}

mod shared;
mod transcripts;

/// A context as `list` shows it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ContextSummary {
    pub id: u64,
    pub app: String,
    pub tokens: usize,
    pub chunks: usize,
    pub resident_chunks: usize,
    pub resident_bytes: u64,
    /// Chunks per format, in memory's view.
    pub formats: BTreeMap<&'static str, usize>,
    pub calls: u64,
    /// How many of its first chunks it borrows from shared prefixes (a fork's parent's, or
    /// another context's of the same owner with the same first tokens).
    pub shared_chunks: usize,
}

/// A pager histogram as the wire's latencies, in milliseconds.
pub fn latency(h: HistogramSummary) -> Latency {
    let ms = |ns: u64| ns as f64 / 1e6;
    Latency {
        count: h.count,
        mean_ms: ms(h.mean_ns),
        p50_ms: ms(h.p50_ns),
        p99_ms: ms(h.p99_ns),
        max_ms: ms(h.max_ns),
    }
}

/// Measured points for the cost model.
#[derive(Default)]
struct Profile {
    io: Vec<(f64, f64)>,
    re: Vec<(f64, f64)>,
}

impl Profile {
    const KEEP: usize = 64;
    /// A read this many times slower or faster than the model predicted means the disk changed
    /// (a throttle, another tenant, the page cache): the earlier points describe another disk.
    /// (At 3, a throttle going from 50 to 20 MiB/s, 2.6 times slower, was averaged away: an
    /// 8k context's Loads stayed predicted at 1.0 s while they took 2.6 s, docs/bench-long.md.)
    const IO_SHIFT: f64 = 2.0;

    /// Adds a measured read; when it is off the model's prediction by more than
    /// [`Profile::IO_SHIFT`] either way, the earlier points are dropped first, so the model
    /// follows a changed disk within one Load instead of averaging it away.
    fn add_io(&mut self, p: (f64, f64), model: LinearCost) {
        let predicted = model.eval(p.0);
        if predicted > 0.0 && p.1 > 0.0 {
            let ratio = p.1 / predicted;
            if !(1.0 / Self::IO_SHIFT..=Self::IO_SHIFT).contains(&ratio) {
                tracing::debug!(ratio, "disk speed changed: I/O model restarts");
                self.io.clear();
            }
        }
        Self::add(&mut self.io, p);
    }

    fn add(v: &mut Vec<(f64, f64)>, p: (f64, f64)) {
        if v.len() == Self::KEEP {
            v.remove(0);
        }
        v.push(p);
    }

    /// Least squares over the points; while they all share one size (the same context loaded
    /// again), the cost is taken as proportional to the size, keeping the fixed part.
    fn refit(&self, cost: &mut CostModel) {
        fn one(points: &[(f64, f64)], old: LinearCost) -> LinearCost {
            if let Ok(f) = LinearCost::fit(points) {
                return f.cost;
            }
            let mut per: Vec<f64> = points
                .iter()
                .filter(|(x, _)| *x > 0.0)
                .map(|(x, y)| (y - old.fixed()).max(0.0) / x)
                .collect();
            if per.is_empty() {
                return old;
            }
            per.sort_by(f64::total_cmp);
            LinearCost::new(old.fixed(), per[per.len() / 2]).unwrap_or(old)
        }
        cost.io = one(&self.io, cost.io);
        cost.recompute = one(&self.re, cost.recompute);
    }
}

/// Runs calls of many contexts under one KV budget. One thread owns it (the daemon's engine
/// thread); the pager's fault thread and the AoT writer work beside it.
pub struct Manager {
    model: Arc<Model>,
    cfg: ManagerConfig,
    store: Arc<Store>,
    /// Chunk reads and writes (through the mount when there is one); the pager's source and the
    /// writer hold it too, and the mount goes when the last of them does.
    io: Arc<ChunkIo>,
    pager: Arc<Pager>,
    /// Each chunk's version, format, density and stored copy; the pager's source and the writer
    /// hold it too.
    book: Arc<ChunkBook>,
    writer: Writer,
    compression: Compression,
    fingerprint: Fingerprint,
    contexts: BTreeMap<u64, Context>,
    /// Contexts the store holds that another model made, with their owner's uid: kept untouched,
    /// and a call on one answers [`ServiceError::OtherModel`].
    other_model: BTreeMap<u64, u32>,
    /// The shared prefixes contexts borrow chunks from, each a pager context of its own.
    prefixes: BTreeMap<u64, shared::Prefix>,
    /// The Load's I/O threads (`ManagerConfig::io_threads`), parked between Loads, and their
    /// read buffers.
    readers: load::Readers,
    cost: CostModel,
    profile: Profile,
    calls: u64,
    chunks_read: u64,
    chunks_recomputed: u64,
    window_slides: u64,
    switch: Histogram,
    /// Decode tokens measured for weight reads, and the bytes they read.
    decode_tokens: u64,
    decode_read_bytes: u64,
    /// The model's tokenizer, once the daemon gives it ([`Manager::show_text_with`]): answers
    /// are decoded into transcripts with it, and contexts of another model rebuilt.
    tokenizer: Option<Arc<Tokenizer>>,
}

impl std::fmt::Debug for Manager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Manager")
            .field("contexts", &self.contexts.len())
            .finish_non_exhaustive()
    }
}

impl Manager {
    /// Opens the store (recovering it after a crash), starts the pager and the writer, and
    /// takes back every context the store holds; none of their chunks is resident yet.
    pub fn open(model: Arc<Model>, mut cfg: ManagerConfig) -> Result<Manager, ServiceError> {
        if cfg.chunk_tokens == 0 {
            cfg.chunk_tokens = model.cfg.chunk_tokens();
        }
        if cfg.max_tokens < cfg.chunk_tokens {
            return Err(ServiceError::BadRequest {
                what: format!(
                    "chunks of {} tokens and contexts of at most {} tokens do not fit",
                    cfg.chunk_tokens, cfg.max_tokens
                ),
            });
        }
        let compression = compression_of(&model, &cfg)?;
        let fingerprint =
            model_fingerprint(model.path()).map_err(|source| ServiceError::Start {
                what: format!("reading {} to fingerprint it", model.path().display()),
                source,
            })?;
        std::fs::create_dir_all(&cfg.store).map_err(|source| ServiceError::Start {
            what: format!("creating the store {}", cfg.store.display()),
            source,
        })?;
        let store = Arc::new(Store::open(&cfg.store, StoreOptions::default())?);
        let io = Arc::new(match &cfg.mount {
            Some(at) => ChunkIo::mounted(
                Arc::clone(&store),
                fingerprint,
                at,
                cfg.mount_guard.as_ref(),
            )?,
            None => ChunkIo::direct(Arc::clone(&store), fingerprint),
        });
        let shape = model.chunk_shape(cfg.chunk_tokens);
        let book = Arc::new(ChunkBook::default());
        let pager = start_pager(&cfg, shape, &io, &book)?;
        store.set_residency(
            super::inspect::residency(Arc::downgrade(&pager)).map_err(|e| ServiceError::Start {
                what: "starting the residency thread".into(),
                source: e,
            })?,
        );
        let writer = Writer::spawn(
            Arc::clone(&io),
            Arc::clone(&pager),
            Arc::clone(&book),
            cfg.writer_queue,
        )
        .map_err(|source| ServiceError::Start {
            what: "starting the writer thread".into(),
            source,
        })?;
        let readers = load::Readers::new(cfg.io_threads, io.mountpoint().is_some())?;
        let mut m = Manager {
            cost: cfg.cost,
            model,
            cfg,
            store,
            io,
            pager,
            book,
            writer,
            compression,
            fingerprint,
            contexts: BTreeMap::new(),
            other_model: BTreeMap::new(),
            prefixes: BTreeMap::new(),
            readers,
            profile: Profile::default(),
            calls: 0,
            chunks_read: 0,
            chunks_recomputed: 0,
            window_slides: 0,
            switch: Histogram::default(),
            decode_tokens: 0,
            decode_read_bytes: 0,
            tokenizer: None,
        };
        for id in m.store.list_contexts() {
            // A shared prefix is taken back with the first context that borrows from it.
            if m.store.is_shared(id).unwrap_or(false) {
                continue;
            }
            if let Err(e) = m.resume(id.0) {
                tracing::warn!(context = id.0, error = %e, "context not taken back");
            }
        }
        tracing::info!(contexts = m.contexts.len(), "context manager open");
        Ok(m)
    }

    /// Context `id` as the store holds it, with its first `tokens.len() / chunk` chunks sealed
    /// (borrowed ones from the shared prefixes its links name, taken back first) and none
    /// resident.
    fn new_context(
        &mut self,
        id: u64,
        owner: Owner,
        tokens: Vec<u32>,
    ) -> Result<Context, ServiceError> {
        let shape = self.model.chunk_shape(self.cfg.chunk_tokens);
        let lineage = self.lineage_of(id)?;
        let max_chunks = self.cfg.max_tokens.div_ceil(self.cfg.chunk_tokens) as u32;
        self.pager.add_context(
            ContextId(id),
            ContextSpec {
                max_chunks,
                max_slot_bytes: shape.slot_bytes(self.cfg.kv_format),
            },
        )?;
        let shared_lineage = Arc::new(parking_lot::Mutex::new(lineage.clone()));
        let mem = Box::new(PagerChunks::new(
            Arc::clone(&self.pager),
            ContextId(id),
            Arc::clone(&self.book),
            Arc::clone(&shared_lineage),
        ));
        let mut density =
            model::kv::received::group_density(&shape, self.model.cfg.n_heads as u32)?;
        let t = self.cfg.chunk_tokens;
        let sealed = tokens.len() / t;
        let mut formats = vec![self.cfg.kv_format; sealed];
        let mut seeds = Vec::new();
        let mut infos = vec![self.store.context(ContextId(id)).ok()];
        infos.extend(lineage.prefixes().map(|p| self.store.context(p).ok()));
        for (info, c) in infos
            .iter()
            .flatten()
            .flat_map(|i| i.chunks.iter().map(move |c| (i, c)))
        {
            if let kvfs::StoreState::Stored(s) = &c.state
                && (c.index as usize) < sealed
                && s.tokens.len() == t
                && lineage.owner(c.index) == info.id
            {
                self.book
                    .set_stored(lineage.key(c.index), Some(StoredCopy::from(s)));
                formats[c.index as usize] = s.format;
                seeds.push((c.index as usize, s.density));
            }
        }
        // Densities come back from the chunk headers as if one query had seen each token: the
        // ranking of chunks is kept, the weight of their history is not. A chunk's header holds
        // the density it was compressed by, its global layers' once past the window, and seeds
        // both groups.
        density.seed(sealed, &seeds)?;
        let mut cache = KvCache::resume(
            shape,
            self.cfg.kv_format,
            self.cfg.max_tokens,
            mem,
            tokens[..sealed * t].to_vec(),
            formats,
        )?;
        cache.set_shared(self.borrowed_cut(&lineage))?;
        self.book.set_formats(
            ContextId(id),
            cache.chunk_formats(),
            &density.chunk_densities(cache.trimmed_chunks()),
        );
        self.book.set_trimmed(ContextId(id), cache.trimmed_chunks());
        Ok(Context {
            owner,
            cache,
            pending: tokens[sealed * t..].to_vec(),
            density,
            calls: 0,
            turns: None,
            lineage: shared_lineage,
        })
    }

    /// Takes back a context the store holds.
    fn resume(&mut self, id: u64) -> Result<(), ServiceError> {
        let meta = self.store.meta(ContextId(id))?;
        if meta.fingerprint != self.fingerprint {
            self.other_model.insert(id, meta.owner_uid);
            return Err(ServiceError::OtherModel { id });
        }
        let tokens = self.store.tokens(ContextId(id))?;
        if meta.chunk_tokens as usize != self.cfg.chunk_tokens {
            // This model's context in chunks of another size (a store of an older default): its
            // tokens and transcript are kept, its chunks dropped, and its next Load recomputes
            // them.
            let transcript = self.store.transcript(ContextId(id))?;
            let new = NewContext {
                owner_uid: meta.owner_uid,
                app: meta.app.clone(),
                fingerprint: self.fingerprint,
                chunk_tokens: self.cfg.chunk_tokens as u32,
            };
            self.store
                .rebuild_context(ContextId(id), new, &tokens, transcript.as_deref())?;
            tracing::info!(
                context = id,
                from = meta.chunk_tokens,
                to = self.cfg.chunk_tokens,
                "context stored in chunks of another size: its chunks are recomputed"
            );
        }
        let owner = Owner {
            uid: meta.owner_uid,
            app: meta.app.clone(),
        };
        let turns = self.recorded_turns(id, &tokens);
        let mut ctx = self.new_context(id, owner, tokens)?;
        ctx.turns = turns;
        self.contexts.insert(id, ctx);
        Ok(())
    }

    /// Makes room in a full context for a prompt of `prompt` tokens and an answer of up to
    /// `answer`: keeps the first chunk (the attention sink) and the most recent tokens, at most
    /// half the context so the next slide is many calls away, and drops the rest. The store's
    /// tokens are replaced durably (its chunks past the sink go with them); the kept tokens after
    /// the sink are left open, so the call prefills them again with its prompt. Returns the
    /// tokens dropped.
    fn slide(&mut self, id: u64, prompt: usize, answer: usize) -> Result<usize, ServiceError> {
        let (t, max) = (self.cfg.chunk_tokens, self.cfg.max_tokens);
        let ctx = self.contexts.get(&id).expect("the caller checked it");
        let mut said = ctx.cache.tokens().to_vec();
        said.extend_from_slice(&ctx.pending);
        let sink = t.min(said.len());
        let room = max.saturating_sub(prompt + 1 + answer.min(max / 4));
        let keep = (max / 2).min(room).max(sink);
        let recent = keep - sink;
        let mut kept = said[..sink].to_vec();
        kept.extend_from_slice(&said[said.len() - recent..]);
        let dropped = said.len() - kept.len();
        let (owner, calls, turns) = (ctx.owner.clone(), ctx.calls, ctx.turns.clone());
        tracing::info!(
            ctx = id,
            dropped,
            kept = kept.len(),
            "context full: window slides"
        );
        // A queued write of an old chunk must not land on the new tokens.
        self.writer.flush();
        // The transcript keeps every turn, and names the kept tokens as its own.
        if let Some(turns) = &turns {
            let file = crate::transcript::encode(turns, turns, &kept);
            self.store.write_transcript(ContextId(id), &file)?;
        }
        self.store.replace_tokens(ContextId(id), kept.clone())?;
        self.forget(id)?;
        let mut ctx = self.new_context(id, owner, kept[..sink].to_vec())?;
        ctx.pending = kept[sink..].to_vec();
        ctx.calls = calls;
        ctx.turns = turns;
        self.contexts.insert(id, ctx);
        self.prune_prefixes();
        self.window_slides += 1;
        Ok(dropped)
    }

    /// Forgets a context's memory and takes it back from the store.
    fn reload(&mut self, id: u64) -> Result<(), ServiceError> {
        self.forget(id)?;
        self.resume(id)
    }

    /// Forgets context `id`'s memory (the store keeps it): its queued writes land first, then its
    /// pager region, its chunks' book and its open mount files go.
    fn forget(&mut self, id: u64) -> Result<Option<Context>, ServiceError> {
        self.writer.flush();
        let ctx = self.contexts.remove(&id);
        self.pager.remove_context(ContextId(id))?;
        self.book.forget(ContextId(id));
        self.io.forget(id);
        Ok(ctx)
    }

    /// Creates a context for `owner`, optionally starting with `system` tokens (prefilled with
    /// the first call's prompt). Durable when it returns.
    pub fn create(&mut self, owner: &Owner, system: &[u32]) -> Result<u64, ServiceError> {
        if system.len() > self.cfg.max_tokens {
            return Err(ServiceError::BadRequest {
                what: format!(
                    "a system prompt of {} tokens exceeds the context length of {}",
                    system.len(),
                    self.cfg.max_tokens
                ),
            });
        }
        let id = self.store.create_context(NewContext {
            owner_uid: owner.uid,
            app: owner.app.clone(),
            fingerprint: self.fingerprint,
            chunk_tokens: self.cfg.chunk_tokens as u32,
        })?;
        if !system.is_empty() {
            self.store.append_tokens(id, system)?;
        }
        let mut ctx = self.new_context(id.0, owner.clone(), Vec::new())?;
        ctx.pending = system.to_vec();
        self.contexts.insert(id.0, ctx);
        self.adopt_prefix(id.0)?;
        Ok(id.0)
    }

    fn owned(&mut self, owner: &Owner, id: u64) -> Result<&mut Context, ServiceError> {
        match self.contexts.get_mut(&id) {
            Some(c) if c.owner.uid == owner.uid => Ok(c),
            None if self.other_model.get(&id) == Some(&owner.uid) => {
                Err(ServiceError::OtherModel { id })
            }
            _ => Err(ServiceError::NotFound { id }),
        }
    }

    /// Runs one call: appends `prompt` to the context, generates up to `opts.max_tokens`
    /// tokens, streaming each to `on_token` (return false to stop). `received` is when the
    /// request arrived: the switch latency counts from it.
    pub fn call(
        &mut self,
        owner: &Owner,
        id: u64,
        prompt: &[u32],
        opts: &CallOptions,
        received: Instant,
        on_token: impl FnMut(u32) -> bool,
    ) -> Result<CallReport, ServiceError> {
        self.call_with(owner, id, Prompt::Tokens(prompt), opts, received, on_token)
    }

    /// Gives the memory the engine's buffers freed back to the kernel (the C allocator's free
    /// pages, [`uffd_pager::sys::release_free_heap`]): a long call's transient buffers would
    /// otherwise stay resident until the same threads allocate as much again. It takes 1-3 ms,
    /// so the daemon calls it after a call's answer is sent, when no request waits.
    pub fn release_memory(&self) {
        let t = Instant::now();
        let released = uffd_pager::sys::release_free_heap();
        tracing::debug!(
            released,
            ms = t.elapsed().as_secs_f64() * 1e3,
            "freed heap memory given back"
        );
    }

    /// [`Manager::call`] with a prompt that may be encoded while the context's chunks are read.
    pub fn call_with(
        &mut self,
        owner: &Owner,
        id: u64,
        prompt: Prompt<'_>,
        opts: &CallOptions,
        received: Instant,
        on_token: impl FnMut(u32) -> bool,
    ) -> Result<CallReport, ServiceError> {
        let _span = tracing::info_span!("call", ctx = id).entered();
        self.owned(owner, id)?;
        self.adopt_prefix(id)?;
        let window_dropped = self.slide_if_full(id, &prompt, opts.max_tokens)?;
        let ctx = self.contexts.get_mut(&id).expect("owned checked it");
        ctx.cache.pin()?;
        // Weight reads per decode token: between two streamed tokens the engine runs exactly one
        // one-token pass, and when a token is handed over that pass's reads are all done (the
        // next pass has not asked for any yet), so the counter is read at each token.
        let model = Arc::clone(&self.model);
        let read = || {
            model.stream_counters().map_or(0, |c| {
                c.bytes_read.load(std::sync::atomic::Ordering::Relaxed)
            })
        };
        let (mut first, mut last, mut streamed) = (0, 0, 0u64);
        let mut on_token = on_token;
        let counted = |t: u32| {
            let now = read();
            if streamed == 0 {
                first = now;
            }
            last = now;
            streamed += 1;
            on_token(t)
        };
        let call = call_parts!(self, id);
        let r = call.run(&mut self.readers, ctx, prompt, opts, received, counted);
        if streamed > 1 {
            self.decode_tokens += streamed - 1;
            self.decode_read_bytes += last - first;
        }
        let ctx = self.contexts.get_mut(&id).expect("still there");
        ctx.cache.unpin();
        let report = match r {
            Ok(Ran::Done(r)) => CallReport {
                window_dropped,
                ..r
            },
            Ok(Ran::Full { tokens, load }) => {
                // The prompt, encoded during the Load, does not fit beside the context: the call
                // starts again with its tokens, which slides the window (the Load's chunks are
                // read for nothing, a small cost beside the slide's prefill).
                self.chunks_read += load.read.len() as u64;
                self.chunks_recomputed += load.recomputed.len() as u64;
                self.learn(&load);
                return self.call_with(
                    owner,
                    id,
                    Prompt::Tokens(&tokens),
                    opts,
                    received,
                    on_token,
                );
            }
            Err(e) => {
                // The context goes back to its last completed call, as the store holds it.
                tracing::warn!(ctx = id, error = %e, "call failed; the context is reloaded");
                if let Err(e2) = self.reload(id) {
                    tracing::error!(ctx = id, error = %e2, "reloading the context failed");
                }
                return Err(e);
            }
        };
        self.calls += 1;
        self.chunks_read += report.load.read.len() as u64;
        self.chunks_recomputed += report.load.recomputed.len() as u64;
        self.switch
            .record(std::time::Duration::from_secs_f64(report.switch_secs));
        self.learn(&report.load);
        Ok(report)
    }

    /// Brings every missing chunk of context `id` back, as a call's Load does, without a call:
    /// the app's next call then finds them resident (`prewarm`). The context is pinned only
    /// while it runs; its chunks are then the most recently used, the last the pager reclaims. A
    /// failed Load reloads the context from the store, as a failed call does.
    pub fn prewarm(&mut self, owner: &Owner, id: u64) -> Result<LoadReport, ServiceError> {
        let _span = tracing::info_span!("prewarm", ctx = id).entered();
        self.owned(owner, id)?;
        let ctx = self.contexts.get_mut(&id).expect("owned checked it");
        ctx.cache.pin()?;
        let call = call_parts!(self, id);
        let r = call.load(&mut self.readers, ctx, Prompt::Tokens(&[]));
        ctx.cache.unpin();
        match r {
            Ok((_, load)) => {
                self.chunks_read += load.read.len() as u64;
                self.chunks_recomputed += load.recomputed.len() as u64;
                self.learn(&load);
                Ok(load)
            }
            Err(e) => {
                tracing::warn!(ctx = id, error = %e, "prewarm failed; the context is reloaded");
                if let Err(e2) = self.reload(id) {
                    tracing::error!(ctx = id, error = %e2, "reloading the context failed");
                }
                Err(e)
            }
        }
    }

    /// Slides context `id`'s window when a prompt known too long would not fit beside it (one
    /// encoded during the Load is decided after it: `run_call` hands it back, and the call starts
    /// again); returns the tokens dropped. A prompt that cannot fit even beside the sink chunk,
    /// or any overflow without the window, is refused.
    fn slide_if_full(
        &mut self,
        id: u64,
        prompt: &Prompt<'_>,
        max_tokens: usize,
    ) -> Result<usize, ServiceError> {
        let ctx = self.contexts.get(&id).expect("owned checked it");
        let said = ctx.cache.len() + ctx.pending.len();
        let Prompt::Tokens(t) = prompt else {
            return Ok(0);
        };
        if said + t.len() < self.cfg.max_tokens {
            return Ok(0);
        }
        let n = t.len();
        // The window keeps at least the sink chunk beside the prompt.
        let sink = self.cfg.chunk_tokens.min(said);
        if !self.cfg.window || sink + n + 1 > self.cfg.max_tokens {
            return Err(ServiceError::Kv(model::kv::KvError::Full {
                len: said,
                adding: n + 1,
                max: self.cfg.max_tokens,
            }));
        }
        self.slide(id, n, max_tokens)
    }

    fn learn(&mut self, load: &LoadReport) {
        if !load.read.is_empty() && load.failed_reads.is_empty() {
            self.profile
                .add_io((load.read_bytes as f64, load.io_secs), self.cost.io);
        }
        if !load.recomputed.is_empty() {
            Profile::add(
                &mut self.profile.re,
                (load.recomputed.len() as f64, load.recompute_secs),
            );
        }
        self.profile.refit(&mut self.cost);
    }

    /// Deletes a context: its memory, its store directory.
    pub fn delete(&mut self, owner: &Owner, id: u64) -> Result<(), ServiceError> {
        if self.other_model.get(&id) == Some(&owner.uid) {
            // Another model's context: its owner may delete it (it never reached the pager).
            self.store.delete_context(ContextId(id))?;
            self.other_model.remove(&id);
            return Ok(());
        }
        self.owned(owner, id)?;
        self.forget(id)?;
        self.store.delete_context(ContextId(id))?;
        self.prune_prefixes();
        Ok(())
    }

    /// The owner's contexts.
    pub fn list(&self, owner: &Owner) -> Vec<ContextSummary> {
        self.contexts
            .iter()
            .filter(|(_, c)| c.owner.uid == owner.uid)
            .map(|(&id, c)| self.summary(id, c))
            .collect()
    }

    /// One context, as `list` shows it.
    pub fn info(&self, owner: &Owner, id: u64) -> Result<ContextSummary, ServiceError> {
        match self.contexts.get(&id) {
            Some(c) if c.owner.uid == owner.uid => Ok(self.summary(id, c)),
            None if self.other_model.get(&id) == Some(&owner.uid) => {
                Err(ServiceError::OtherModel { id })
            }
            _ => Err(ServiceError::NotFound { id }),
        }
    }

    fn summary(&self, id: u64, c: &Context) -> ContextSummary {
        let mut formats = BTreeMap::new();
        for f in c.cache.chunk_formats() {
            *formats.entry(f.name()).or_insert(0) += 1;
        }
        let chunks = c.cache.chunk_formats().len();
        let lineage = c.lineage.lock().clone();
        let resident_chunks = (0..chunks)
            .filter(|&i| {
                self.pager
                    .chunk_info(lineage.key(i as u32))
                    .is_ok_and(|s| s.state == uffd_pager::MemoryState::Resident)
            })
            .count();
        ContextSummary {
            id,
            app: c.owner.app.clone(),
            tokens: c.cache.len() + c.pending.len(),
            chunks,
            resident_chunks,
            resident_bytes: self.pager.context_resident(ContextId(id)).unwrap_or(0),
            formats,
            calls: c.calls,
            shared_chunks: c.cache.shared(),
        }
    }

    /// Service-wide counters.
    pub fn stats(&self) -> ServiceStats {
        let p = self.pager.stats();
        let w = self.writer.stats();
        use std::sync::atomic::Ordering::Relaxed;
        ServiceStats {
            manager: self.cfg.kind.name().to_owned(),
            budget_bytes: self.pager.budget(),
            resident_bytes: self.pager.resident_bytes(),
            contexts: self.contexts.len(),
            shared_prefixes: self.prefixes.len(),
            shared_resident_bytes: self.shared_prefixes().1,
            calls: self.calls,
            chunks_read: self.chunks_read,
            chunks_recomputed: self.chunks_recomputed,
            faults: p.faults,
            reclaims: p.reclaims,
            unwritten_reclaims: p.unpersisted_reclaims,
            sync_reclaims: p.sync_reclaims,
            window_slides: self.window_slides,
            writes: w.written.load(Relaxed),
            write_failures: w.failed.load(Relaxed),
            writes_queued: self.writer.queued(),
            load_buffer_bytes: self.readers.buffer_bytes() as u64,
            load_buffer_huge_bytes: self.readers.huge_bytes() as u64,
            load_io_uring: self.readers.uses_io_uring(),
            switch: latency(self.switch.summary()),
            weights: self.weight_stats(),
        }
    }

    /// The weights' holding and reads.
    fn weight_stats(&self) -> ServiceWeights {
        use std::sync::atomic::Ordering::Relaxed;
        let h = self.model.holding();
        let held = self.model.weight_bytes() as u64;
        ServiceWeights {
            budget_bytes: h.budget,
            residency: h.residency,
            resident_bytes: held + h.buffer_bytes,
            buffer_bytes: h.buffer_bytes,
            streamed_bytes: h.streamed_bytes_per_token,
            bytes_read: self
                .model
                .stream_counters()
                .map_or(0, |c| c.bytes_read.load(Relaxed)),
            decode_tokens: self.decode_tokens,
            read_bytes_per_token: if self.decode_tokens == 0 {
                0.0
            } else {
                self.decode_read_bytes as f64 / self.decode_tokens as f64
            },
        }
    }

    /// Changes the KV budget (memory pressure); returns the bytes freed at once.
    pub fn set_budget(&self, bytes: u64) -> Result<u64, ServiceError> {
        Ok(self.pager.set_budget(bytes)?)
    }

    /// Waits until every chunk queued for write-out is written.
    pub fn flush(&self) {
        self.writer.flush();
    }

    /// Drops every resident chunk of a context from memory (they come back on its next call):
    /// what memory pressure does to an idle context, on demand. Chunks not written out are
    /// written first unless the manager never writes (LMK).
    pub fn swap_out(&mut self, owner: &Owner, id: u64) -> Result<u64, ServiceError> {
        self.owned(owner, id)?;
        let max = self.pager.context_chunks(ContextId(id))?;
        let mut freed = 0;
        for i in 0..max {
            match self.pager.evict(ChunkKey::new(id, i)) {
                Ok(b) => freed += b,
                Err(uffd_pager::PagerError::NotResident { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(freed)
    }

    /// Changes how missing chunks come back (the baselines are load modes of the one manager).
    pub fn set_load_mode(&mut self, mode: LoadMode) {
        self.cfg.load = mode;
    }

    /// The pager, for measurements (RSS of a context's region, counters).
    pub fn pager(&self) -> &Pager {
        &self.pager
    }

    /// The pager, shared: its budget may be set from another thread (memory pressure).
    pub fn shared_pager(&self) -> Arc<Pager> {
        Arc::clone(&self.pager)
    }

    /// The store.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Shows each context's text in the store's `text` files (and so in the mount) as `tokenizer`,
    /// this model's, decodes it (contexts of another model are not decoded by it); calls that
    /// give their turn record their answers decoded by it, and contexts of another model are
    /// rebuilt from their transcripts with it.
    pub fn show_text_with(&mut self, tokenizer: Arc<Tokenizer>) {
        self.store.set_decoder(
            self.fingerprint,
            super::inspect::decoder(Arc::clone(&tokenizer)),
        );
        self.tokenizer = Some(tokenizer);
    }

    /// Where the store is mounted (chunks move through the mount), if it is.
    pub fn mountpoint(&self) -> Option<&std::path::Path> {
        self.io.mountpoint()
    }

    /// The cost model the planner uses now.
    pub fn cost(&self) -> CostModel {
        self.cost
    }

    /// The most tokens a context holds (its window).
    pub fn max_tokens(&self) -> usize {
        self.cfg.max_tokens
    }

    /// Tokens per chunk.
    pub fn chunk_tokens(&self) -> usize {
        self.cfg.chunk_tokens
    }

    /// The model.
    pub fn model(&self) -> &Model {
        &self.model
    }
}

/// The compression of sealed chunks `cfg` asks for: its levels, and the ratio of stored bits
/// to the base format's that the density assignment meets (none without `compress_bits`).
fn compression_of(model: &Model, cfg: &ManagerConfig) -> Result<Compression, ServiceError> {
    let levels =
        FormatLevels::new(&model.chunk_shape(cfg.chunk_tokens), &cfg.levels).map_err(|e| {
            ServiceError::BadRequest {
                what: e.to_string(),
            }
        })?;
    // A budget the levels cannot reach (a small model's chunks amortize kvfs's header over
    // few values) puts every chunk at the lightest level.
    let ratio = match cfg.compress_bits {
        Some(bits) if levels.floor(cfg.kv_format).is_some() => {
            Some(levels.ratio_for_bits(bits).unwrap_or_else(|e| {
                tracing::warn!(error = %e, "every chunk compressed to the lightest level");
                let set = levels.set();
                set.ratio(set.lightest()).unwrap_or(1.0)
            }))
        }
        _ => None,
    };
    Ok(Compression { levels, ratio })
}

/// The pager over the store's chunks: its source reads them through `io` (and writes them back
/// unless write-out is off), its chooser picks victims by `cfg.victims`.
fn start_pager(
    cfg: &ManagerConfig,
    shape: model::kv::ChunkShape,
    io: &Arc<ChunkIo>,
    book: &Arc<ChunkBook>,
) -> Result<Arc<Pager>, ServiceError> {
    let slot = shape.slot_bytes(cfg.kv_format);
    let source = Arc::new(StoreSource::new(
        Arc::clone(io),
        Arc::clone(book),
        shape,
        cfg.write_out != WriteOut::Never,
    ));
    let sizes: Vec<(u64, Level)> = cfg
        .levels
        .iter()
        .enumerate()
        .map(|(l, &f)| (shape.slot_bytes(f) as u64, Level(l as u8)))
        .collect();
    let chooser = Box::new(match cfg.victims {
        VictimPolicy::Lctru => PolicyChooser::new(Box::new(policy::LctruQueue::new()), sizes),
        VictimPolicy::Lru => PolicyChooser::new(Box::new(policy::ChunkLru::new()), sizes),
        VictimPolicy::Context => {
            PolicyChooser::whole_contexts(Box::new(policy::WholeContextLru::swapping()), sizes)
        }
    });
    Ok(Arc::new(Pager::with_chooser(
        PagerConfig::new(cfg.kv_budget, slot),
        source,
        chooser,
    )?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_io_model_follows_a_throttled_disk_within_one_load() {
        let mut profile = Profile::default();
        let mut cost = crate::config::default_cost();
        // A fast disk: 1 GB/s over contexts of 1, 2 and 4 MB.
        for mb in [1.0, 2.0, 4.0, 1.0, 2.0, 4.0] {
            profile.add_io((mb * 1e6, 1e-4 + mb * 1e-3), cost.io);
            profile.refit(&mut cost);
        }
        assert!((cost.io.per_unit() - 1e-9).abs() < 1e-11);
        // Within noise: kept with the others.
        profile.add_io((2e6, 1.5 * (1e-4 + 2e-3)), cost.io);
        assert_eq!(profile.io.len(), 7);
        // Throttled to 50 MB/s: the earlier points go, the model takes the new speed at once.
        profile.add_io((4e6, 80e-3), cost.io);
        assert_eq!(profile.io.len(), 1);
        profile.refit(&mut cost);
        let predicted = cost.io.eval(4e6);
        assert!((predicted - 80e-3).abs() < 1e-3, "{predicted}");
        for _ in 0..5 {
            profile.add_io((4e6, 80e-3), cost.io);
            profile.refit(&mut cost);
        }
        // Then to 20 MB/s, 2.5 times slower: followed too, not outvoted by the points before.
        for _ in 0..3 {
            profile.add_io((4e6, 200e-3), cost.io);
            profile.refit(&mut cost);
        }
        let predicted = cost.io.eval(4e6);
        assert!((predicted - 200e-3).abs() < 2e-3, "{predicted}");
    }
}
