//! One call, or one tool result, run by the engine thread: its prompt as turns of the context's
//! transcript and as tokens in the chat template (the turn markers decided here, the text
//! encoded during the Load), its answer's grammar (a response format, the tools in force), its
//! tokens streamed (a tool call's held back and sent as one `tool_call` event), and its `done`.
//! Every manager error becomes an error reply here.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use crate::format::{Formats, template_tools};
use crate::{Job, Shared};
use model::generate::SamplingParams;
use model::tokenizer::{StreamDecoder, TOOL_CALL_OPEN, Tokenizer, tool_call_json};
use protocol::{
    BudgetNumbers, ChunkCounts, Done, ErrorBody, Event, FullNumbers, PromptFormat, Reply, Request,
    Timings, ToolChoice, Usage, codes,
};
use service::transcript::{self, Role, Turn};
use service::{CallOptions, CallReport, Manager, Owner, Prompt, ServiceError};

pub fn service_error(e: ServiceError) -> ErrorBody {
    ErrorBody::new(e.code(), e.to_string())
}

/// A manager's error for a connection of protocol `version`: from version 2 on, `context_full`
/// and `over_budget` carry their numbers.
pub fn service_error_for(e: ServiceError, version: u32) -> ErrorBody {
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

pub fn no_template(e: model::tokenizer::TokenizerError) -> ErrorBody {
    ErrorBody::new(
        codes::NO_TEMPLATE,
        format!("{e}; send the prompt with \"format\":\"raw\""),
    )
}

/// One prompt appended to context `id`: its `turns` (a chat prompt, raw text, a tool's result,
/// after the tools it declares) as tokens. The chat template's turn markers (ChatML's or
/// Gemma's, [`Tokenizer::chat_turns`]) are decided here (they depend on how the context ends);
/// the text itself is encoded by the engine thread while the context's chunks are read
/// ([`Prompt::Later`]).
pub fn prompt_of<'a>(
    m: &Manager,
    tok: &'a Tokenizer,
    o: &Owner,
    id: u64,
    turns: &[Turn],
    format: PromptFormat,
) -> Result<Prompt<'a>, ErrorBody> {
    let info = m.info(o, id).map_err(service_error)?;
    if format == PromptFormat::Raw {
        let prompt = turns.last().map(|t| t.text.clone()).unwrap_or_default();
        // The first text of a context starts with BOS when the model wants it.
        let first = info.tokens == 0;
        return Ok(Prompt::later(move || match first {
            true => tok.encode_start(&prompt),
            false => tok.encode(&prompt),
        }));
    }
    if info.tokens == 0 {
        // A new context has nothing to read: encoding now costs the switch nothing.
        let t = tok
            .encode_chat(&transcript::messages(tok, turns, true), true)
            .map_err(no_template)?;
        return Ok(Prompt::later(move || t));
    }
    let marks = tok.chat_turns().map_err(no_template)?;
    let (start, end) = (marks.start, marks.end);
    // The last answer ended at its end-of-turn token, which is not part of the context: close
    // the turn first (a context that ends in a closed turn, e.g. its system prompt, needs not).
    let said = m
        .store()
        .tokens(kvfs::ContextId(id))
        .map_err(|e| service_error(e.into()))?;
    let nl = tok.encode("\n");
    let closed = said.last() == Some(&end) || said.ends_with(&[&[end][..], &nl].concat());
    let mut head = Vec::with_capacity(nl.len() + 1);
    if !closed {
        head.push(end);
        head.extend_from_slice(&nl);
    }
    let texts: Vec<String> = transcript::messages(tok, turns, false)
        .into_iter()
        .map(|m| format!("{}\n{}", m.role, m.content))
        .collect();
    let assistant = tok.encode(&format!("{}\n", marks.assistant));
    Ok(Prompt::later(move || {
        // Every token of this byte-level BPE covers at least one byte.
        let bytes: usize = texts.iter().map(String::len).sum();
        let mut t = Vec::with_capacity(head.len() + bytes + 4 * texts.len() + assistant.len());
        t.extend_from_slice(&head);
        for text in &texts {
            t.push(start);
            t.extend(tok.encode(text));
            t.push(end);
            t.extend_from_slice(&nl);
        }
        t.push(start);
        t.extend_from_slice(&assistant);
        t
    }))
}

/// What a `call` and a `tool_result` share.
pub struct CallSpec<'a> {
    pub id: u64,
    pub context: u64,
    /// The prompt, or the tool's result.
    pub text: &'a str,
    pub format: PromptFormat,
    pub tool_result: bool,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop: &'a [String],
    /// Tools the call declares (none for a tool result: the context's stay in force).
    pub tools: &'a [protocol::Tool],
    pub choice: Option<&'a ToolChoice>,
}

impl<'a> CallSpec<'a> {
    /// The spec of a `call` or a `tool_result`.
    pub fn of(r: &'a Request) -> Option<CallSpec<'a>> {
        let sampling = |temperature, top_k, top_p, seed| SamplingParams {
            temperature,
            top_k,
            top_p,
            seed,
        };
        match r {
            Request::Call {
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
                tools,
                tool_choice,
                ..
            } => Some(CallSpec {
                id: *id,
                context: *context,
                text: prompt,
                format: *format,
                tool_result: false,
                max_tokens: *max_tokens,
                sampling: sampling(*temperature, *top_k, *top_p, *seed),
                stop,
                tools,
                choice: tool_choice.as_ref(),
            }),
            Request::ToolResult {
                id,
                context,
                content,
                max_tokens,
                temperature,
                top_p,
                top_k,
                seed,
                stop,
                tool_choice,
                ..
            } => Some(CallSpec {
                id: *id,
                context: *context,
                text: content,
                format: PromptFormat::Chat,
                tool_result: true,
                max_tokens: *max_tokens,
                sampling: sampling(*temperature, *top_k, *top_p, *seed),
                stop,
                tools: &[],
                choice: tool_choice.as_ref(),
            }),
            _ => None,
        }
    }
}

/// What a call adds to the context's transcript and how its answer is guided.
pub struct Plan {
    /// The prompt's turns: the tools it declares, then the prompt (or the tool's result).
    pub turns: Vec<Turn>,
    /// The answer's grammar: the tools' (a call, or a plain answer), or the response format's.
    pub grammar: Option<Arc<guide::Grammar>>,
    /// Whether the answer may be a tool call.
    pub tool_calls: bool,
}

/// The plan of a call: the tools in force (the call's, else the context's last declared), the
/// tool call a tool result answers (none pending: `no_tool_call`, nothing changed), and the
/// grammar `tool_choice` asks for, beside the response format's (`format`).
pub fn plan(
    m: &Manager,
    formats: &Formats,
    o: &Owner,
    spec: &CallSpec,
    format: Option<Arc<guide::Grammar>>,
) -> Result<Plan, ErrorBody> {
    let id = spec.context;
    let recorded = m.turns(o, id).map_err(service_error)?.unwrap_or(&[]);
    let mut turns = Vec::with_capacity(2);
    let tools = if spec.tools.is_empty() {
        transcript::tools_in_force(recorded)
    } else {
        let t = template_tools(spec.tools);
        turns.push(transcript::tools_turn(&t));
        t
    };
    if spec.tool_result {
        if transcript::pending_tool_call(recorded).is_none() {
            return Err(ErrorBody::new(
                codes::NO_TOOL_CALL,
                format!(
                    "context {id} has no tool call waiting for its result (its last answer is \
                     not a tool call); send a call"
                ),
            ));
        }
        turns.push(Turn::new(Role::Tool, spec.text));
    } else {
        let role = match spec.format {
            PromptFormat::Chat => Role::User,
            PromptFormat::Raw => Role::Raw,
        };
        turns.push(Turn::new(role, spec.text));
    }
    let bad = |m: String| Err(ErrorBody::new(codes::BAD_REQUEST, m));
    let choice = spec.choice.cloned().unwrap_or_default();
    if tools.is_empty() && spec.choice.is_some() {
        return bad(format!(
            "tool_choice without tools: context {id} has none in force; declare tools on the \
             call or on new"
        ));
    }
    if let ToolChoice::Tool(name) = &choice
        && !tools.iter().any(|t| t.name == *name)
    {
        let names: Vec<&str> = tools.iter().map(|t| t.name.as_str()).collect();
        return bad(format!(
            "tool_choice names the tool {name:?}, which is not in force; the tools are {}",
            names.join(", ")
        ));
    }
    if tools.is_empty() || choice == ToolChoice::None {
        return Ok(Plan {
            turns,
            grammar: format,
            tool_calls: false,
        });
    }
    let g = formats.tools(&tools, &choice, format.as_deref())?;
    if g.min_tokens() > spec.max_tokens {
        return bad(format!(
            "max_tokens {} is too few for a tool call: the shortest may take {} tokens",
            spec.max_tokens,
            g.min_tokens()
        ));
    }
    Ok(Plan {
        turns,
        grammar: Some(g),
        tool_calls: true,
    })
}

/// Runs a `call` or a `tool_result` and streams its answer: tokens as they come, but those that
/// may begin a tool call held until the answer shows it is not one; a whole tool call is sent
/// as one `tool_call` event before `done` (whose stop is then `tool_call`).
pub fn call(
    m: &mut Manager,
    tok: &Tokenizer,
    shared: &Shared,
    job: &Job,
) -> Result<Done, ErrorBody> {
    let spec = CallSpec::of(&job.request).expect("call() is only given calls");
    let o = &job.owner;
    let plan = plan(m, &shared.formats, o, &spec, job.format.clone())?;
    let prompt = prompt_of(m, tok, o, spec.context, &plan.turns, spec.format)?;
    let guided = plan.grammar.is_some();
    let opts = CallOptions {
        max_tokens: spec.max_tokens,
        sampling: spec.sampling.clone(),
        stop: tok.stop_ids(),
        format: plan.grammar,
        turns: plan.turns,
        tool_calls: plan.tool_calls,
    };
    let started = Instant::now();
    let mut out = Answer::new(&job.conn, spec.id, plan.tool_calls);
    let report = m
        .call_with(o, spec.context, prompt, &opts, job.received, |t| {
            out.token(tok, t, spec.stop) && !job.cancel.load(Ordering::Acquire)
        })
        .map_err(|e| service_error_for(e, job.version))?;
    let stop = out.finish();
    let generated = report.tokens.len();
    let context_tokens = m.info(o, spec.context).map(|c| c.tokens).unwrap_or(0);
    let ms = |s: f64| s * 1e3;
    tracing::info!(
        context = spec.context,
        prompt = report.prompt_tokens,
        generated,
        switch_ms = ms(report.switch_secs),
        stop = stop.unwrap_or(report.stop),
        "call done"
    );
    let v2 = job.version >= 2;
    let window = m.max_tokens();
    let mut timings = timings(&report, job, started);
    if v2 && guided {
        timings.guide_ms = Some(ms(report.guide_secs));
    }
    if v2 {
        timings.end_ms = Some(ms(report.end_secs));
    }
    Ok(Done {
        stop: stop.unwrap_or(report.stop).into(),
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

/// An answer as it streams to the connection.
struct Answer<'a> {
    conn: &'a crate::conn::Conn,
    id: u64,
    dec: StreamDecoder,
    text: String,
    /// Whether the answer may be a tool call.
    tool_calls: bool,
    /// Tokens not sent yet: the answer so far may be the start of a tool call.
    held: Vec<(u32, String)>,
    stop_string: bool,
}

impl<'a> Answer<'a> {
    fn new(conn: &'a crate::conn::Conn, id: u64, tool_calls: bool) -> Answer<'a> {
        Answer {
            conn,
            id,
            dec: StreamDecoder::new(true),
            text: String::new(),
            tool_calls,
            held: Vec::new(),
            stop_string: false,
        }
    }

    /// Takes one token; false to stop (the client is gone, or a stop string appeared).
    fn token(&mut self, tok: &Tokenizer, t: u32, stop: &[String]) -> bool {
        let piece = self.dec.push(tok, t);
        let longest_stop = stop.iter().map(String::len).max().unwrap_or(0);
        let from = self.text.len().saturating_sub(longest_stop + piece.len());
        self.text.push_str(&piece);
        self.held.push((t, piece));
        let maybe_call = self.tool_calls
            && (TOOL_CALL_OPEN.starts_with(self.text.as_str())
                || self.text.starts_with(TOOL_CALL_OPEN));
        if !maybe_call && !self.flush() {
            return false;
        }
        if !stop.is_empty() {
            let from = (0..=from)
                .rev()
                .find(|&i| self.text.is_char_boundary(i))
                .unwrap_or(0);
            if stop.iter().any(|s| self.text[from..].contains(s.as_str())) {
                self.stop_string = true;
                return false;
            }
        }
        true
    }

    /// Sends the tokens held; false if the client is gone.
    fn flush(&mut self) -> bool {
        self.held.drain(..).all(|(token, text)| {
            self.conn
                .send(&Reply::event(self.id, Event::Token { token, text }))
        })
    }

    /// Ends the answer: a whole tool call is sent as one event, any other tokens held are sent.
    /// Returns the stop reason this answer sets (`tool_call`, `stop_string`), if any.
    fn finish(&mut self) -> Option<&'static str> {
        let call = self
            .tool_calls
            .then(|| tool_call_json(&self.text))
            .flatten()
            .and_then(|json| serde_json::from_str::<serde_json::Value>(json).ok());
        if let Some(mut call) = call {
            let name = call["name"].as_str().unwrap_or_default().to_owned();
            let arguments = call["arguments"].take();
            self.held.clear();
            self.conn
                .send(&Reply::event(self.id, Event::ToolCall { name, arguments }));
            return Some("tool_call");
        }
        self.flush();
        self.stop_string.then_some("stop_string")
    }
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
        end_ms: None,
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
