//! Tests of the SentencePiece tokenizer on the real Gemma 3 vocabulary (262,144 tokens, from the
//! GGUF that `llms model fetch gemma3-270m` caches): known token ids, round trips, control tokens,
//! the chat template.
#![allow(clippy::print_stderr)]

use std::sync::OnceLock;

use model::fetch::{self, FetchOptions, GEMMA3_270M};
use model::tokenizer::{ChatTemplate, Message, StreamDecoder, Tokenizer, TokenizerKind};

/// Gemma 3's tokenizer, the model fetched into the shared cache if missing (as the tests of the
/// default model do); built once per test binary.
fn tokenizer() -> &'static Tokenizer {
    static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| {
        let path = fetch::ensure(&FetchOptions::default(), &GEMMA3_270M)
            .unwrap_or_else(|e| panic!("cannot fetch gemma3-270m: {e}"));
        Tokenizer::from_gguf_file(&path)
            .unwrap_or_else(|e| panic!("cannot build the tokenizer: {e}"))
    })
}

/// `text` encodes to `expected` (control tokens recognised only if `expected` has some), and
/// `expected` decodes back to `text`.
fn check(text: &str, expected: &[u32]) {
    let t = tokenizer();
    if expected.iter().any(|&id| t.is_control(id)) {
        assert_eq!(
            t.encode_with_special(text),
            expected,
            "encode_with_special({text:?})"
        );
    } else {
        assert_eq!(t.encode(text), expected, "encode({text:?})");
        assert_eq!(
            t.encode_with_special(text),
            expected,
            "with special {text:?}"
        );
    }
    assert_eq!(t.decode(expected), text, "decode of {text:?}");
}

/// The expected ids were produced once by an independent implementation, the `sentencepiece`
/// Python package (0.2.3), with a BPE model built from this GGUF's `tokenizer.ggml.tokens`,
/// `scores` and `token_type` (read with the `gguf` package 0.19.0; identity normalizer, no dummy
/// prefix, byte fallback), `encode(text)`; a few checked by hand against the vocabulary: 9259 is
/// `Hello`, 1902 `▁world`, 236764 `,`, 236888 `!`, 238 + b is the byte token `<0xb>`.
#[test]
fn known_ids_from_an_independent_sentencepiece() {
    check("Hello world", &[9259, 1902]);
    check("Hello, world!", &[9259, 236764, 1902, 236888]);
    check(
        "The quick brown fox jumps over the lazy dog.",
        &[
            818, 3823, 8864, 37423, 38167, 1024, 506, 31770, 4799, 236761,
        ],
    );
    check(" leading space", &[5830, 2557]);
    check(
        "12345 apples",
        &[236770, 236778, 236800, 236812, 236810, 36157],
    );
    check(
        "Ça va? Très bien.",
        &[231436, 5380, 236881, 136890, 6472, 236761],
    );
    check("Привет, мир!", &[116130, 236764, 58562, 236888]);
    check("日本語のテキスト", &[94951, 236945, 95830]);
    check("emoji 🦀 crab", &[67906, 236743, 248714, 43695]);
    check("héllo ü 🦀", &[236754, 7869, 844, 4741, 236743, 248714]);
    // Characters outside the vocabulary: their UTF-8 bytes, <0xF0> <0xA0> <0x80> <0x80>...
    check("𠀀", &[478, 398, 366, 366]);
    check("\u{378}", &[443, 422]);
    check("𝕏", &[478, 395, 387, 381]);
    // Newlines and tabs are user-defined tokens of their own (107 is "\n", 255968 "\t").
    check("a\nb", &[236746, 107, 236763]);
    check("tab\there", &[4823, 255968, 8472]);
    // A control token's spelling in plain text is its characters: < start _ of _ turn >.
    assert_eq!(
        tokenizer().encode("<start_of_turn>"),
        [236820, 3041, 236779, 1340, 236779, 887, 236813]
    );
}

/// Where llama.cpp and SentencePiece differ, this tokenizer does as llama.cpp: user-defined tokens
/// (Gemma's runs of spaces, newlines, tabs and HTML tags) are cut out of the text before the
/// merges. The ids were computed once with this implementation and checked by hand against the
/// vocabulary: 138 is "  " (two spaces, user-defined), 108 "\n\n", 105 `<start_of_turn>`, 106
/// `<end_of_turn>`, 2364 `user`, 10979 `Hi`, 13498 `two`, 9952 `▁spaces`, 107 "\n".
#[test]
fn known_ids_where_llama_cpp_cuts_user_defined_tokens_first() {
    check("  two spaces", &[138, 13498, 9952]);
    check("a\n\nb", &[236746, 108, 236763]);
    check(
        "<start_of_turn>user\nHi<end_of_turn>\n",
        &[105, 2364, 107, 10979, 106, 107],
    );
}

#[test]
fn vocabulary_and_special_tokens() {
    let t = tokenizer();
    assert_eq!(t.kind(), TokenizerKind::SentencePiece);
    assert_eq!(t.vocab_size(), 262_144);
    assert_eq!(
        (t.bos_id(), t.eos_id(), t.unknown_id(), t.padding_id()),
        (Some(2), Some(1), Some(3), Some(0))
    );
    assert!(t.add_bos());
    assert_eq!(t.token_id("<start_of_turn>"), Some(105));
    assert_eq!(t.token_id("<end_of_turn>"), Some(106));
    assert_eq!(t.stop_ids(), [1, 106]);
    for text in [
        "<bos>",
        "<eos>",
        "<start_of_turn>",
        "a<end_of_turn>b",
        "<pad><mask>",
    ] {
        let ids = t.encode(text);
        assert!(ids.iter().all(|&id| !t.is_control(id)), "{text:?}: {ids:?}");
        assert_eq!(t.decode(&ids), text);
    }
    assert_eq!(t.encode_with_special("<bos><eos>"), [2, 1]);
}

#[test]
fn round_trips_on_mixed_text() {
    let t = tokenizer();
    let texts = [
        "fn main() {\n    println!(\"hi\");\n}\n",
        "  \t mixed \u{a0} whitespace\r\n\n\n end ",
        "Ελληνικά, العربية, हिन्दी, 한국어, ภาษาไทย",
        "x\u{2581}y ▁▁ literal U+2581",
        "\u{0}\u{1}\u{7f}\u{feff}\u{10ffff}",
        "<table><tr><td>cell</td></tr></table>",
    ];
    for text in texts {
        let ids = t.encode(text);
        assert_eq!(t.decode(&ids), text);
        let mut dec = StreamDecoder::new(false);
        let mut streamed: String = ids.iter().map(|&id| dec.push(t, id)).collect();
        streamed.push_str(&dec.finish());
        assert_eq!(streamed, text);
    }
}

#[test]
fn chat_template_is_gemmas() {
    let t = tokenizer();
    // The file has no tokenizer.chat_template: the architecture's is used.
    assert_eq!(t.chat_template(), &ChatTemplate::Gemma);
    let messages = [Message::system("Be terse."), Message::user("What is 2+2?")];
    assert_eq!(
        t.apply_chat_template(&messages, true).ok().as_deref(),
        Some("<start_of_turn>user\nBe terse.\n\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n")
    );
    let ids = t.encode_chat(&messages, true).unwrap_or_default();
    assert_eq!(ids[..4], [2, 105, 2364, 107], "<bos><start_of_turn>user\\n");
    assert_eq!(
        ids[ids.len() - 3..],
        [105, 4368, 107],
        "<start_of_turn>model\\n"
    );
}
