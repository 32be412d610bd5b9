//! `--json` on the report commands that need no daemon: one JSON document on stdout, nothing else
//! there, read back here (`llms ctx` and `llms stats` are checked against a real daemon in
//! tests/tests/serve.rs, `llms kvfs inspect` in kvfs_cli.rs, the benchmarks in their own tests).

use std::path::Path;
use std::process::Command;

use model::tiny::{TinySpec, write_tiny_gguf};
use serde_json::Value;

const LLMS: &str = env!("CARGO_BIN_EXE_llms");

/// Runs `llms args` in `dir` with the models cache `models`, checks it succeeded, and returns
/// its stdout parsed as one JSON document.
fn json(dir: &Path, models: &Path, args: &[&str]) -> Value {
    let out = Command::new(LLMS)
        .args(args)
        .current_dir(dir)
        .env_remove("LLMS_MODEL")
        .env("LLMS_MODELS_DIR", models)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "llms {args:?}: {err}");
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "llms {args:?}: stdout is not one JSON document ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

#[test]
fn model_ls_json_lists_the_cache() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let models = d.join("models");
    // No cache yet: the known models, none cached.
    let not_cached = |model: &str, file: &str| {
        serde_json::json!({
            "model": model, "name": file, "path": models.join(file),
            "cached": false, "size": null, "sha256_ok": null,
        })
    };
    assert_eq!(
        json(d, &models, &["model", "ls", "--json"]),
        serde_json::json!([
            not_cached("smollm2-135m", "SmolLM2-135M-Instruct.Q4_1.gguf"),
            not_cached("gemma3-270m", "gemma-3-270m-q4_k_m.gguf"),
        ])
    );
    std::fs::create_dir(&models).unwrap();
    // The default model's name with other bytes (its checksum fails), a model the cache does
    // not know (no checksum to check), and a fetch's temporary file (not a model).
    std::fs::write(models.join("SmolLM2-135M-Instruct.Q4_1.gguf"), b"not it").unwrap();
    std::fs::write(models.join("mine.gguf"), b"12345").unwrap();
    std::fs::write(models.join(".fetch-1.gguf"), b"").unwrap();
    let list = json(d, &models, &["model", "ls", "--json"]);
    let expected = serde_json::json!([
        {
            "model": "smollm2-135m",
            "name": "SmolLM2-135M-Instruct.Q4_1.gguf",
            "path": models.join("SmolLM2-135M-Instruct.Q4_1.gguf"),
            "cached": true,
            "size": 6,
            "sha256_ok": false,
        },
        not_cached("gemma3-270m", "gemma-3-270m-q4_k_m.gguf"),
        {
            "model": null,
            "name": "mine.gguf",
            "path": models.join("mine.gguf"),
            "cached": true,
            "size": 5,
            "sha256_ok": null,
        },
    ]);
    assert_eq!(list, expected);
}

#[test]
fn eval_ppl_and_trace_show_print_their_reports_as_json() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let models = d.join("models");
    let model = d.join("tiny.gguf");
    write_tiny_gguf(&model, &TinySpec::default()).unwrap();
    let model_s = model.to_str().unwrap();
    let text = d.join("text.txt");
    std::fs::write(
        &text,
        "The quick brown fox jumps over the lazy dog. ".repeat(20),
    )
    .unwrap();
    let ppl = json(
        d,
        &models,
        &[
            "eval",
            "ppl",
            "--model",
            model_s,
            "--text",
            text.to_str().unwrap(),
            "--ctx",
            "32",
            "--max-windows",
            "2",
            "--json",
            "--out",
            "out",
        ],
    );
    let file: Value =
        serde_json::from_slice(&std::fs::read(d.join("out/ppl.json")).unwrap()).unwrap();
    assert_eq!(ppl, file, "--json prints what ppl.json holds");
    assert_eq!(
        (ppl["ctx"].as_u64(), ppl["windows"].as_u64()),
        (Some(32), Some(2)),
        "{ppl}"
    );
    assert!(ppl["ppl"].as_f64().unwrap() > 1.0, "{ppl}");

    let trace = d.join("t.jsonl");
    let out = Command::new(LLMS)
        .args([
            "trace",
            "gen",
            "--contexts",
            "2",
            "--calls",
            "5",
            "--seed",
            "3",
        ])
        .args(["--sources", "samsum,wmt,ag_news", "--max-tokens", "8"])
        .args(["--max-context", "1024", "--past-cap", "restart"])
        .args(["--model", model_s])
        .arg(&trace)
        .current_dir(d)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let s = json(
        d,
        &models,
        &["trace", "show", "--json", trace.to_str().unwrap()],
    );
    assert_eq!(
        (s["calls"].as_u64(), s["contexts"].as_u64()),
        (Some(5), Some(2)),
        "{s}"
    );
    assert_eq!(s["seed"].as_u64(), Some(3), "{s}");
}

/// `bench engine` and `bench kv` write the kernels they ran on into their JSON, the same list
/// `model::chosen` names for this CPU, and under `LLMS_ISA=portable` the portable ones.
#[test]
fn bench_engine_and_kv_report_the_kernels_they_ran() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let models = d.join("models");
    let model = d.join("tiny.gguf");
    write_tiny_gguf(&model, &TinySpec::default()).unwrap();
    let model_s = model.to_str().unwrap();
    let text = d.join("text.txt");
    std::fs::write(&text, "Some words to prefill with, again. ".repeat(60)).unwrap();
    let text_s = text.to_str().unwrap();
    let engine = [
        "bench",
        "engine",
        "--model",
        model_s,
        "--text",
        text_s,
        "--threads",
        "1",
        "--prefill",
        "16",
        "--decode",
        "1",
        "--decode-at",
        "0",
        "--runs",
        "1",
        "--json",
    ];
    let kv = [
        "bench",
        "kv",
        "--model",
        model_s,
        "--text",
        text_s,
        "--contexts",
        "32",
        "--recompute",
        "1",
        "--reps",
        "1",
        "--json",
    ];
    let expected = |list: Vec<model::chosen::Chosen>| serde_json::to_value(list).unwrap();
    let report = json(d, &models, &engine);
    assert_eq!(
        report["chosen_kernels"],
        expected(model::chosen::engine(
            model::qmatrix::Activations::Auto,
            model::int8gemm::PrefillActs::F32,
        )),
        "{report}"
    );
    let report = json(d, &models, &kv);
    assert_eq!(
        report["chosen_kernels"],
        expected(model::chosen::attention()),
        "{report}"
    );
    for args in [&engine[..], &kv[..]] {
        let out = Command::new(LLMS)
            .args(args)
            .current_dir(d)
            .env("LLMS_ISA", "portable")
            .env("LLMS_MODELS_DIR", &models)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let report: Value = serde_json::from_slice(&out.stdout).unwrap();
        let kernels = report["chosen_kernels"].as_array().unwrap();
        assert!(!kernels.is_empty(), "{report}");
        for k in kernels {
            let (product, kernel) = (k["product"].as_str(), k["kernel"].as_str());
            assert!(product.is_some_and(|p| !p.is_empty()), "{k}");
            assert!(kernel.is_some_and(|k| k.contains("portabl")), "{k}");
        }
    }
}
