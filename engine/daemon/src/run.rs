//! The engine thread: the one owner of the [`Manager`]. It takes requests from the fair queue,
//! turns prompts into tokens (the chat template or raw text), runs the call and streams each
//! token to the caller's connection, and answers the other operations; every error of the
//! manager becomes an error reply here, affecting only its request.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use crate::{Job, Shared};
use model::generate::SamplingParams;
use model::tokenizer::{Message, StreamDecoder, Tokenizer};
use protocol::{
    BudgetNumbers, ChunkCounts, ContextInfo, Done, ErrorBody, Event, FullNumbers, Prewarmed,
    PromptFormat, Reply, Request, Stats, Timings, TokenCount, Usage, codes,
};
use service::transcript::{self, Role, Turn};
use service::{CallOptions, CallReport, ContextSummary, Manager, Owner, Prompt, ServiceError};

/// Serves requests until the queue closes, then flushes the AoT writes.
pub fn engine_loop(mut m: Manager, tok: &Tokenizer, shared: &Shared) {
    tracing::info!("engine thread serving");
    while let Some(job) = shared.queue.pop() {
        let id = job.request.id();
        let reply = if job.cancel.load(Ordering::Acquire) || job.conn.is_gone() {
            Err(ErrorBody::new(
                codes::CANCELLED,
                "the call was cancelled before it started",
            ))
        } else {
            *shared.running.lock() = Some(Arc::clone(&job.cancel));
            let r = handle(&mut m, tok, shared, &job);
            *shared.running.lock() = None;
            r
        };
        let reply = match reply {
            Ok(ev) => Reply::event(id, ev),
            Err(e) => {
                shared.error();
                Reply::error(Some(id), e)
            }
        };
        job.conn.send(&reply);
    }
    tracing::info!("engine thread draining: flushing ahead-of-time writes");
    m.flush();
}

fn service_error(e: ServiceError) -> ErrorBody {
    ErrorBody::new(e.code(), e.to_string())
}

/// A manager's error for a connection of protocol `version`: from version 2 on, `context_full`
/// and `over_budget` carry their numbers.
fn service_error_for(e: ServiceError, version: u32) -> ErrorBody {
    use model::ModelError;
    use model::kv::KvError;
    let numbers = match &e {
        ServiceError::Kv(KvError::Full { len, adding, max })
        | ServiceError::Model(ModelError::Kv(KvError::Full { len, adding, max })) => {
            Some(FullNumbers {
                context_window: *max,
                used: *len,
                remaining: max.saturating_sub(*len),
                needed: *adding,
            })
        }
        _ => None,
    };
    let memory = match &e {
        ServiceError::OverBudget { needed, budget, .. } => Some(Box::new(BudgetNumbers {
            needed: *needed,
            budget: *budget,
        })),
        _ => None,
    };
    ErrorBody {
        tokens: numbers.filter(|_| version >= 2),
        memory: memory.filter(|_| version >= 2),
        ..service_error(e)
    }
}

fn handle(
    m: &mut Manager,
    tok: &Tokenizer,
    shared: &Shared,
    job: &Job,
) -> Result<Event, ErrorBody> {
    let o = &job.owner;
    let window = (job.version >= 2).then(|| m.max_tokens());
    // A context of another model is rebuilt from its transcript on its first use.
    match &job.request {
        Request::Call { context, .. }
        | Request::Prewarm { context, .. }
        | Request::Info { context, .. }
        | Request::Count {
            context: Some(context),
            ..
        } => {
            m.adopt(o, *context).map_err(service_error)?;
        }
        _ => {}
    }
    match &job.request {
        Request::New {
            system,
            format,
            transcript,
            ..
        } => new_context(
            m,
            tok,
            shared,
            job,
            system.as_deref(),
            *format,
            transcript.as_ref(),
        )
        .map(|context| Event::Created { context }),
        Request::Export { context, .. } => m
            .transcript(o, *context)
            .map(|turns| Event::Transcript {
                context: *context,
                transcript: wire_transcript(&turns),
            })
            .map_err(service_error),
        Request::Call { .. } => call(m, tok, job).map(|d| Event::Done(Box::new(d))),
        Request::Count {
            context,
            text,
            format,
            ..
        } => count(m, tok, o, *context, text, *format).map(Event::Count),
        Request::Prewarm { context, .. } => prewarm(m, o, *context, job).map(Event::Prewarmed),
        Request::Delete { context, .. } => {
            m.delete(o, *context).map_err(service_error)?;
            tracing::info!(uid = o.uid, context, "context deleted");
            Ok(Event::Ok)
        }
        Request::List { .. } => Ok(Event::Contexts {
            contexts: m
                .list(o)
                .into_iter()
                .map(|c| context_info(c, window))
                .collect(),
        }),
        Request::Info { context, .. } => m
            .info(o, *context)
            .map(|c| Event::Info {
                context: context_info(c, window),
            })
            .map_err(service_error),
        Request::Stats { .. } => Ok(Event::Stats(Box::new(stats(m, shared)))),
        Request::Hello { .. } | Request::Cancel { .. } => Err(ErrorBody::new(
            codes::BAD_REQUEST,
            "hello and cancel are answered by the connection",
        )),
    }
}

/// `new`: a context, empty, with a system prompt, or rebuilt from a transcript (rendered in the
/// chat template and prefilled: it waited in the app's call lane), its turns recorded from the
/// start.
fn new_context(
    m: &mut Manager,
    tok: &Tokenizer,
    shared: &Shared,
    job: &Job,
    system: Option<&str>,
    format: PromptFormat,
    transcript: Option<&protocol::Transcript>,
) -> Result<u64, ErrorBody> {
    let o = &job.owner;
    let n = m.list(o).iter().filter(|c| c.app == o.app).count();
    let max = shared.cfg.max_contexts_per_app;
    if n >= max {
        return Err(service_error(ServiceError::TooManyContexts {
            app: o.app.clone(),
            max,
        }));
    }
    let (turns, tokens) = match (transcript, system, format) {
        (Some(t), ..) => {
            let turns = service_transcript(t)?;
            let tokens = transcript::render(tok, &turns).map_err(no_template)?;
            (turns, tokens)
        }
        (None, None, _) => (Vec::new(), Vec::new()),
        (None, Some(s), PromptFormat::Raw) => (vec![Turn::new(Role::Raw, s)], tok.encode_start(s)),
        (None, Some(s), PromptFormat::Chat) => (
            vec![Turn::new(Role::System, s)],
            tok.encode_chat(&[Message::system(s)], false)
                .map_err(no_template)?,
        ),
    };
    let context = m
        .create_recorded(o, &tokens, turns, transcript.is_some())
        .map_err(|e| service_error_for(e, job.version))?;
    tracing::info!(uid = o.uid, app = %o.app, context, tokens = tokens.len(), "context created");
    Ok(context)
}

/// A transcript from the wire as the service's turns (roles were checked when it was parsed).
fn service_transcript(t: &protocol::Transcript) -> Result<Vec<Turn>, ErrorBody> {
    t.turns
        .iter()
        .enumerate()
        .map(|(i, w)| match Role::parse(&w.role) {
            Some(role) => Ok(Turn::new(role, w.text.as_str())),
            None => Err(ErrorBody::new(
                codes::INVALID_TRANSCRIPT,
                format!("turn {i} has the role {:?}", w.role),
            )),
        })
        .collect()
}

/// The service's turns as the wire's transcript.
fn wire_transcript(turns: &[Turn]) -> protocol::Transcript {
    protocol::Transcript {
        turns: turns
            .iter()
            .map(|t| protocol::Turn {
                role: t.role.name().to_owned(),
                text: t.text.clone(),
            })
            .collect(),
    }
}

fn no_template(e: model::tokenizer::TokenizerError) -> ErrorBody {
    ErrorBody::new(
        codes::NO_TEMPLATE,
        format!("{e}; send the prompt with \"format\":\"raw\""),
    )
}

/// One prompt appended to context `id`, as `format` says. The chat template's turn markers
/// (ChatML's or Gemma's, [`Tokenizer::chat_turns`]) are decided here (they depend on how the
/// context ends); the text itself is encoded by the engine thread while the context's chunks are
/// read ([`Prompt::Later`]).
fn prompt_of<'a>(
    m: &Manager,
    tok: &'a Tokenizer,
    o: &Owner,
    id: u64,
    prompt: &'a str,
    format: PromptFormat,
) -> Result<Prompt<'a>, ErrorBody> {
    let info = m.info(o, id).map_err(service_error)?;
    if format == PromptFormat::Raw {
        // The first text of a context starts with BOS when the model wants it.
        let first = info.tokens == 0;
        return Ok(Prompt::later(move || match first {
            true => tok.encode_start(prompt),
            false => tok.encode(prompt),
        }));
    }
    if info.tokens == 0 {
        // A new context has nothing to read: encoding now costs the switch nothing.
        let t = tok
            .encode_chat(&[Message::user(prompt)], true)
            .map_err(no_template)?;
        return Ok(Prompt::later(move || t));
    }
    let turns = tok.chat_turns().map_err(no_template)?;
    let (start, end) = (turns.start, turns.end);
    // The last answer ended at its end-of-turn token, which is not part of the context: close
    // the turn first (a context that ends in a closed turn, e.g. its system prompt, needs not).
    let said = m
        .store()
        .tokens(kvfs::ContextId(id))
        .map_err(|e| service_error(e.into()))?;
    let nl = tok.encode("\n");
    let closed = said.last() == Some(&end) || said.ends_with(&[&[end][..], &nl].concat());
    let mut head = Vec::with_capacity(nl.len() + 2);
    if !closed {
        head.push(end);
        head.extend_from_slice(&nl);
    }
    head.push(start);
    let mut tail = vec![end];
    tail.extend_from_slice(&nl);
    tail.push(start);
    tail.extend(tok.encode(&format!("{}\n", turns.assistant)));
    let user = "user\n";
    Ok(Prompt::later(move || {
        // Every token of this byte-level BPE covers at least one byte.
        let mut t = Vec::with_capacity(head.len() + user.len() + prompt.len() + tail.len());
        t.extend_from_slice(&head);
        t.extend(tok.encode(&format!("{user}{prompt}")));
        t.extend_from_slice(&tail);
        t
    }))
}

/// `count`: the tokens `text` would add to context `id` (or to a new context) as a call's prompt
/// in `format`, exactly as a call would encode it.
fn count(
    m: &Manager,
    tok: &Tokenizer,
    o: &Owner,
    id: Option<u64>,
    text: &str,
    format: PromptFormat,
) -> Result<TokenCount, ErrorBody> {
    let context_window = m.max_tokens();
    let (tokens, used) = match id {
        Some(id) => {
            let used = m.info(o, id).map_err(service_error)?.tokens;
            let tokens = match prompt_of(m, tok, o, id, text, format)? {
                Prompt::Tokens(t) => t.len(),
                Prompt::Later(encode) => encode().len(),
            };
            (tokens, used)
        }
        None => {
            let tokens = match format {
                // A new context's first text starts with BOS when the model wants it.
                PromptFormat::Raw => tok.encode_start(text),
                PromptFormat::Chat => tok
                    .encode_chat(&[Message::user(text)], true)
                    .map_err(no_template)?,
            };
            (tokens.len(), 0)
        }
    };
    Ok(TokenCount {
        tokens,
        context_window,
        used,
        remaining: context_window.saturating_sub(used),
    })
}

/// `prewarm`: context `id`'s missing chunks brought back by a Load, without a call. It waited in
/// the idle lane, behind every call (`queue_ms` says how long).
fn prewarm(m: &mut Manager, o: &Owner, id: u64, job: &Job) -> Result<Prewarmed, ErrorBody> {
    let queue_ms = job.received.elapsed().as_secs_f64() * 1e3;
    let load = m.prewarm(o, id).map_err(service_error)?;
    let chunks = m.info(o, id).map(|c| c.chunks).unwrap_or(0);
    tracing::info!(
        context = id,
        missing = load.missing,
        read = load.read.len(),
        recomputed = load.recomputed.len(),
        "prewarmed"
    );
    let ms = |s: f64| s * 1e3;
    Ok(Prewarmed {
        chunks,
        missing: load.missing,
        read: load.read.len(),
        recomputed: load.recomputed.len(),
        read_bytes: load.read_bytes,
        load_ms: ms(load.total_secs),
        load_predicted_ms: ms(load.predicted_secs),
        queue_ms,
    })
}

fn call(m: &mut Manager, tok: &Tokenizer, job: &Job) -> Result<Done, ErrorBody> {
    let Request::Call {
        id,
        context,
        prompt,
        format,
        max_tokens,
        temperature,
        top_p,
        top_k,
        seed,
        stop,
        ..
    } = &job.request
    else {
        unreachable!("call() is only given calls")
    };
    let o = &job.owner;
    let prompt_text = prompt;
    let prompt = prompt_of(m, tok, o, *context, prompt, *format)?;
    let opts = CallOptions {
        max_tokens: *max_tokens,
        sampling: SamplingParams {
            temperature: *temperature,
            top_k: *top_k,
            top_p: *top_p,
            seed: *seed,
        },
        stop: tok.stop_ids(),
        format: job.format.clone(),
        turn: Some(prompt_turn(*format, prompt_text)),
    };
    let started = Instant::now();
    let mut dec = StreamDecoder::new(true);
    let mut text = String::new();
    let mut stop_string = false;
    let longest_stop = stop.iter().map(String::len).max().unwrap_or(0);
    let conn = &job.conn;
    let report = m
        .call_with(o, *context, prompt, &opts, job.received, |t| {
            let piece = dec.push(tok, t);
            let from = text.len().saturating_sub(longest_stop + piece.len());
            text.push_str(&piece);
            if !conn.send(&Reply::event(
                *id,
                Event::Token {
                    token: t,
                    text: piece,
                },
            )) {
                return false;
            }
            if !stop.is_empty() {
                let from = (0..=from)
                    .rev()
                    .find(|&i| text.is_char_boundary(i))
                    .unwrap_or(0);
                if stop.iter().any(|s| text[from..].contains(s.as_str())) {
                    stop_string = true;
                    return false;
                }
            }
            !job.cancel.load(Ordering::Acquire)
        })
        .map_err(|e| service_error_for(e, job.version))?;
    let ms = |s: f64| s * 1e3;
    let generated = report.tokens.len();
    let context_tokens = m.info(o, *context).map(|c| c.tokens).unwrap_or(0);
    tracing::info!(
        context,
        prompt = report.prompt_tokens,
        generated,
        switch_ms = ms(report.switch_secs),
        stop = report.stop,
        "call done"
    );
    let v2 = job.version >= 2;
    let window = m.max_tokens();
    let mut timings = timings(&report, job, started);
    if v2 && job.format.is_some() {
        timings.guide_ms = Some(ms(report.guide_secs));
    }
    Ok(Done {
        stop: if stop_string {
            "stop_string".into()
        } else {
            report.stop.into()
        },
        tokens: generated,
        context_tokens,
        window_dropped: report.window_dropped,
        timings,
        chunks: chunk_counts(&report),
        context_window: v2.then_some(window),
        used: v2.then_some(context_tokens),
        remaining: v2.then(|| window.saturating_sub(context_tokens)),
        usage: v2.then(|| usage(&report, m.chunk_tokens())),
    })
}

/// A call's prompt as a turn of the context's transcript.
fn prompt_turn(format: PromptFormat, text: &str) -> Turn {
    let role = match format {
        PromptFormat::Chat => Role::User,
        PromptFormat::Raw => Role::Raw,
    };
    Turn::new(role, text)
}

/// A call's timings, in milliseconds, from its report and the job's arrival.
fn timings(report: &CallReport, job: &Job, started: Instant) -> Timings {
    let ms = |s: f64| s * 1e3;
    let l = &report.load;
    let decoded = report.tokens.len().saturating_sub(1);
    Timings {
        switch_ms: ms(report.switch_secs),
        queue_ms: ms(started.duration_since(job.received).as_secs_f64()),
        load_ms: ms(l.total_secs),
        load_predicted_ms: ms(l.predicted_secs),
        plan_ms: ms(l.plan_secs),
        io_ms: ms(l.io_secs),
        recompute_ms: ms(l.recompute_secs),
        prefill_tokens: report.prefill_tokens,
        prefill_ms: ms(report.prefill_secs),
        prefill_tps: rate(report.prefill_tokens, report.prefill_secs),
        decode_ms: ms(report.decode_secs),
        decode_tps: rate(decoded, report.decode_secs),
        total_ms: ms(job.received.elapsed().as_secs_f64()),
        guide_ms: None,
    }
}

/// Where a call's tokens came from: the context it started from (after its window slid) is
/// either reused (resident or read) or computed again (recomputed chunks, the open tail
/// prefilled with the prompt, the tokens a slid window kept).
fn usage(report: &CallReport, chunk_tokens: usize) -> Usage {
    let kept = report.context_before;
    let reprefilled = report.prefill_tokens.saturating_sub(report.prompt_tokens);
    let recomputed = (report.load.recomputed.len() * chunk_tokens + reprefilled).min(kept);
    Usage {
        prompt: report.prompt_tokens,
        generated: report.tokens.len(),
        reused: kept - recomputed,
        recomputed,
        read: report.load.read.len() * chunk_tokens,
    }
}

/// What a call's Load and write-out did with its chunks.
fn chunk_counts(report: &CallReport) -> ChunkCounts {
    let l = &report.load;
    ChunkCounts {
        missing: l.missing,
        read: l.read.len(),
        recomputed: l.recomputed.len(),
        failed_reads: l.failed_reads.len(),
        read_bytes: l.read_bytes,
        recompressed: report.recompressed,
        queued_writes: report.queued_writes,
    }
}

fn rate(n: usize, secs: f64) -> f64 {
    if n == 0 || secs <= 0.0 {
        0.0
    } else {
        n as f64 / secs
    }
}

/// A context as the wire shows it; with the context `window` (version 2), what it holds and
/// what is left beside it.
fn context_info(c: ContextSummary, window: Option<usize>) -> ContextInfo {
    ContextInfo {
        context_window: window,
        used: window.map(|_| c.tokens),
        remaining: window.map(|w| w.saturating_sub(c.tokens)),
        id: c.id,
        app: c.app,
        tokens: c.tokens,
        chunks: c.chunks,
        resident_chunks: c.resident_chunks,
        resident_bytes: c.resident_bytes,
        formats: c
            .formats
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v))
            .collect(),
        calls: c.calls,
    }
}

fn stats(m: &Manager, shared: &Shared) -> Stats {
    Stats {
        service: m.stats(),
        daemon: shared.daemon_stats(),
    }
}
