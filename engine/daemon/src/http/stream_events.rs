//! A response's answer streamed as the responses API's typed
//! server-sent events (`response.created`, `response.output_text.delta`, ...,
//! `response.completed`), each numbered.

use protocol::ErrorBody;
use serde_json::{Value, json};

use crate::http::answer::{self, Answer, Piece};
use crate::http::body::Events;
use crate::http::ids;
use crate::http::session::Session;
use crate::http::shapes::{Meta, ResponsesRequest, response_json};

/// Numbered events of one stream.
struct Numbered<'a> {
    ev: &'a Events,
    next: u64,
    open: bool,
}

impl Numbered<'_> {
    async fn send(&mut self, kind: &str, mut data: Value) {
        if !self.open {
            return;
        }
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.next);
        self.next += 1;
        self.open = self.ev.send(Some(kind), &data).await;
    }
}

/// Streams a response's answer as typed events; returns the answer, an error if the call
/// failed or the client went away midway (the call is then cancelled).
pub async fn stream(
    s: &mut Session,
    id: u64,
    first: Piece,
    meta: &Meta,
    req: &ResponsesRequest,
    ev: &Events,
) -> Result<Answer, ErrorBody> {
    let mut n = Numbered {
        ev,
        next: 0,
        open: true,
    };
    let start = response_json(meta, req, None, "in_progress");
    n.send("response.created", json!({"response": start})).await;
    n.send("response.in_progress", json!({"response": start}))
        .await;
    let item = ids::item("msg", &meta.id);
    let mut text_open = false;
    let mut text = String::new();
    let mut tool_call = None;
    let mut piece = first;
    let done = loop {
        match piece {
            Piece::Text(t) => {
                if !text_open {
                    text_open = true;
                    let added = json!({"id": item, "type": "message", "status": "in_progress", "role": "assistant", "content": []});
                    n.send(
                        "response.output_item.added",
                        json!({"output_index": 0, "item": added}),
                    )
                    .await;
                    let part = json!({"type": "output_text", "text": "", "annotations": []});
                    n.send("response.content_part.added", json!({"item_id": item, "output_index": 0, "content_index": 0, "part": part})).await;
                }
                text.push_str(&t);
                n.send("response.output_text.delta", json!({"item_id": item, "output_index": 0, "content_index": 0, "delta": t, "logprobs": []})).await;
            }
            Piece::ToolCall { name, arguments } => tool_call = Some((name, arguments)),
            Piece::Done(d) => break d,
        }
        if !n.open {
            s.cancel();
            return Err(ErrorBody::new("cancelled", "the client went away"));
        }
        piece = answer::next(s, id).await?;
    };
    let a = Answer {
        text,
        tool_call,
        done,
    };
    let whole = response_json(meta, req, Some(&a), "completed");
    let out = whole["output"][0].clone();
    if text_open {
        let shown = out["content"][0]["text"].clone();
        n.send("response.output_text.done", json!({"item_id": item, "output_index": 0, "content_index": 0, "text": shown, "logprobs": []})).await;
        n.send("response.content_part.done", json!({"item_id": item, "output_index": 0, "content_index": 0, "part": out["content"][0]})).await;
    } else if a.tool_call.is_some() {
        let mut added = out.clone();
        added["status"] = json!("in_progress");
        added["arguments"] = json!("");
        n.send(
            "response.output_item.added",
            json!({"output_index": 0, "item": added}),
        )
        .await;
        n.send(
            "response.function_call_arguments.delta",
            json!({"item_id": out["id"], "output_index": 0, "delta": out["arguments"]}),
        )
        .await;
        n.send(
            "response.function_call_arguments.done",
            json!({"item_id": out["id"], "output_index": 0, "arguments": out["arguments"]}),
        )
        .await;
    }
    if text_open || a.tool_call.is_some() {
        n.send(
            "response.output_item.done",
            json!({"output_index": 0, "item": out}),
        )
        .await;
    }
    let kind = match whole["status"].as_str() {
        Some("incomplete") => "response.incomplete",
        _ => "response.completed",
    };
    n.send(kind, json!({"response": whole})).await;
    Ok(a)
}
