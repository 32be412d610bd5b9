//! `llms chat`: a conversation with the daemon, one context, streamed to stdout. If no daemon
//! listens on the socket, it starts `llms serve` in the background and says so; the daemon keeps
//! running for the next command. `--local` runs the model in this process instead.

use std::io::Write;

use anyhow::Context;
use protocol::client::{CallEvent, Client, ClientError};
use protocol::{PromptFormat, ResponseFormat, Tool, ToolChoice};

use crate::cmd::engine::ChatArgs;
use crate::cmd::serve::start_background;

fn connect_or_start(a: &ChatArgs) -> anyhow::Result<Client> {
    let path = a.socket.path();
    match Client::connect(&path, &a.app) {
        Ok(c) => return Ok(c),
        Err(ClientError::Connect { source, .. })
            if matches!(
                source.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
            ) => {}
        Err(e) => return Err(e).context("cannot talk to the daemon"),
    }
    eprintln!(
        "llms chat: no daemon on {}; starting `llms serve` in the background",
        path.display()
    );
    match start_background(&path, a.engine.model.as_deref()) {
        Ok((pid, log)) => eprintln!(
            "llms chat: llms serve is pid {pid} (log {}); it keeps serving, stop it with `kill {pid}`",
            log.display()
        ),
        // Another chat may have started one at the same moment: use it if it is there.
        Err(e) => {
            return Client::connect(&path, &a.app)
                .map_err(|_| e)
                .context("cannot start the daemon");
        }
    }
    Client::connect(&path, &a.app).context("the daemon started but does not answer")
}

/// Runs `llms chat`.
pub fn run(a: ChatArgs) -> anyhow::Result<()> {
    if a.local {
        return crate::cmd::engine::run_chat(a);
    }
    let mut params = a.sample.params()?;
    params.response_format = response_format(&a)?;
    let tools = tools(&a)?;
    params.tool_choice = a.tool_choice.as_deref().map(|c| match c {
        "auto" => ToolChoice::Auto,
        "required" => ToolChoice::Required,
        "none" => ToolChoice::None,
        name => ToolChoice::Tool(name.to_owned()),
    });
    let mut client = match connect_or_start(&a) {
        Ok(c) => c,
        // A machine where the service cannot run (no userfaultfd for this user, say) still
        // gets its answer, from the model in this process.
        Err(e) if a.context.is_none() => {
            eprintln!("llms chat: {e:#}; answering in this process instead (--local)");
            return crate::cmd::engine::run_chat(a);
        }
        Err(e) => return Err(e),
    };
    let (ctx, created) = match a.context {
        Some(id) => {
            let info = client.info(id)?;
            eprintln!("llms chat: context {id}, {} tokens so far", info.tokens);
            (id, false)
        }
        None => match &a.transcript {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("cannot read {}", path.display()))?;
                let t: protocol::Transcript = serde_json::from_str(&text)
                    .with_context(|| format!("{} is not a transcript", path.display()))?;
                let id = client
                    .new_from_transcript(&t)
                    .with_context(|| format!("cannot rebuild a context from {}", path.display()))?;
                eprintln!(
                    "llms chat: context {id} rebuilt from {} turns",
                    t.turns.len()
                );
                (id, true)
            }
            None if !tools.is_empty() => (
                client
                    .new_with_tools(a.system.as_deref(), &tools)
                    .context("cannot declare the tools")?,
                true,
            ),
            None => (
                client.new_context(a.system.as_deref(), PromptFormat::Chat)?,
                true,
            ),
        },
    };
    let r = chat(&mut client, ctx, &a, &params);
    if created && !a.keep {
        client.delete(ctx)?;
    } else {
        eprintln!("[context {ctx}: continue it with `llms chat --context {ctx}`]");
    }
    r
}

/// The answers' format, from `--json-schema` or `--regex`.
fn response_format(a: &ChatArgs) -> anyhow::Result<Option<ResponseFormat>> {
    if let Some(path) = &a.json_schema {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let schema = serde_json::from_str(&text)
            .with_context(|| format!("{} is not JSON", path.display()))?;
        return Ok(Some(ResponseFormat::JsonSchema { schema }));
    }
    Ok(a.regex
        .clone()
        .map(|pattern| ResponseFormat::Regex { pattern }))
}

/// The tools of `--tools`.
fn tools(a: &ChatArgs) -> anyhow::Result<Vec<Tool>> {
    let Some(path) = &a.tools else {
        return Ok(Vec::new());
    };
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| {
        format!(
            "{} is not a JSON list of tools ({{\"name\", \"description\", \"parameters\"}})",
            path.display()
        )
    })
}

fn chat(
    client: &mut Client,
    ctx: u64,
    a: &ChatArgs,
    params: &protocol::client::CallParams,
) -> anyhow::Result<()> {
    // After a tool call, the next line is the tool's result.
    let mut pending_call = false;
    let turn = |prompt: &str| -> anyhow::Result<()> {
        let mut out = std::io::stdout().lock();
        let stream = match std::mem::take(&mut pending_call) {
            true => client.tool_result(ctx, prompt, params)?,
            false => client.call(ctx, prompt, params)?,
        };
        for ev in stream {
            match ev? {
                CallEvent::Token { text, .. } => {
                    write!(out, "{text}")?;
                    out.flush()?;
                }
                CallEvent::ToolCall(c) => {
                    write!(out, "[tool_call {} {}]", c.name, c.arguments)?;
                    pending_call = true;
                }
                CallEvent::Done(d) => {
                    writeln!(out)?;
                    let t = &d.timings;
                    let left = d
                        .remaining
                        .map(|r| format!(", {r} of {} tokens left", d.context_window.unwrap_or(0)))
                        .unwrap_or_default();
                    eprintln!(
                        "[switch {:.1} ms, {} prompt tokens at {:.0} t/s, {} generated at {:.1} t/s, stop: {}{left}]",
                        t.switch_ms,
                        t.prefill_tokens,
                        t.prefill_tps,
                        d.tokens,
                        t.decode_tps,
                        d.stop
                    );
                }
            }
        }
        Ok(())
    };
    crate::cmd::engine::converse(a.prompt.as_deref(), turn)
}
