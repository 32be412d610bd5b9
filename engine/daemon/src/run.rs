//! The engine thread: the one owner of the [`Manager`]. It takes requests from the fair queue,
//! turns prompts into tokens (the chat template or raw text), runs the call and streams each
//! token to the caller's connection, and answers the other operations; every error of the
//! manager becomes an error reply here, affecting only its request.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::call::{call, no_template, prompt_of, service_error, service_error_for};
use crate::format::template_tools;
use crate::{Job, Shared};
use model::tokenizer::{Message, Tokenizer};
use protocol::{
    ContextInfo, ErrorBody, Event, Prewarmed, PromptFormat, Reply, Request, Stats, TokenCount,
    codes,
};
use service::transcript::{self, Role, Turn};
use service::{ContextSummary, Manager, Owner, Prompt, ServiceError};

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
        // After the work that makes large transient buffers, and only when nothing waits.
        let heavy = matches!(
            job.request,
            Request::Call { .. }
                | Request::ToolResult { .. }
                | Request::Prewarm { .. }
                | Request::Fork { .. }
                | Request::New {
                    transcript: Some(_),
                    ..
                }
        );
        if heavy && shared.queue.is_empty() {
            m.release_memory();
        }
    }
    tracing::info!("engine thread draining: flushing ahead-of-time writes");
    m.flush();
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
        | Request::ToolResult { context, .. }
        | Request::Prewarm { context, .. }
        | Request::Fork { context, .. }
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
        Request::New { .. } => {
            new_context(m, tok, shared, job).map(|context| Event::Created { context })
        }
        Request::Export { context, .. } => m
            .transcript(o, *context)
            .map(|turns| Event::Transcript {
                context: *context,
                transcript: wire_transcript(&turns),
            })
            .map_err(service_error),
        Request::Call { .. } | Request::ToolResult { .. } => {
            call(m, tok, shared, job).map(|d| Event::Done(Box::new(d)))
        }
        Request::Count {
            context,
            text,
            format,
            ..
        } => count(m, tok, o, *context, text, *format).map(Event::Count),
        Request::Prewarm { context, .. } => prewarm(m, o, *context, job).map(Event::Prewarmed),
        Request::Fork { context, .. } => {
            let child = m.fork(o, *context).map_err(service_error)?;
            tracing::info!(
                uid = o.uid,
                parent = context,
                context = child,
                "context forked"
            );
            Ok(Event::Created { context: child })
        }
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

/// `new`: a context, empty, with a system prompt and the tools it declares, or rebuilt from a
/// transcript (rendered in the chat template and prefilled: it waited in the app's call lane),
/// its turns recorded from the start.
fn new_context(
    m: &mut Manager,
    tok: &Tokenizer,
    shared: &Shared,
    job: &Job,
) -> Result<u64, ErrorBody> {
    let Request::New {
        system,
        format,
        transcript,
        tools,
        ..
    } = &job.request
    else {
        unreachable!("new_context() is only given new")
    };
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
        (None, None, _) if tools.is_empty() => (Vec::new(), Vec::new()),
        (None, Some(s), PromptFormat::Raw) => (vec![Turn::new(Role::Raw, s)], tok.encode_start(s)),
        (None, system, _) => {
            // Tools declared with the system turn come first: the template ends it with them.
            let mut turns = Vec::with_capacity(2);
            if !tools.is_empty() {
                turns.push(transcript::tools_turn(&template_tools(tools)));
            }
            turns.extend(system.as_deref().map(|s| Turn::new(Role::System, s)));
            let tokens = transcript::render(tok, &turns).map_err(no_template)?;
            (turns, tokens)
        }
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
            let role = match format {
                PromptFormat::Chat => Role::User,
                PromptFormat::Raw => Role::Raw,
            };
            let turns = [Turn::new(role, text)];
            let tokens = match prompt_of(m, tok, o, id, &turns, format)? {
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
        shared_chunks: window.map(|_| c.shared_chunks),
    }
}

fn stats(m: &Manager, shared: &Shared) -> Stats {
    Stats {
        service: m.stats(),
        daemon: shared.daemon_stats(),
    }
}
