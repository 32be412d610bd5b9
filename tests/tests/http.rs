//! The OpenAI-compatible HTTP API (`llms serve --http`, docs/http.md) driven by real clients
//! against a real daemon process with the real default model: the `openai` Python package,
//! pinned and installed by this test into a venv under the target directory, runs
//! `tests/python/openai_suite.py` (chat completions whole and streamed, the reuse of a held
//! conversation, structured output, tools, responses with `previous_response_id` over ten turns,
//! `store`, streamed responses, conversations, token counting, errors, another uid's key), over
//! TCP with keys and over the Unix socket; curl checks the server-sent events' framing byte for
//! byte and a peer of another uid on the Unix socket; then the daemon is killed (`kill -9`) and
//! started again, and the conversation goes on from the store with only its new tokens
//! prefilled. Then 64 clients of the same package stream at once (`tests/python/openai_load.py`):
//! every stream completes, and two apps of unequal size take turns in the queue.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use model::fetch::{self, FetchOptions};

/// The `openai` package the suite runs with.
const OPENAI: &str = "2.8.1";

/// A venv with the pinned `openai` package, made once under the target directory; its python.
/// (The tests of this file run at once: one makes it, the others wait.)
fn python() -> PathBuf {
    static PYTHON: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    PYTHON.get_or_init(make_venv).clone()
}

fn make_venv() -> PathBuf {
    let venv = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("openai-{OPENAI}"));
    let python = venv.join("bin/python");
    let ready = venv.join("installed");
    if ready.exists() {
        return python;
    }
    let run = |cmd: &mut Command, what: &str| {
        let out = cmd
            .output()
            .unwrap_or_else(|e| panic!("cannot run {what}: {e}"));
        assert!(
            out.status.success(),
            "{what} failed ({}); the HTTP tests need python3 with venv and pip, and PyPI:\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    };
    run(
        Command::new("python3").args(["-m", "venv"]).arg(&venv),
        "python3 -m venv",
    );
    run(
        Command::new(&python).args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            &format!("openai=={OPENAI}"),
        ]),
        &format!("pip install openai=={OPENAI}"),
    );
    std::fs::write(&ready, OPENAI).unwrap();
    python
}

/// A TCP port free on the loopback now.
fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// A new key for `uid` in the key file `keys`, by `llms keys add`.
fn add_key(w: &tests::World, keys: &Path, uid: u32) -> String {
    add_app_key(w, keys, uid, "http")
}

/// A new key for `uid` and app `app` in the key file `keys`.
fn add_app_key(w: &tests::World, keys: &Path, uid: u32, app: &str) -> String {
    let out = w
        .llms()
        .args([
            "keys",
            "add",
            "--uid",
            &uid.to_string(),
            "--app",
            app,
            "--file",
        ])
        .arg(keys)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

/// Runs the suite's `phase`; panics with its output if a check failed.
#[allow(clippy::print_stderr)] // the suite's report, for people reading the log
fn suite(python: &Path, env: &[(&str, String)], phase: &str, state: &Path) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/openai_suite.py");
    let out = Command::new(python)
        .arg(script)
        .arg(phase)
        .arg(state)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("openai suite, {phase}:\n{text}");
    assert!(
        out.status.success(),
        "the openai suite failed ({phase}):\n{text}"
    );
    assert!(text.contains(" 0 failed"), "{text}");
}

/// curl's output for one request; `uid` runs it as another user.
fn curl(args: &[&str], uid: Option<u32>) -> String {
    let mut cmd = Command::new("curl");
    cmd.args(["-sS", "-N"]).args(args);
    if let Some(uid) = uid {
        cmd.uid(uid).gid(uid);
    }
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "curl {args:?}: {out:?}");
    String::from_utf8(out.stdout).unwrap()
}

/// Checks server-sent events byte for byte: every event is `data: JSON\n\n` (after an
/// `event: TYPE` line naming its JSON's `type`, for responses), and a chat stream ends with
/// `data: [DONE]\n\n`. Returns the events' JSON.
fn sse(body: &str, chat: bool) -> Vec<serde_json::Value> {
    assert!(body.ends_with("\n\n"), "{body:?}");
    let frames: Vec<&str> = body[..body.len() - 2].split("\n\n").collect();
    let (events, last) = match chat {
        true => (&frames[..frames.len() - 1], frames.last().copied()),
        false => (&frames[..], None),
    };
    if chat {
        assert_eq!(last, Some("data: [DONE]"), "{body:?}");
    }
    events
        .iter()
        .map(|f| {
            let (kind, data) = match f.split_once('\n') {
                Some((e, d)) => (e.strip_prefix("event: "), d),
                None => (None, *f),
            };
            let data = data
                .strip_prefix("data: ")
                .unwrap_or_else(|| panic!("{f:?}"));
            assert!(!data.contains('\n'), "{f:?}");
            let v: serde_json::Value = serde_json::from_str(data).unwrap();
            match chat {
                true => assert_eq!(v["object"], "chat.completion.chunk", "{f:?}"),
                false => assert_eq!(kind, v["type"].as_str(), "{f:?}"),
            }
            v
        })
        .collect()
}

/// Waits until the daemon has written out every chunk it queued (so a `kill -9` loses none of
/// the conversation's K/V: after it, the context comes back by reads, not recompute).
fn settle(w: &tests::World) {
    let mut c = w.connect("probe");
    let t0 = Instant::now();
    while c.stats().unwrap().service.writes_queued > 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "writes never settled"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Kept whole: one scenario, a daemon's life and its restart, step by step.
#[test]
fn real_clients_drive_the_http_api_across_a_crash() {
    let python = python();
    let path = fetch::default_model_path(&FetchOptions::default())
        .unwrap_or_else(|e| panic!("cannot fetch the default model: {e}"));
    let w = tests::World::with_model(env!("CARGO_BIN_EXE_llms-e2e"), &path);
    // Every uid may reach the HTTP socket (contexts are per uid).
    std::fs::set_permissions(w.dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let sock = w.dir.path().join("http.sock");
    let keys = w.dir.path().join("keys");
    let me = nix::unistd::getuid().as_raw();
    let key = add_key(&w, &keys, me);
    let other_key = add_key(&w, &keys, 65534);
    let port = free_port();
    let listen = format!("unix:{},127.0.0.1:{port}", sock.display());
    let args = [
        "--http",
        listen.as_str(),
        "--http-keys",
        keys.to_str().unwrap(),
        "--max-contexts-per-app",
        "32",
    ];
    let d = w.serve(&args);
    assert!(d.ready_line.contains("http 127.0.0.1"), "{}", d.ready_line);
    let model = path.file_name().unwrap().to_str().unwrap().to_owned();
    let env = [
        ("LLMS_TCP", format!("http://127.0.0.1:{port}/v1")),
        ("LLMS_UNIX", sock.display().to_string()),
        ("LLMS_KEY", key.clone()),
        ("LLMS_OTHER_KEY", other_key),
        ("LLMS_MODEL", model.clone()),
    ];
    let state = w.dir.path().join("state.json");
    suite(&python, &env, "first", &state);

    // The framing of both streams, byte for byte, over the Unix socket and TCP.
    let unix = ["--unix-socket", sock.to_str().unwrap()];
    let body = format!(
        r#"{{"model":"{model}","messages":[{{"role":"user","content":"Hi"}}],"max_tokens":8,"stream":true,"stream_options":{{"include_usage":true}}}}"#
    );
    let chunks = sse(
        &curl(
            &[
                &unix[..],
                &["http://localhost/v1/chat/completions", "-d", &body],
            ]
            .concat(),
            None,
        ),
        true,
    );
    assert!(
        chunks.last().unwrap()["usage"]["completion_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );
    let auth = format!("Authorization: Bearer {key}");
    let body = format!(r#"{{"model":"{model}","input":"Hi","max_output_tokens":8,"stream":true}}"#);
    let url = format!("http://127.0.0.1:{port}/v1/responses");
    let events = sse(&curl(&["-H", &auth, &url, "-d", &body], None), false);
    assert_eq!(events[0]["type"], "response.created");

    // A peer of another uid on the Unix socket sees none of this uid's responses.
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&state).unwrap()).unwrap();
    let last = s["last"].as_str().unwrap();
    let get = format!("http://localhost/v1/responses/{last}");
    let theirs = curl(
        &[&unix[..], &["-w", "%{http_code}", &get]].concat(),
        Some(65534),
    );
    assert!(theirs.ends_with("404"), "{theirs}");
    let mine = curl(&[&unix[..], &["-w", "%{http_code}", &get]].concat(), None);
    assert!(mine.ends_with("200"), "{mine}");

    // kill -9 between two turns, a restart on the same store: the conversation goes on.
    settle(&w);
    d.kill9();
    let _d = w.serve(&args);
    suite(&python, &env, "after", &state);
}

/// The daemon's peak resident memory (VmHWM), in MiB.
fn peak_rss_mib(pid: i32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kib / 1024.0
}

/// 64 clients stream chat completions at once over TCP, each two turns of its own conversation,
/// 48 of them with app a's key and 16 with app b's: every stream completes, and the queue takes
/// the two apps in turn, so b (a quarter of the streams) is done about halfway, not at the end
/// as a first-come queue would leave it. App a may hold only 40 contexts, so 8 of its
/// conversations wait for one to come back rather than fail.
#[test]
#[allow(clippy::print_stderr)] // the figures, for people reading the log
fn sixty_four_streams_over_tcp_complete_and_the_apps_take_turns() {
    let python = python();
    let path = fetch::default_model_path(&FetchOptions::default())
        .unwrap_or_else(|e| panic!("cannot fetch the default model: {e}"));
    let w = tests::World::with_model(env!("CARGO_BIN_EXE_llms-e2e"), &path);
    let keys = w.dir.path().join("keys");
    let me = nix::unistd::getuid().as_raw();
    let (a, b) = (
        add_app_key(&w, &keys, me, "a"),
        add_app_key(&w, &keys, me, "b"),
    );
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let d = w.serve(&[
        "--http",
        &listen,
        "--http-keys",
        keys.to_str().unwrap(),
        "--max-contexts-per-app",
        "40",
    ]);
    let model = path.file_name().unwrap().to_str().unwrap().to_owned();
    let run = |phase: &str| -> serde_json::Value {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/openai_load.py");
        let out = Command::new(&python)
            .arg(script)
            .arg(phase)
            .env("LLMS_TCP", format!("http://127.0.0.1:{port}/v1"))
            .env("LLMS_MODEL", &model)
            .env(
                "LLMS_LOAD_KEYS",
                serde_json::json!({"a": [a, 48], "b": [b, 16]}).to_string(),
            )
            .env("LLMS_LOAD_TURNS", "2")
            .env("LLMS_LOAD_TOKENS", "4")
            .output()
            .unwrap();
        assert!(out.status.success(), "openai_load.py {phase}: {out:?}");
        serde_json::from_slice(&out.stdout).unwrap()
    };
    run("warm");
    let r = run("load");
    let streams = r["streams"].as_array().unwrap();
    let failed: Vec<_> = streams.iter().filter(|s| s["ok"] != true).collect();
    assert!(
        failed.is_empty(),
        "streams that did not complete: {failed:?}"
    );
    assert_eq!(streams.len(), 64 * 2);
    let order: Vec<&str> = r["order"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    let b_done = order.iter().rposition(|a| *a == "b").unwrap() + 1;
    let share = b_done as f64 / order.len() as f64;
    eprintln!(
        "64 clients, 128 streams in {:.1} s; app b's last stream ended {b_done}th of {} ({share:.2}); \
         the daemon's peak RSS {:.0} MiB",
        r["seconds"].as_f64().unwrap(),
        order.len(),
        peak_rss_mib(d.pid())
    );
    // Taken in turn, b's 32 streams end by about the 64th; first come, first served, near the
    // 128th.
    assert!(
        share < 0.65,
        "app b's last stream ended {b_done}th of {}: the apps did not take turns ({order:?})",
        order.len()
    );
}
