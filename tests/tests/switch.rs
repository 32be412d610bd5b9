//! `llms bench switch` end to end on the tiny model: a short trace made by `llms trace gen`,
//! replayed against real daemons (cgroups, kvfs mount, userfaultfd) under a KV budget smaller
//! than the contexts, and a report whose counters agree with each other.

use std::process::Command;

use serde_json::Value;

fn llms(w: &tests::World) -> Command {
    let mut c = w.llms();
    c.env_remove("LLMS_CONFIG").env_remove("LLMS_MODEL");
    c
}

fn ok(out: std::process::Output, what: &str) -> String {
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{what} failed: {err}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn n(v: &Value, k: &str) -> u64 {
    v[k].as_u64().unwrap_or_else(|| panic!("{k} in {v}"))
}

fn f(v: &Value, k: &str) -> f64 {
    v[k].as_f64().unwrap_or_else(|| panic!("{k} in {v}"))
}

/// A short generated trace replayed by `llms bench switch` under every manager and two budgets:
/// every call answered, each run's totals equal to the sums over its calls.
///
/// Kept whole: one replay, then the checks of its counters against each other.
#[test]
fn a_short_replay_answers_every_call_and_its_counters_agree() {
    let w = tests::World::new(env!("CARGO_BIN_EXE_llms-e2e"));
    let d = w.dir.path();
    let trace = d.join("t.jsonl");
    ok(
        llms(&w)
            // A trace is a pure function of its flags and the tokenizer: this one calls back
            // contexts whose chunks were reclaimed.
            .args([
                "trace",
                "gen",
                "--contexts",
                "3",
                "--calls",
                "12",
                "--seed",
                "1",
            ])
            .args(["--pattern", "random", "--sources", "samsum,wmt,ag_news"])
            .args([
                "--max-context",
                "1024",
                "--past-cap",
                "restart",
                "--max-tokens",
                "8",
            ])
            .arg("--model")
            .arg(&w.model)
            .arg(&trace)
            .output()
            .unwrap(),
        "trace gen",
    );
    let out = d.join("out");
    // One context's worth at the cap (a call needs its whole context resident): less than three
    // contexts of a few hundred tokens each.
    let stdout = ok(
        llms(&w)
            .args(["bench", "switch", "--budget-contexts", "1"])
            .args(["--contexts", "2,3", "--threads", "1", "--json"])
            .arg("--model")
            .arg(&w.model)
            .arg("--out")
            .arg(&out)
            .arg(&trace)
            .output()
            .unwrap(),
        "bench switch",
    );
    let r: Value = serde_json::from_str(&stdout).unwrap();
    let file: Value =
        serde_json::from_slice(&std::fs::read(out.join("switch.json")).unwrap()).unwrap();
    assert_eq!(r, file, "--json prints what switch.json holds");
    let runs = r["runs"].as_array().unwrap();
    // Every manager, by default, for each --contexts value.
    assert_eq!(runs.len(), 2 * 8);
    let managers: std::collections::BTreeSet<&str> = runs
        .iter()
        .map(|r| r["manager"].as_str().unwrap())
        .collect();
    assert_eq!(managers.len(), 8);
    let context_bytes = n(&r, "context_bytes");
    for run in runs {
        let calls = run["call_log"].as_array().unwrap();
        assert_eq!(
            run["daemon_manager"], run["manager"],
            "the daemon ran what was asked"
        );
        assert_eq!(n(run, "calls"), calls.len() as u64);
        assert_eq!(
            n(run, "answered"),
            n(run, "calls"),
            "every call answered: {run}"
        );
        assert_eq!(n(run, "errors"), 0);
        assert_eq!(n(&run["budget"], "bytes"), context_bytes);
        let contexts = n(run, "contexts");
        // Every context is created by its first call; the rest switch or stay.
        let started: std::collections::BTreeSet<u64> = calls
            .iter()
            .filter(|c| c["start"] == true)
            .map(|c| n(c, "context"))
            .collect();
        assert!(started.len() as u64 <= contexts && !started.is_empty());
        assert!(calls.iter().all(|c| n(c, "context") < contexts));
        let switches = calls
            .iter()
            .filter(|c| c["switched"] == true && c["start"] == false)
            .count() as u64;
        assert_eq!(n(run, "switches"), switches);
        // The daemon's counters are the sum of its calls'.
        let sum = |k: &str| calls.iter().map(|c| n(c, k)).sum::<u64>();
        assert_eq!(n(run, "chunks_read"), sum("chunks_read"), "{run}");
        assert_eq!(n(run, "chunks_recomputed"), sum("chunks_recomputed"));
        assert_eq!(n(run, "read_bytes"), sum("read_bytes"));
        assert_eq!(n(run, "chunks_read") > 0, n(run, "read_bytes") > 0);
        for c in calls {
            // A call's Load brings back every chunk it misses, each read or recomputed.
            assert_eq!(
                n(c, "chunks_read") + n(c, "chunks_recomputed"),
                n(c, "chunks_missing"),
                "{c}"
            );
            assert!(n(c, "tokens") <= 8);
        }
        let share = f(run, "recompute_share");
        assert!((0.0..=1.0).contains(&share));
        // Latency statistics in order.
        let (avg, p50, p99, max) = (
            f(run, "switch_avg_ms"),
            f(run, "switch_p50_ms"),
            f(run, "switch_p99_ms"),
            f(run, "switch_max_ms"),
        );
        assert!(
            p50 <= p99 && p99 <= max && avg <= max && avg >= 0.0,
            "{run}"
        );
        assert!(f(run, "e2e_p50_ms") <= f(run, "e2e_p99_ms"));
        assert!(
            n(run, "peak_memory_bytes") > 0,
            "the memory cgroup counted nothing"
        );
        assert!(n(run, "peak_rss_bytes") > 0);
    }
    // The runs over all three contexts hold more than the budget: chunks came back.
    for all in runs.iter().filter(|r| n(r, "contexts") == 3) {
        assert!(
            n(all, "chunks_read") + n(all, "chunks_recomputed") > 0 && n(all, "reclaims") > 0,
            "three contexts in one context's budget, and no chunk came back: {all}"
        );
    }
    let active = r["active"].as_array().unwrap();
    assert_eq!(active.len(), 8, "one per manager and budget");
    for a in active {
        let (a10, a25) = (n(a, "under_10ms"), n(a, "under_25ms"));
        assert!([0, 2, 3].contains(&a10) && [0, 2, 3].contains(&a25) && a10 <= a25);
    }
    let csv = std::fs::read_to_string(out.join("switch.csv")).unwrap();
    assert_eq!(
        csv.lines().count(),
        1 + runs.len(),
        "a header and one line per run"
    );
    for png in [
        "switch-cdf.png",
        "switch-vs-budget.png",
        "active-vs-budget.png",
    ] {
        let bytes = std::fs::read(out.join(png)).unwrap();
        assert!(bytes.starts_with(b"\x89PNG"), "{png}");
    }
}

#[test]
fn a_trace_that_slides_past_the_cap_is_refused_with_the_fix() {
    let w = tests::World::new(env!("CARGO_BIN_EXE_llms-e2e"));
    let trace = w.dir.path().join("slide.jsonl");
    ok(
        llms(&w)
            .args(["trace", "gen", "--contexts", "1", "--calls", "6"])
            .args([
                "--sources",
                "wmt",
                "--max-context",
                "600",
                "--max-tokens",
                "8",
            ])
            .arg("--model")
            .arg(&w.model)
            .arg(&trace)
            .output()
            .unwrap(),
        "trace gen",
    );
    let out = llms(&w)
        .args(["bench", "switch", "--managers", "llms"])
        .arg("--model")
        .arg(&w.model)
        .arg("--out")
        .arg(w.dir.path().join("out"))
        .arg(&trace)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("--past-cap restart"), "{err}");
}
