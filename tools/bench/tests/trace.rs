//! The trace generator on the real model's tokenizer and real text: exact token counts within
//! each source's Table 3 range, the cap, Poisson arrivals, determinism, and the file's round trip
//! and its errors.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use bench::trace::{self, PastCap, Pattern, Source, Summary, Trace, TraceError, TraceSpec};
use model::fetch::{self, FetchOptions};
use model::tokenizer::Tokenizer;

/// The default model's tokenizer, fetched into the shared cache if missing; built once.
fn tokenizer() -> &'static Tokenizer {
    static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| {
        let path = fetch::default_model_path(&FetchOptions::default())
            .unwrap_or_else(|e| panic!("cannot fetch the default model: {e}"));
        Tokenizer::from_gguf_file(&path)
            .unwrap_or_else(|e| panic!("cannot build the tokenizer: {e}"))
    })
}

fn spec(seed: u64, calls: u64) -> TraceSpec {
    let mut s = TraceSpec::new("SmolLM2-135M-Instruct.Q4_1.gguf");
    s.seed = seed;
    s.calls = calls;
    s
}

fn bytes(t: &Trace) -> Vec<u8> {
    let mut v = Vec::new();
    trace::write_to(t, &mut v).unwrap();
    v
}

#[test]
fn prompts_are_real_text_of_exactly_the_drawn_length_within_table_3() {
    let tok = tokenizer();
    let mut s = spec(1, 240);
    s.contexts = 12;
    s.rate = 2.0;
    let t = trace::generate(&s, tok).unwrap();
    assert_eq!(t.rows.len(), 240);
    for (i, r) in t.rows.iter().enumerate() {
        let (lo, hi) = r.source.delta();
        assert!(
            (lo..=hi).contains(&r.tokens),
            "row {i}: {} tokens of {}",
            r.tokens,
            r.source
        );
        assert_eq!(
            tok.encode(&r.prompt).len(),
            r.tokens as usize,
            "row {i}: the count is not exact"
        );
        assert!(r.prompt.starts_with(r.source.instruction()) || r.tokens < 20);
        assert_eq!(r.max_tokens, 32);
        let c = &t.header.contexts[r.context as usize];
        assert_eq!((c.app.as_str(), c.source), (r.app.as_str(), r.source));
    }
    // Real licence text, not filler.
    let all: String = t.rows.iter().map(|r| r.prompt.as_str()).collect();
    assert!(all.contains("License") || all.contains("license"));
    // Every source is used, in turn over contexts, and the draws spread over each range.
    let sum = Summary::of(&t);
    assert_eq!(sum.per_source.len(), 6);
    for src in &sum.per_source {
        assert_eq!(src.contexts, 2);
        let (lo, hi) = src.range;
        let width = f64::from(hi - lo);
        assert!(src.calls > 5, "{src:?}");
        assert!(
            src.tokens.min < f64::from(lo) + 0.4 * width
                && src.tokens.max > f64::from(hi) - 0.4 * width,
            "{src:?}"
        );
    }
    // Excerpts start at a sentence: an upper-case letter, a digit, a quote or a bracket.
    for r in t.rows.iter().filter(|r| r.tokens >= 20) {
        let text = r.prompt.split_once("\n\n").unwrap().1;
        let first = text.chars().next().unwrap();
        assert!(
            first.is_uppercase() || first.is_ascii_digit() || "\"'(".contains(first),
            "{:?}",
            &text[..40.min(text.len())]
        );
    }
    // Contexts continue through the text: a context's consecutive prompts differ.
    let first: Vec<&str> = t
        .rows
        .iter()
        .filter(|r| r.context == 0)
        .map(|r| r.prompt.as_str())
        .collect();
    assert!(first.windows(2).all(|w| w[0] != w[1]));
}

#[test]
fn the_same_seed_gives_the_same_bytes_and_another_seed_another_trace() {
    let tok = tokenizer();
    let a = bytes(&trace::generate(&spec(7, 60), tok).unwrap());
    let b = bytes(&trace::generate(&spec(7, 60), tok).unwrap());
    let c = bytes(&trace::generate(&spec(8, 60), tok).unwrap());
    assert_eq!(a, b);
    assert_ne!(a, c);
}

#[test]
fn context_lengths_add_up_and_respect_the_cap() {
    let tok = tokenizer();
    for past_cap in [PastCap::Slide, PastCap::Restart] {
        let mut s = spec(3, 150);
        s.contexts = 4;
        s.max_context = 2100;
        s.past_cap = past_cap;
        s.pattern = Pattern::Random;
        let t = trace::generate(&s, tok).unwrap();
        let mut len = [0u64; 4];
        let mut past = 0;
        for r in &t.rows {
            let c = r.context as usize;
            assert_eq!(
                r.start,
                len[c] == 0
                    || (past_cap == PastCap::Restart
                        && len[c] + u64::from(r.tokens + r.max_tokens) > 2100)
            );
            if r.start {
                len[c] = 0;
            }
            len[c] += u64::from(r.tokens + r.max_tokens);
            assert_eq!(r.context_tokens, len[c]);
            // One call always fits.
            assert!(r.tokens + r.max_tokens <= 2100);
            match past_cap {
                PastCap::Restart => assert!(r.context_tokens <= 2100, "{r:?}"),
                PastCap::Slide => past += usize::from(r.context_tokens > 2100),
            }
        }
        if past_cap == PastCap::Slide {
            assert!(
                past > 50,
                "a slide trace this long goes past the cap: {past}"
            );
            let sum = Summary::of(&t);
            assert_eq!(
                sum.per_context.iter().map(|c| c.past_cap).sum::<u64>(),
                past as u64
            );
            assert!(sum.per_context.iter().all(|c| c.final_tokens <= 2100));
            let appended: u64 = t
                .rows
                .iter()
                .map(|r| u64::from(r.tokens + r.max_tokens))
                .sum();
            assert_eq!(
                sum.per_context
                    .iter()
                    .map(|c| c.appended_tokens)
                    .sum::<u64>(),
                appended
            );
        } else {
            assert!(t.rows.iter().filter(|r| r.start).count() > 10);
        }
    }
}

#[test]
fn long_sources_open_with_a_document_and_grow_to_the_limit() {
    let tok = tokenizer();
    for past_cap in [PastCap::Slide, PastCap::Restart] {
        let mut s = spec(5, 240);
        s.contexts = 2;
        s.sources = vec![Source::Document, Source::Chat];
        s.max_context = 8192;
        s.past_cap = past_cap;
        s.pattern = Pattern::Random;
        let t = trace::generate(&s, tok).unwrap();
        let (doc_lo, doc_hi) = Source::Document.opening(8192).unwrap();
        assert_eq!((doc_lo, doc_hi), (4096, 6144), "three quarters of 8192");
        let mut docs = 0;
        for (i, r) in t.rows.iter().enumerate() {
            assert_eq!(tok.encode(&r.prompt).len(), r.tokens as usize, "row {i}");
            let (lo, hi, instruction) = match (r.source, r.start) {
                (Source::Document, true) => {
                    (doc_lo, doc_hi, Source::Document.opening_instruction())
                }
                (src, _) => (src.delta().0, src.delta().1, src.instruction()),
            };
            assert!((lo..=hi).contains(&r.tokens), "row {i}: {r:?}");
            // Very short prompts drop the instruction rather than the text.
            assert!(
                r.prompt.starts_with(instruction) || r.tokens < 20,
                "row {i}"
            );
            docs += usize::from(r.source == Source::Document && r.start);
        }
        let chat_max = (t.rows.iter())
            .filter(|r| r.source == Source::Chat)
            .map(|r| r.context_tokens)
            .max()
            .unwrap();
        match past_cap {
            PastCap::Slide => {
                assert_eq!(docs, 1, "one conversation: one document");
                assert!(chat_max > 8192, "the chat slides: {chat_max}");
            }
            PastCap::Restart => assert!(docs > 1, "each new conversation opens with one"),
        }
    }
    let mut short = spec(5, 10);
    short.sources = vec![Source::Document];
    short.max_context = 4096;
    let e = trace::generate(&short, tok).unwrap_err().to_string();
    assert!(e.contains("too short for document"), "{e}");
}

#[test]
fn arrivals_are_poisson_at_the_rate() {
    let tok = tokenizer();
    let mut s = spec(5, 3000);
    s.rate = 0.5;
    s.sources = vec![Source::Sst2];
    s.max_context = 512;
    let t = trace::generate(&s, tok).unwrap();
    let sum = Summary::of(&t);
    // Mean gap 2 s (sd of the mean 2/sqrt(3000) ≈ 0.037), cv 1 (sd ≈ 0.04); times kept to 1 µs.
    assert!((sum.interarrival_s.mean - 2.0).abs() < 0.15, "{sum:?}");
    assert!((sum.interarrival_cv - 1.0).abs() < 0.15, "{sum:?}");
    assert!(t.rows.windows(2).all(|w| w[0].time <= w[1].time));
    assert!(
        t.rows
            .iter()
            .all(|r| (r.time * 1e6 - (r.time * 1e6).round()).abs() < 1e-3)
    );
}

#[test]
fn a_trace_reads_back_as_written_and_its_summary_counts_switches() {
    let tok = tokenizer();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.jsonl");
    let mut s = spec(2, 80);
    s.pattern = Pattern::Markov {
        stay: 0.9,
        neighbour: 0.1,
    };
    let t = trace::generate(&s, tok).unwrap();
    trace::write(&t, &path).unwrap();
    let back = trace::read(&path).unwrap();
    assert_eq!(back, t);
    assert_eq!(bytes(&back), std::fs::read(&path).unwrap());
    let sum = Summary::of(&back);
    assert_eq!(sum.calls, 80);
    // stay 0.9: about one call in ten switches, and only to a neighbour.
    assert!(sum.switch_fraction < 0.25, "{sum:?}");
    for w in t.rows.windows(2) {
        let d = (w[1].context + 8 - w[0].context) % 8;
        assert!(
            matches!(d, 0 | 1 | 7),
            "{} -> {}",
            w[0].context,
            w[1].context
        );
    }
    let total: u64 = sum.reuse_distance.counts.iter().sum();
    assert_eq!(total, 80 - u64::from(sum.contexts_called));
    assert_eq!(
        sum.reuse_distance.counts[0],
        (sum.calls - 1) - (sum.switch_fraction * 79.0).round() as u64
    );
}

/// Reads `text` as a trace file and returns the error's message.
fn read_err(dir: &Path, text: &str) -> (TraceError, String) {
    let path: PathBuf = dir.join("bad.jsonl");
    std::fs::write(&path, text).unwrap();
    let e = trace::read(&path).unwrap_err();
    let m = e.to_string();
    (e, m)
}

#[test]
fn malformed_files_are_refused_with_the_line() {
    let tok = tokenizer();
    let dir = tempfile::tempdir().unwrap();
    let t = trace::generate(&spec(4, 5), tok).unwrap();
    let good = String::from_utf8(bytes(&t)).unwrap();
    let lines: Vec<&str> = good.lines().collect();
    let with = |i: usize, new: &str| {
        let mut l = lines.clone();
        l[i] = new;
        l.join("\n")
    };
    let check = |text: String, says: &str| {
        let (_, m) = read_err(dir.path(), &text);
        assert!(m.contains(says), "expected {says:?} in {m:?}");
    };
    check(String::new(), "is empty");
    check(
        with(0, "{\"format\":\"other\"}"),
        "bad.jsonl:1: not an llms trace",
    );
    check(
        with(0, &lines[0].replace("\"version\":1", "\"version\":9")),
        ":1: trace format version 9",
    );
    check(with(3, "{\"time\":1.0}"), "bad.jsonl:4: not a trace row");
    check(with(2, "not json"), "bad.jsonl:3: not a trace row");
    check(
        with(
            2,
            &lines[2].replace(
                &format!("\"context\":{}", t.rows[1].context),
                "\"context\":99",
            ),
        ),
        ":3: context 99 is not in the header",
    );
    check(
        with(
            5,
            &lines[5].replace(&format!("\"time\":{}", t.rows[4].time), "\"time\":0.0"),
        ),
        ":6: time 0 is before",
    );
    check(lines[..4].join("\n"), "says 5 calls but the file has 3");
    let missing = trace::read(&dir.path().join("nope.jsonl")).unwrap_err();
    assert!(matches!(missing, TraceError::Read { .. }), "{missing}");
    // Blank lines (a trailing newline, say) are fine.
    let (_, m) = read_err(dir.path(), "\n");
    assert!(m.contains("is empty"));
    std::fs::write(dir.path().join("ok.jsonl"), format!("{good}\n\n")).unwrap();
    assert_eq!(trace::read(&dir.path().join("ok.jsonl")).unwrap(), t);
}

/// A change to a good spec.
type Edit = fn(&mut TraceSpec);

#[test]
fn specs_that_make_no_trace_are_refused() {
    let tok = tokenizer();
    let cases: &[(Edit, &str)] = &[
        (|s| s.rate = 0.0, "positive"),
        (|s| s.rate = -1.0, "positive"),
        (|s| s.calls = 0, "calls"),
        (|s| s.contexts = 0, "contexts"),
        (|s| s.sources.clear(), "no sources"),
        (
            |s| s.max_context = 1024,
            "raise the maximum context to at least 2032",
        ),
        (
            |s| {
                s.pattern = Pattern::Markov {
                    stay: 0.8,
                    neighbour: 0.8,
                }
            },
            "at most 1",
        ),
        (|s| s.text.clear(), "no text files"),
        (
            |s| s.text = vec!["/nonexistent/text".into()],
            "cannot read the text file",
        ),
        (
            |s| s.text = vec!["/usr/share/common-licenses/BSD".into()],
            "fewer than",
        ),
    ];
    for (edit, says) in cases {
        let mut s = spec(0, 3);
        edit(&mut s);
        let e = trace::generate(&s, tok).unwrap_err().to_string();
        assert!(e.contains(says), "expected {says:?} in {e:?}");
    }
}
