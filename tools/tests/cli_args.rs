//! Arguments a user can type that make no sense (zeros, empty lists, huge values, a mistyped
//! store): `llms` exits non-zero with a message that names the problem, and never panics.
//! Every case here is refused before a model is loaded or a store created.

use std::path::Path;
use std::process::Command;

const LLMS: &str = env!("CARGO_BIN_EXE_llms");

/// Runs `llms args` in `dir` (so nothing lands in the source tree) and returns its stderr,
/// after checking that it failed with a message and without a panic.
fn refused(dir: &Path, args: &[&str], says: &str) -> String {
    let out = Command::new(LLMS)
        .args(args)
        .current_dir(dir)
        .env_remove("LLMS_MODEL")
        .env_remove("LLMS_STORE")
        .env_remove("LLMS_CONFIG")
        .env_remove("LLMS_PROFILE")
        .env("LLMS_MODELS_DIR", dir.join("no-models"))
        .env("XDG_CONFIG_HOME", dir.join("no-config"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "llms {args:?} succeeded: {err}");
    assert!(
        !err.contains("panicked") && out.status.code().is_some(),
        "llms {args:?} panicked: {err}"
    );
    assert!(
        err.contains(says),
        "llms {args:?}: expected {says:?} in {err}"
    );
    err
}

/// Each bad value of each command's options is a clear error, never a panic.
///
/// Kept whole: a table of bad command lines, each with the words its error must hold.
#[test]
fn zeros_empty_lists_and_huge_values_are_errors_not_panics() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("bad-profile.json"), "{\"recompute\": 1}").unwrap();
    let cases: &[(&[&str], &str)] = &[
        (&["bench", "kv", "--contexts", "0"], "at least 1"),
        (&["bench", "kv", "--contexts", ""], "--contexts"),
        (&["bench", "kv", "--reps", "0"], "at least 1"),
        (&["bench", "kv", "--recompute", "0"], "at least 1"),
        (&["bench", "kv", "--contexts", "99999999999"], "longer than"),
        (&["bench", "kv", "--contexts", "-1"], "'-1'"),
        (&["bench", "engine", "--runs", "0"], "at least 1"),
        (&["bench", "weights", "--budgets", "0"], "from 1 to 100"),
        (
            &["bench", "weights", "--budgets", "50,101"],
            "from 1 to 100",
        ),
        (
            &["bench", "weights", "--methods", "mmap,fast"],
            "unknown method",
        ),
        (&["bench", "weights", "--read-bps", "12X"], "not a size"),
        (&["bench", "weights", "--decode", "0"], "at least 1"),
        (&["bench", "weights", "--weight-budget", "1M"], "--budgets"),
        (
            &["generate", "--prompt", "x", "--weight-budget", "lots"],
            "not a size",
        ),
        (&["bench", "engine", "--prefill", "0"], "at least 1"),
        (&["bench", "engine", "--decode", "0"], "at least 1"),
        (&["bench", "engine", "--threads", "0"], "--threads"),
        (&["bench", "pager", "--sizes-kib", "0"], "at least 1"),
        (
            &["bench", "pager", "--sizes-kib", "99999999999999"],
            "--sizes-kib",
        ),
        (&["bench", "pager", "--runs", "0"], "at least 1"),
        (&["bench", "kvfs", "--mib", "0"], "at least 1"),
        (
            &["bench", "kvfs", "--mib", "18446744073709551615"],
            "too large",
        ),
        (&["bench", "kvfs", "--readers", "0"], "at least 1"),
        (&["bench", "kvfs", "--sizes", "0"], "at least 1"),
        (&["bench", "kvfs", "--rounds", "0"], "at least 1"),
        (&["bench", "load", "--lengths", "0"], "at least 16"),
        (&["bench", "load", "--runs", "0"], "at least 1"),
        (&["bench", "load", "--threads", "0"], "at least 1"),
        (&["bench", "load", "--throttle-mib", "0"], "--throttle-mib"),
        (&["bench", "load", "--chunk-tokens", "0"], "1..=256"),
        (&["bench", "load", "--chunk-tokens", "257"], "1..=256"),
        (
            &["bench", "load", "--threads", "99999999"],
            "--threads must be from 1",
        ),
        (&["profile", "--contexts", "0"], "at least 1"),
        (&["profile", "--contexts", "17"], "multiple of 16"),
        (&["profile", "--reps", "0"], "at least 1"),
        (&["bench", "crash", "--kills", "0"], "at least 1"),
        (&["bench", "crash", "--contexts", "0"], "at least 1"),
        (&["bench", "crash", "--max-tokens", "0"], "at least 1"),
        (
            &["bench", "switch", "t.jsonl", "--budget-contexts", "0"],
            "must be above 0",
        ),
        (
            &["bench", "switch", "t.jsonl", "--budget-contexts", "x"],
            "'x'",
        ),
        (
            &["bench", "switch", "t.jsonl", "--kv-budget", "0"],
            "at least 1 byte",
        ),
        (
            &["bench", "switch", "t.jsonl", "--kv-budget", "lots"],
            "not a size",
        ),
        (
            &[
                "bench",
                "switch",
                "t.jsonl",
                "--budget-contexts",
                "2",
                "--kv-budget",
                "1M",
            ],
            "cannot be used with",
        ),
        (
            &["bench", "switch", "t.jsonl", "--contexts", "0"],
            "at least 1",
        ),
        (
            &["bench", "switch", "t.jsonl", "--calls", "0"],
            "at least 1",
        ),
        (
            &["bench", "switch", "t.jsonl", "--chunk-tokens", "0"],
            "1..=256",
        ),
        (
            &["bench", "switch", "t.jsonl", "--threads", "0"],
            "at least 1",
        ),
        (
            &["bench", "switch", "t.jsonl", "--read-bps", "1"],
            "at least 4K",
        ),
        (
            &["bench", "switch", "t.jsonl", "--write-bps", "fast"],
            "not a size",
        ),
        (
            &["bench", "switch", "t.jsonl", "--managers", "llms,"],
            "no manager \"\"",
        ),
        (
            &["bench", "switch", "t.jsonl", "--managers", "vllm"],
            "the managers are llms",
        ),
        (
            &[
                "bench",
                "switch",
                "t.jsonl",
                "--llama-server",
                "no/llama-server",
            ],
            "build-llamacpp.sh",
        ),
        (
            &["bench", "switch", "t.jsonl", "--llama-server", "/"],
            "not an executable file",
        ),
        (
            &[
                "bench",
                "switch",
                "t.jsonl",
                "--llama-server",
                "/bin/sh",
                "--llama-kv",
                "q4_0",
            ],
            "the types compared are q8_0, f16",
        ),
        (
            &["bench", "switch", "t.jsonl", "--llama-kv", "f16"],
            "--llama-server",
        ),
        (
            &["bench", "switch", "no-such.jsonl"],
            "cannot read no-such.jsonl",
        ),
        (&["bench", "switch"], "<TRACE>"),
        (
            &["bench", "switch", "--replot", "no-such.json"],
            "cannot read no-such.json",
        ),
        (
            &["bench", "switch", "t.jsonl", "--replot", "r.json"],
            "cannot be used with",
        ),
        (&["profile", "--chunks", "4"], "two different chunk counts"),
        (
            &["profile", "--io-chunks", "8,8"],
            "--io-chunks needs at least two different chunk counts",
        ),
        (
            &["serve", "--profile", "no-such-profile.json"],
            "--profile: cannot read the profile no-such-profile.json",
        ),
        (
            &["serve", "--profile", "bad-profile.json"],
            "bad-profile.json is not a profile written by `llms profile`",
        ),
        (
            &["bench", "load", "--profile", "bad-profile.json"],
            "is not a profile written by `llms profile`",
        ),
        (&["serve", "--kv-budget", "99999999999G"], "too large"),
        (&["serve", "--kv-budget", "lots"], "not a size"),
        (&["serve", "--queue", "0"], "at least 1"),
        (
            &["serve", "--manager", "vllm"],
            "no manager \"vllm\"; the managers are llms,",
        ),
        (
            &["serve", "--manager", "vllm-s", "--kv-format", "int8"],
            "keeps its chunks in f16",
        ),
        (&["serve", "--threads", "0"], "--threads"),
        (
            &["serve", "--chunk-tokens", "0"],
            "--chunk-tokens must be between 1 and 256, not 0",
        ),
        (
            &["serve", "--chunk-tokens", "300"],
            "--chunk-tokens must be between 1 and 256, not 300",
        ),
        (
            &["kvfs", "mount", "--store", "s", "--threads", "0", "m"],
            "at least 1",
        ),
        (&["ctx", "show", "99999999999999999999999"], "invalid value"),
        (
            &["generate", "--chunk-tokens", "0", "--prompt", "x"],
            "not in 1..=256",
        ),
        (
            &["generate", "--chunk-tokens", "100000", "--prompt", "x"],
            "not in 1..=256",
        ),
        (
            &["generate", "--prefill-chunk", "0", "--prompt", "x"],
            "at least 1",
        ),
        (&["eval", "ppl", "--ctx", "0", "--text", "x"], "at least"),
        (
            &["eval", "ppl", "--kl-prefill", "int4", "--text", "x"],
            "--kl-prefill",
        ),
        (
            &["trace", "gen", "t.jsonl", "--rate", "0"],
            "positive number of calls",
        ),
        (
            &["trace", "gen", "t.jsonl", "--rate=-2"],
            "positive number of calls",
        ),
        (
            &["trace", "gen", "t.jsonl", "--rate", "1/0"],
            "positive number of calls",
        ),
        (&["trace", "gen", "t.jsonl", "--rate", "fast"], "'fast'"),
        (
            &["trace", "gen", "t.jsonl", "--pattern", "zipf"],
            "invalid value 'zipf'",
        ),
        (&["trace", "gen", "t.jsonl", "--stay", "1.5"], "probability"),
        (
            &[
                "trace",
                "gen",
                "t.jsonl",
                "--stay",
                "0.7",
                "--neighbour",
                "0.5",
            ],
            "at most 1",
        ),
        (
            &[
                "trace",
                "gen",
                "t.jsonl",
                "--pattern",
                "random",
                "--stay",
                "0.5",
            ],
            "--stay is a parameter of --pattern markov",
        ),
        (
            &[
                "trace",
                "gen",
                "t.jsonl",
                "--pattern",
                "markov",
                "--sigma",
                "0.5",
            ],
            "--sigma is a parameter of --pattern gaussian",
        ),
        (
            &[
                "trace",
                "gen",
                "t.jsonl",
                "--pattern",
                "gaussian",
                "--sigma",
                "0",
            ],
            "positive number",
        ),
        (
            &["trace", "gen", "t.jsonl", "--sources", "imdb"],
            "unknown source 'imdb'",
        ),
        (&["trace", "gen", "t.jsonl", "--calls", "0"], "--calls"),
        (
            &["trace", "gen", "t.jsonl", "--contexts", "0"],
            "--contexts",
        ),
        (
            &["trace", "gen", "t.jsonl", "--max-tokens", "0"],
            "--max-tokens",
        ),
        (
            &["trace", "gen", "t.jsonl", "--max-context", "1024"],
            "cannot hold one call of xsum",
        ),
        (
            &["trace", "gen", "t.jsonl", "--text", "no-such-text"],
            "cannot read the text file no-such-text",
        ),
        (&["trace", "gen"], "<FILE>"),
        (
            &["trace", "show", "no-such-trace.jsonl"],
            "cannot read no-such-trace.jsonl",
        ),
    ];
    let failures: Vec<String> = cases
        .iter()
        .filter_map(|(args, says)| {
            std::panic::catch_unwind(|| refused(d, args, says))
                .err()
                .map(|_| format!("{args:?}"))
        })
        .collect();
    assert!(failures.is_empty(), "not refused cleanly: {failures:?}");
}

#[test]
fn a_malformed_trace_is_refused_with_its_line() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("empty.jsonl"), "").unwrap();
    refused(
        d,
        &["trace", "show", "empty.jsonl"],
        "empty.jsonl is empty, not a trace",
    );
    std::fs::write(d.join("other.jsonl"), "{\"a\":1}\n").unwrap();
    refused(
        d,
        &["trace", "show", "other.jsonl"],
        "other.jsonl:1: not an llms trace",
    );
    let header = r#"{"format":"llms-trace","version":1,"seed":0,"calls":1,"rate":1.0,"pattern":{"kind":"random"},"max_context":2048,"past_cap":"slide","max_tokens":32,"prompt_format":"raw","model":"m.gguf","vocab_size":10,"text":[],"text_sha256":"","contexts":[{"context":0,"app":"news","source":"ag_news"}]}"#;
    std::fs::write(d.join("bad.jsonl"), format!("{header}\n{{\"time\":1}}\n")).unwrap();
    refused(
        d,
        &["trace", "show", "bad.jsonl"],
        "bad.jsonl:2: not a trace row",
    );
}

#[test]
fn a_store_that_does_not_exist_is_never_created() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let typo = d.join("stroe");
    let typo_s = typo.to_str().unwrap();
    let mnt = d.join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let mnt_s = mnt.to_str().unwrap();
    let socket = d.join("llms.sock");
    let socket_s = socket.to_str().unwrap();
    let err = refused(
        d,
        &[
            "serve",
            "--socket",
            socket_s,
            "--store",
            typo_s,
            "--no-mount",
        ],
        "is not a kvfs store",
    );
    assert!(err.contains("--create"), "{err}");
    refused(
        d,
        &["kvfs", "inspect", "--store", typo_s],
        "is not a kvfs store",
    );
    refused(
        d,
        &["kvfs", "mount", "--store", typo_s, mnt_s],
        "is not a kvfs store",
    );
    refused(
        d,
        &["kvfs", "mount", "--rw", "--store", typo_s, mnt_s],
        "is not a kvfs store",
    );
    assert!(!typo.exists(), "a mistyped store was created");
    assert!(!socket.exists(), "serve listened on a mistyped store");
}
