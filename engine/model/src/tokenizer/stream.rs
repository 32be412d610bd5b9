//! Turning generated tokens into text as they come, never emitting half a UTF-8 character.

use super::*;

/// Turns tokens into text as they are generated, never emitting half a UTF-8 character:
/// bytes of an incomplete character wait for the next token.
#[derive(Debug, Clone, Default)]
pub struct StreamDecoder {
    pending: Vec<u8>,
    skip_control: bool,
}

impl StreamDecoder {
    /// A decoder; with `skip_control` control tokens (e.g. `<|im_end|>`) produce no text.
    pub fn new(skip_control: bool) -> StreamDecoder {
        StreamDecoder {
            pending: Vec::new(),
            skip_control,
        }
    }

    /// Adds one token and returns the text that is complete now (possibly empty).
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> String {
        if self.skip_control && tokenizer.is_control(id) {
            return String::new();
        }
        if let Some(b) = tokenizer.token_bytes(id) {
            self.pending.extend_from_slice(b);
        }
        let mut text = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    text.push_str(s);
                    self.pending.clear();
                    return text;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    text.push_str(&String::from_utf8_lossy(&self.pending[..valid]));
                    match e.error_len() {
                        // An incomplete character at the end: wait for more bytes.
                        None => {
                            self.pending.drain(..valid);
                            return text;
                        }
                        // Bytes that can never become valid: replace them and go on.
                        Some(bad) => {
                            text.push('\u{FFFD}');
                            self.pending.drain(..valid + bad);
                        }
                    }
                }
            }
        }
    }

    /// Ends the stream: whatever incomplete bytes are left come out as U+FFFD.
    pub fn finish(&mut self) -> String {
        let text = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        text
    }
}
