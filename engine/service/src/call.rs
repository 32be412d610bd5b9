//! One call of one context, in the order docs/service.md numbers its steps: Load (the context's
//! missing chunks back, the prompt encoded meanwhile), Run (prefill and generate), Compress (the
//! attention received moves chunks down a level, Eq. 1-3) and AoT write-out (the tokens made
//! durable, then the chunks queued for the writer). `Manager::call` pins the context and hands
//! this module the manager's parts ([`Call`]); the context's own state is [`Context`].

use std::sync::Arc;
use std::time::Instant;

use model::Model;
use model::generate::generate_guided;
use model::generate::{Generation, Sampler, SamplingParams, StopReason};
use model::guided::{Guide, Next};
use model::kv::{KvCache, KvFormat};
use policy::{CostModel, GroupDensity, Level};
use uffd_pager::{ChunkKey, ContextId, Pager};

use crate::ServiceError;
use crate::chunk_io::ChunkIo;
use crate::chunks::{ChunkBook, StoredCopy};
use crate::config::{ManagerConfig, WriteOut};
use crate::lineage::Lineage;
use crate::load::{self, LoadReport};
use crate::source::FormatLevels;
use crate::transcript::{self, Role, Turn};
use crate::writer::{WriteJob, Writer};

/// The compression levels and the policy's global ratio the bit budget comes to, fixed at open.
#[derive(Clone, Debug)]
pub(crate) struct Compression {
    pub(crate) levels: FormatLevels,
    pub(crate) ratio: Option<f64>,
}

/// Who owns a context: the peer's uid and the app name it gave.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Owner {
    pub uid: u32,
    pub app: String,
}

/// One call's options.
#[derive(Clone, Debug)]
pub struct CallOptions {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Token ids that end the answer (not included in it).
    pub stop: Vec<u32>,
    /// The answer's format (structured output): every token is chosen among those that keep
    /// the answer in the grammar, and the stop tokens only where it may end.
    pub format: Option<Arc<guide::Grammar>>,
    /// The prompt as turns of the context's transcript (a user turn, raw text, a tool's result,
    /// after the tools it declares): recorded with the answer (an assistant turn, a tool call,
    /// or raw text) when the call's tokens are made durable. Empty records nothing, and a
    /// context whose earlier calls were not recorded records none.
    pub turns: Vec<Turn>,
    /// Whether the answer may be a tool call: one that is (the template's markers around the
    /// call) is recorded as a `tool_call` turn.
    pub tool_calls: bool,
}

impl Default for CallOptions {
    fn default() -> Self {
        Self {
            max_tokens: protocol::DEFAULT_MAX_TOKENS,
            sampling: SamplingParams::default(),
            stop: Vec::new(),
            format: None,
            turns: Vec::new(),
            tool_calls: false,
        }
    }
}

/// The grammar's matcher as the model's guide.
struct Guided(guide::Matcher);

impl Guide for Guided {
    fn constrain(&mut self, logits: &mut [f32], remaining: usize) -> Next {
        match self.0.constrain(logits, remaining) {
            guide::Step::Sample => Next::Sample,
            guide::Step::End => Next::End,
        }
    }

    fn advance(&mut self, token: u32) {
        self.0.advance(token);
    }
}

/// A call's prompt: its tokens, or text the engine thread encodes while the Load's reads are in
/// flight, so a switch costs the longer of the two rather than their sum (encoding a few hundred
/// tokens takes about as long as reading a few chunks). The window is decided after the Load, on
/// the real length.
pub enum Prompt<'a> {
    Tokens(&'a [u32]),
    Later(Box<dyn FnOnce() -> Vec<u32> + 'a>),
}

impl<'a> Prompt<'a> {
    /// A prompt encoded by `encode` during the Load.
    pub fn later(encode: impl FnOnce() -> Vec<u32> + 'a) -> Prompt<'a> {
        Prompt::Later(Box::new(encode))
    }

    pub(crate) fn into_tokens(self) -> std::borrow::Cow<'a, [u32]> {
        match self {
            Prompt::Tokens(t) => t.into(),
            Prompt::Later(encode) => encode().into(),
        }
    }
}

impl std::fmt::Debug for Prompt<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Prompt::Tokens(t) => f.debug_tuple("Tokens").field(&t.len()).finish(),
            Prompt::Later(_) => f.write_str("Later"),
        }
    }
}

/// How a call ended.
pub(crate) enum Ran {
    Done(CallReport),
    /// The prompt, encoded during the Load, does not fit beside the context; nothing changed but
    /// the chunks the Load brought back.
    Full {
        tokens: Vec<u32>,
        load: LoadReport,
    },
}

/// What a call did.
#[derive(Clone, Debug, serde::Serialize)]
pub struct CallReport {
    /// The generated tokens.
    pub tokens: Vec<u32>,
    /// Why generation stopped.
    pub stop: &'static str,
    /// Request received to every chunk of the context resident, seconds.
    pub switch_secs: f64,
    /// The Load's parts and the plan's prediction.
    pub load: LoadReport,
    /// The prompt's tokens.
    pub prompt_tokens: usize,
    /// Tokens prefilled (the previous call's open tail and the prompt).
    pub prefill_tokens: usize,
    pub prefill_secs: f64,
    pub decode_secs: f64,
    /// Chunks moved down a level at the end of the call.
    pub recompressed: usize,
    /// Chunks queued for write-out.
    pub queued_writes: usize,
    /// Tokens the sliding window dropped before this call (0 when the context had room).
    pub window_dropped: usize,
    /// Tokens the context held when the call arrived.
    pub context_before: usize,
    /// Seconds the answer's format took (masks and steps), over every token.
    pub guide_secs: f64,
    /// Token masks the answer's format computed (the others came from its cache).
    pub guide_masks: usize,
    /// The call's end after its last token: densities, recompression, the tokens and turns made
    /// durable and the write-out queued (steps 3 and 4).
    pub end_secs: f64,
}

/// One context as the manager holds it.
pub(crate) struct Context {
    pub(crate) owner: Owner,
    pub(crate) cache: KvCache,
    /// Tokens said but not in the cache: the open tail of the last call.
    pub(crate) pending: Vec<u32>,
    /// Its densities (Eq. 1), per layer group ([`GroupDensity`]).
    pub(crate) density: GroupDensity,
    pub(crate) calls: u64,
    /// The turns the context's tokens hold, as the store's transcript gives them (`None`: not
    /// recorded).
    pub(crate) turns: Option<Vec<Turn>>,
    /// Which context holds each chunk (its first ones may be borrowed from shared prefixes),
    /// shared with its chunk memory.
    pub(crate) lineage: Arc<parking_lot::Mutex<Lineage>>,
}

impl Context {
    /// One density per chunk: for a chunk past the sliding window its global layers', for the
    /// others every layer's ([`GroupDensity::chunk_densities`]).
    pub(crate) fn densities(&self) -> Vec<f64> {
        self.density.chunk_densities(self.cache.trimmed_chunks())
    }
}

/// The manager's parts a call works with, borrowed for the call (the context itself is borrowed
/// mutably beside them).
pub(crate) struct Call<'a> {
    pub(crate) model: &'a Model,
    pub(crate) cfg: &'a ManagerConfig,
    pub(crate) io: &'a ChunkIo,
    pub(crate) pager: &'a Pager,
    pub(crate) cost: &'a CostModel,
    /// Each chunk's version, format, density and stored copy.
    pub(crate) book: &'a ChunkBook,
    pub(crate) writer: &'a Writer,
    pub(crate) compression: &'a Compression,
    /// Decodes answers for the transcript.
    pub(crate) tokenizer: Option<&'a model::tokenizer::Tokenizer>,
    /// The context's id.
    pub(crate) id: u64,
}

impl Call<'_> {
    /// Runs the call on the pinned context `ctx`: Load, Run, Compress, AoT write-out.
    pub(crate) fn run(
        &self,
        readers: &mut load::Readers,
        ctx: &mut Context,
        prompt: Prompt<'_>,
        opts: &CallOptions,
        received: Instant,
        on_token: impl FnMut(u32) -> bool,
    ) -> Result<Ran, ServiceError> {
        let context_before = ctx.cache.len() + ctx.pending.len();
        let known = match &prompt {
            Prompt::Tokens(t) => t.len(),
            Prompt::Later(_) => 0,
        };
        self.fits_budget(ctx, known, opts)?;
        let (prompt, load) = self.load(readers, ctx, prompt)?;
        if ctx.cache.len() + ctx.pending.len() + prompt.len() >= self.cfg.max_tokens {
            return Ok(Ran::Full {
                tokens: prompt,
                load,
            });
        }
        let seal = self.fits_budget(ctx, prompt.len(), opts)?;
        if seal != ctx.cache.format() {
            tracing::info!(
                ctx = self.id,
                format = %seal,
                "the context would not fit the budget in {}: its new chunks are sealed in {seal}",
                ctx.cache.format()
            );
            ctx.cache.set_format(seal);
        }
        let switch_secs = received.elapsed().as_secs_f64();
        let (run, said, guide_secs, guide_masks) = self.generate(ctx, &prompt, opts, on_token)?;
        let end = Instant::now();
        let recompressed = self.compress(ctx, &said)?;
        let turns = self.turns_after(ctx, opts, &run.tokens);
        let queued_writes = self.write_out(ctx, &said, turns)?;
        let end_secs = end.elapsed().as_secs_f64();
        ctx.calls += 1;
        Ok(Ran::Done(CallReport {
            tokens: run.tokens,
            stop: match run.stop {
                StopReason::Stop => "stop",
                StopReason::MaxTokens => "max_tokens",
                StopReason::Cancelled => "cancelled",
                StopReason::ContextFull => "context_full",
            },
            switch_secs,
            load,
            prompt_tokens: prompt.len(),
            prefill_tokens: run.prompt_tokens,
            prefill_secs: run.prefill_secs,
            decode_secs: run.decode_secs,
            recompressed,
            queued_writes,
            window_dropped: 0,
            context_before,
            guide_secs,
            guide_masks,
            end_secs,
        }))
    }

    /// The format the call seals its new chunks in, or `over_budget` (nothing changed) when the
    /// context's chunks and those the open tail, a prompt of `prompt` tokens and the longest
    /// answer would seal need more memory than the whole budget even in the lightest: the call
    /// holds its context's chunks resident while it runs, so it could not finish. The format is
    /// the cache's (int8) when the context fits in it, else the heaviest compression level in
    /// which it fits (a pasted document longer than the budget holds at int8): those chunks
    /// start at that level, and the end of the call only moves them further down. Checked
    /// before the Load (with the prompt's tokens when they are known) and again once the prompt
    /// is encoded, before the first token is prefilled.
    fn fits_budget(
        &self,
        ctx: &Context,
        prompt: usize,
        opts: &CallOptions,
    ) -> Result<KvFormat, ServiceError> {
        let said = ctx.cache.len() + ctx.pending.len() + prompt;
        let answer = opts
            .max_tokens
            .min(self.cfg.max_tokens.saturating_sub(said));
        let more = ctx.pending.len() + prompt + answer;
        let budget = self.pager.budget();
        let base = self.cfg.kv_format;
        let shape = *ctx.cache.shape();
        // Lighter formats only where the end of the call would compress anyway.
        let lighter = self.compression.ratio.map(|_| {
            (0..self.compression.levels.set().len())
                .filter_map(|l| self.compression.levels.format(Level(l as u8)))
                .filter(move |&f| model::kv::codec::moves_down(&shape, base, f))
        });
        let mut needed = 0;
        for f in std::iter::once(base).chain(lighter.into_iter().flatten()) {
            needed = ctx.cache.slot_bytes_sealing(more, f);
            if needed <= budget {
                return Ok(f);
            }
        }
        Err(ServiceError::OverBudget {
            id: self.id,
            needed,
            budget,
        })
    }

    /// Step 1, Load: the context's missing chunks back (chunks the pager wrote back when it reclaimed
    /// them are in the store now), the prompt encoded while the reads are in flight. A prewarm
    /// runs this step alone, with an empty prompt.
    pub(crate) fn load(
        &self,
        readers: &mut load::Readers,
        ctx: &mut Context,
        prompt: Prompt<'_>,
    ) -> Result<(Vec<u32>, LoadReport), ServiceError> {
        let lineage = ctx.lineage.lock().clone();
        let stored = self
            .book
            .stored_in(&lineage, ctx.cache.chunk_formats().len());
        let mut tokens = None;
        let load = load::load(
            self.model,
            self.io,
            self.pager,
            &lineage,
            &mut ctx.cache,
            &stored,
            self.cfg.load,
            self.cost,
            readers,
            || tokens = Some(prompt.into_tokens()),
        )?;
        let prompt = tokens.expect("the Load encodes the prompt").into_owned();
        for &i in &load.failed_reads {
            self.book.set_stored(lineage.key(i), None);
        }
        Ok((prompt, load))
    }

    /// Step 2, Run: the open tail of the last call and the prompt prefilled, the answer generated.
    /// Returns the generation, every token said so far (the context's whole text), and the
    /// format's seconds and masks computed.
    fn generate(
        &self,
        ctx: &mut Context,
        prompt: &[u32],
        opts: &CallOptions,
        on_token: impl FnMut(u32) -> bool,
    ) -> Result<(Generation, Vec<u32>, f64, usize), ServiceError> {
        let mut input = std::mem::take(&mut ctx.pending);
        input.extend_from_slice(prompt);
        let mut said: Vec<u32> = ctx.cache.tokens().to_vec();
        said.extend_from_slice(&input);
        let mut sampler = Sampler::new(opts.sampling.clone());
        let mut guided = opts
            .format
            .as_ref()
            .map(|g| Guided(guide::Matcher::new(Arc::clone(g), opts.stop.clone())));
        let run = generate_guided(
            self.model,
            &mut ctx.cache,
            &input,
            opts.max_tokens,
            &opts.stop,
            &mut sampler,
            guided.as_mut().map(|g| g as &mut dyn Guide),
            on_token,
        )?;
        let masks = guided.map_or(0, |g| g.0.computed);
        let (run, guide_secs) = (run.generation, run.guide_secs);
        said.extend_from_slice(&run.tokens);
        Ok((run, said, guide_secs, masks))
    }

    /// Step 3, Compress: the call's attention merged into the densities (Eq. 1), and the chunks the
    /// policy assigns a lighter level (Eq. 2-3) recompressed. Returns how many moved.
    fn compress(&self, ctx: &mut Context, said: &[u32]) -> Result<usize, ServiceError> {
        let model = self.model;
        // The next call decides its own sealing format again.
        ctx.cache.set_format(self.cfg.kv_format);
        ctx.pending = ctx.cache.drop_open();
        ctx.pending
            .extend_from_slice(&said[ctx.cache.len() + ctx.pending.len()..]);
        let attention = ctx.cache.take_attention(model.cfg.n_heads as u32);
        ctx.density
            .merge(&attention.all, attention.global.as_deref())?;
        let sealed = ctx.cache.chunk_formats().len();
        // Borrowed chunks keep the level their prefix holds them at: only the context's own
        // chunks are assigned levels, under the same ratio.
        let own = ctx.cache.shared();
        let mut recompressed = 0;
        let levels = &self.compression.levels;
        if let Some(ratio) = self.compression.ratio
            && sealed > own
        {
            let densities = ctx.densities();
            let floors: Vec<Level> = ctx.cache.chunk_formats()[own..]
                .iter()
                .map(|&f| levels.floor(f).unwrap_or(Level(0)))
                .collect();
            // The chunks past the sliding window (their global layers alone) and the others are
            // each ranked by their own layers' densities and meet the ratio apart.
            let past = ctx.cache.trimmed_chunks().saturating_sub(own);
            let assigned = policy::assign_levels_grouped(
                &densities[own..sealed],
                past,
                Some(&floors),
                levels.set(),
                ratio,
            )?;
            let shape = *ctx.cache.shape();
            let mut moves = Vec::new();
            for (i, &to) in (own..).zip(&assigned) {
                // A chunk above the levels (sealed in int8) moves to its level even at level 0.
                let from = ctx.cache.chunk_formats()[i];
                if let Some(f) = levels.format(to)
                    && model::kv::codec::moves_down(&shape, from, f)
                {
                    moves.push((i, f));
                }
            }
            ctx.cache.recompress_many(&moves)?;
            recompressed = moves.len();
        }
        self.book.set_formats(
            ContextId(self.id),
            ctx.cache.chunk_formats(),
            &ctx.densities(),
        );
        self.book
            .set_trimmed(ContextId(self.id), ctx.cache.trimmed_chunks());
        Ok(recompressed)
    }

    /// The context's turns after this call (the prompt's turn and the answer's), if it records
    /// them.
    fn turns_after(&self, ctx: &Context, opts: &CallOptions, answer: &[u32]) -> Option<Vec<Turn>> {
        let (turns, prompt, tok) = (ctx.turns.as_ref()?, opts.turns.last()?, self.tokenizer?);
        let text = tok.decode_skip_special(answer);
        let mut next = turns.clone();
        next.extend_from_slice(&opts.turns);
        let call = opts
            .tool_calls
            .then(|| model::tokenizer::tool_call_json(&text))
            .flatten();
        match (prompt.role, call) {
            (Role::Raw, _) if text.is_empty() => {}
            (Role::Raw, _) => next.push(Turn::new(Role::Raw, text)),
            (_, Some(json)) => next.push(Turn::new(Role::ToolCall, json)),
            _ => next.push(Turn::new(Role::Assistant, text)),
        }
        Some(next)
    }

    /// Step 4, AoT write-out: the transcript's next turns and the tokens first (a chunk is valid
    /// only with its tokens; the transcript names the tokens it goes with, so a crash between
    /// the two leaves it as the last completed call), then the chunks `policy::plan_writeout`
    /// lists, queued for the writer thread. Returns how many.
    fn write_out(
        &self,
        ctx: &mut Context,
        said: &[u32],
        turns: Option<Vec<Turn>>,
    ) -> Result<usize, ServiceError> {
        let id = self.id;
        let kid = ContextId(id);
        let stored_tokens = self.io.store().tokens(kid)?.len();
        if let (Some(now), Some(next)) = (&ctx.turns, &turns) {
            let file = transcript::encode(now, next, said);
            self.io.store().write_transcript(kid, &file)?;
        }
        if said.len() > stored_tokens {
            self.io.store().append_tokens(kid, &said[stored_tokens..])?;
        }
        // A call that is not recorded ends the recording: the transcript would miss it.
        ctx.turns = turns;
        let levels = &self.compression.levels;
        let sealed = ctx.cache.chunk_formats().len();
        let stored = self.book.stored(ContextId(id), sealed);
        // Borrowed chunks are their prefix's, written when it was made.
        let states: Vec<policy::WriteCandidate> = (ctx.cache.shared()..sealed)
            .map(|i| {
                let f = ctx.cache.chunk_formats()[i];
                let bytes = ctx.cache.shape_of(i).chunk_bytes(f) as u64;
                policy::WriteCandidate {
                    index: i as u32,
                    level: levels.floor(f).unwrap_or(Level(0)),
                    stored: stored[i].and_then(|s| levels.floor(s.format)),
                    // A whole copy of a chunk now past the sliding window is written again
                    // without the layers it no longer keeps.
                    modified: stored[i].is_some_and(|s| s.format == f && s.raw > bytes),
                    bytes,
                }
            })
            .collect();
        let writes = match self.cfg.write_out {
            WriteOut::Aot => policy::plan_writeout(&states)?,
            WriteOut::OnReclaim | WriteOut::Never => Vec::new(),
        };
        let densities = ctx.densities();
        for w in &writes {
            let i = w.index as usize;
            let f = ctx.cache.chunk_formats()[i];
            let Some(bytes) = ctx.cache.chunk_bytes(i) else {
                continue;
            };
            let key = ChunkKey {
                ctx: ContextId(id),
                index: w.index,
            };
            self.writer.submit(WriteJob {
                key,
                format: f,
                density: densities.get(i).copied().unwrap_or(0.0) as f32,
                bytes: bytes.to_vec(),
                version: self.book.version(key),
            });
            let queued = StoredCopy {
                format: f,
                bytes: bytes.len() as u64,
                raw: bytes.len() as u64,
            };
            self.book.set_stored(key, Some(queued));
        }
        Ok(writes.len())
    }
}
