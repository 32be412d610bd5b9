//! A constraint on the next token (structured output): a [`Guide`] masks the logits before
//! each token is sampled, is told each token chosen, and may end the answer;
//! [`crate::generate::generate_guided`] runs generation under one.

/// What the guide says before a token is sampled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Next {
    /// Sample from the masked logits.
    Sample,
    /// The answer is complete: stop here (reported as a stop token would be).
    End,
}

/// A constraint on the tokens of an answer.
pub trait Guide {
    /// Masks (sets to -inf) the logits of every token that may not come next; `remaining`
    /// tokens may still be generated, this one included.
    fn constrain(&mut self, logits: &mut [f32], remaining: usize) -> Next;
    /// The token chosen (a stop token included).
    fn advance(&mut self, token: u32);
}
