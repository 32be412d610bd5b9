//! `llms bench http`: what the OpenAI-compatible HTTP API adds to a call over the socket
//! protocol, on one running daemon in one run. Three conversations grow in step, call after
//! call with the same prompt and greedy answers, so the engine does the same work for each: one
//! on the socket (`call`), one through `/v1/responses` with `previous_response_id`, one through
//! `/v1/chat/completions` whose messages extend the conversation it held (the HTTP API's
//! prefix reuse). Each call is timed by the client from its request to its whole answer; the
//! HTTP requests go over the HTTP Unix socket on one keep-alive connection, by hand (HTTP/1.1
//! with a content length), so no client library is measured with them.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, bail};
use protocol::client::{CallParams, Client};
use serde_json::{Value, json};
use uffd_pager::median;

/// What to measure.
#[derive(Debug, Clone)]
pub struct HttpBenchSpec {
    /// The daemon's protocol socket.
    pub socket: PathBuf,
    /// Its HTTP API's Unix socket (`--http unix:PATH`).
    pub http: PathBuf,
    pub calls: usize,
    pub max_tokens: usize,
    pub prompt: String,
}

/// One path's call latencies, in milliseconds.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Latencies {
    pub median_ms: f64,
    pub min_ms: f64,
    pub max_ms: f64,
}

impl Latencies {
    fn of(ms: &[f64]) -> Latencies {
        Latencies {
            median_ms: median(ms.iter().copied()),
            min_ms: ms.iter().copied().fold(f64::INFINITY, f64::min),
            max_ms: ms.iter().copied().fold(0.0, f64::max),
        }
    }
}

/// The figures.
#[derive(Debug, Clone, serde::Serialize)]
pub struct HttpBenchReport {
    pub calls: usize,
    pub max_tokens: usize,
    pub socket: Latencies,
    pub responses: Latencies,
    pub chat: Latencies,
    /// Median of the per-call differences (the HTTP call minus the socket call made just
    /// before it, same context length).
    pub responses_overhead_ms: f64,
    pub chat_overhead_ms: f64,
    /// Tokens each conversation held at the end (the same for the three).
    pub context_tokens: usize,
}

/// One keep-alive HTTP/1.1 connection to the HTTP API's Unix socket.
struct Http {
    out: UnixStream,
    input: BufReader<UnixStream>,
}

impl Http {
    fn connect(path: &std::path::Path) -> anyhow::Result<Http> {
        let s = UnixStream::connect(path)
            .with_context(|| format!("cannot connect to {}", path.display()))?;
        Ok(Http {
            out: s.try_clone()?,
            input: BufReader::new(s),
        })
    }

    /// Sends a request and reads its whole answer (`GET` without a body).
    fn request(&mut self, method: &str, path: &str, body: Option<&Value>) -> anyhow::Result<Value> {
        let body = body.map(Value::to_string).unwrap_or_default();
        write!(
            self.out,
            "{method} {path} HTTP/1.1\r\nhost: llms\r\ncontent-type: application/json\r\n\
             content-length: {}\r\n\r\n{body}",
            body.len()
        )?;
        let mut status = String::new();
        self.input.read_line(&mut status)?;
        let mut length = 0usize;
        loop {
            let mut line = String::new();
            self.input.read_line(&mut line)?;
            if line.trim_end().is_empty() {
                break;
            }
            if let Some((k, v)) = line.split_once(':')
                && k.eq_ignore_ascii_case("content-length")
            {
                length = v.trim().parse()?;
            }
        }
        let mut bytes = vec![0; length];
        self.input.read_exact(&mut bytes)?;
        let v: Value = serde_json::from_slice(&bytes)?;
        if !status.contains(" 200 ") {
            bail!("{method} {path}: {} {v}", status.trim());
        }
        Ok(v)
    }
}

/// Runs the measurement.
pub fn run(spec: &HttpBenchSpec) -> anyhow::Result<HttpBenchReport> {
    let mut c = Client::connect(&spec.socket, "bench-http").context("the protocol socket")?;
    let mut http = Http::connect(&spec.http)?;
    let model = http.request("GET", "/v1/models", None)?["data"][0]["id"].clone();
    let params = CallParams {
        max_tokens: spec.max_tokens,
        ..CallParams::default()
    };
    let ctx = c.new_context(None, Default::default())?;
    let (mut socket, mut responses, mut chat) = (Vec::new(), Vec::new(), Vec::new());
    let mut previous: Option<String> = None;
    let mut messages: Vec<Value> = Vec::new();
    let mut context_tokens = 0;
    for _ in 0..spec.calls {
        let t = Instant::now();
        let a = c.call(ctx, &spec.prompt, &params)?.collect_answer()?;
        socket.push(t.elapsed().as_secs_f64() * 1e3);
        context_tokens = a.done.context_tokens;

        let mut body = json!({"model": model, "input": spec.prompt, "temperature": 0,
            "max_output_tokens": spec.max_tokens});
        if let Some(p) = &previous {
            body["previous_response_id"] = json!(p);
        }
        let t = Instant::now();
        let r = http.request("POST", "/v1/responses", Some(&body))?;
        responses.push(t.elapsed().as_secs_f64() * 1e3);
        previous = r["id"].as_str().map(str::to_owned);

        messages.push(json!({"role": "user", "content": spec.prompt}));
        let body = json!({"model": model, "messages": messages, "temperature": 0,
            "max_tokens": spec.max_tokens});
        let t = Instant::now();
        let r = http.request("POST", "/v1/chat/completions", Some(&body))?;
        chat.push(t.elapsed().as_secs_f64() * 1e3);
        let cached = r["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
        if messages.len() > 1 && cached == Some(0) {
            bail!("the chat completion did not continue its conversation: {r}");
        }
        messages.push(json!({"role": "assistant",
            "content": r["choices"][0]["message"]["content"]}));
    }
    c.delete(ctx)?;
    let diff = |h: &[f64]| median(h.iter().zip(&socket).map(|(h, s)| h - s));
    Ok(HttpBenchReport {
        calls: spec.calls,
        max_tokens: spec.max_tokens,
        socket: Latencies::of(&socket),
        responses: Latencies::of(&responses),
        chat: Latencies::of(&chat),
        responses_overhead_ms: diff(&responses),
        chat_overhead_ms: diff(&chat),
        context_tokens,
    })
}
