//! `llms serve` as apps use it: a real daemon process on a real socket, with the tiny model.
//! Several clients at once, restarts and crashes, bad input of every kind, and another uid.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;

use protocol::client::CallEvent;
use protocol::{Reply, ReplyBody};
use rand::{Rng, SeedableRng};
use tests::{ask, local_answers, raw, seed};

fn world() -> tests::World {
    tests::World::new(env!("CARGO_BIN_EXE_llms-e2e"))
}

const PROMPTS: [&str; 3] = [
    "The quick brown fox jumps over the lazy dog. ",
    "A second message, somewhat longer than the first one, to fill a chunk or two. ",
    "And a third. ",
];

#[test]
fn several_clients_at_once_answer_as_a_local_manager() {
    let w = world();
    let _d = w.serve(&[]);
    let local = local_answers(&w, &PROMPTS, 12);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|i| {
                let w = &w;
                s.spawn(move || {
                    let mut c = w.connect(&format!("app{i}"));
                    let ctx = c.new_context(None, Default::default()).unwrap();
                    PROMPTS
                        .iter()
                        .map(|p| ask(&mut c, ctx, p, 12).tokens)
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), local);
        }
    });
    let mut c = w.connect("check");
    let list = c.list().unwrap();
    assert_eq!(list.len(), 4);
    let s = c.stats().unwrap().service;
    assert_eq!((s.contexts, s.calls), (4, 12));
    assert_eq!(s.switch.count, 12);
}

#[test]
fn a_call_streams_tokens_then_done_with_timings() {
    let w = world();
    let _d = w.serve(&[]);
    let mut c = w.connect("stream");
    let ctx = c
        .new_context(Some("You are terse. "), protocol::PromptFormat::Raw)
        .unwrap();
    let events: Vec<CallEvent> = c
        .call(ctx, PROMPTS[0], &raw(5))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let Some(CallEvent::Done(d)) = events.last() else {
        panic!("no done: {events:?}")
    };
    assert_eq!(events.len(), d.tokens + 1, "{events:?}");
    assert!(
        (d.stop == "max_tokens" && d.tokens == 5) || (d.stop == "stop" && d.tokens < 5),
        "{d:?}"
    );
    assert!(d.timings.switch_ms >= d.timings.queue_ms);
    assert!(d.timings.total_ms >= d.timings.switch_ms);
    let info = c.info(ctx).unwrap();
    assert_eq!(info.tokens, d.context_tokens);
    assert_eq!(info.calls, 1);
}

#[test]
fn a_clean_restart_keeps_contexts_and_the_conversation_goes_on() {
    let w = world();
    let local = local_answers(&w, &PROMPTS, 10);
    let d = w.serve(&[]);
    let mut c = w.connect("restart");
    let ctx = c.new_context(None, Default::default()).unwrap();
    let mut got = vec![ask(&mut c, ctx, PROMPTS[0], 10).tokens];
    got.push(ask(&mut c, ctx, PROMPTS[1], 10).tokens);
    let before = c.info(ctx).unwrap();
    drop(c);
    assert!(d.term().success(), "SIGTERM drains and exits 0");
    assert!(!tests::exists(&w.socket()), "the socket is removed");

    let _d = w.serve(&[]);
    let mut c = w.connect("restart");
    let after = c.info(ctx).unwrap();
    assert_eq!(after.tokens, before.tokens);
    got.push(ask(&mut c, ctx, PROMPTS[2], 10).tokens);
    assert_eq!(got, local);
}

#[test]
fn kill_9_mid_call_leaves_the_last_completed_call() {
    let seed = seed("kill_9_mid_call");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let w = world();
    let local = local_answers(&w, &[PROMPTS[0], PROMPTS[2]], 10);
    let d = w.serve(&[]);
    let mut c = w.connect("crash");
    let ctx = c.new_context(None, Default::default()).unwrap();
    assert_eq!(ask(&mut c, ctx, PROMPTS[0], 10).tokens, local[0]);
    let done = c.info(ctx).unwrap();
    // The second call dies with the daemon after a random number of its tokens.
    let after = rng.random_range(1..=40usize);
    let mut stream = c.call(ctx, PROMPTS[1], &raw(60)).unwrap();
    for _ in 0..after {
        match stream.next() {
            Some(Ok(CallEvent::Token { .. })) => {}
            other => panic!("expected a token, got {other:?}"),
        }
    }
    d.kill9();
    drop(c);

    let _d = w.serve(&[]);
    let mut c = w.connect("crash");
    assert_eq!(c.info(ctx).unwrap().tokens, done.tokens);
    assert_eq!(ask(&mut c, ctx, PROMPTS[2], 10).tokens, local[1]);
}

#[test]
fn a_stale_socket_is_cleaned_and_a_second_daemon_refused() {
    let w = world();
    let d = w.serve(&[]);
    let out = w
        .llms()
        .arg("serve")
        .arg("--socket")
        .arg(w.dir.path().join("other.sock"))
        .arg("--store")
        .arg(w.store())
        .arg("--model")
        .arg(&w.model)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("another llms serve"), "{err}");
    d.kill9();
    assert!(
        tests::exists(&w.socket()),
        "a killed daemon leaves its socket"
    );
    let _d = w.serve(&[]);
    w.connect("after").list().unwrap();
}

#[test]
fn contexts_hold_the_models_length_and_no_more() {
    let w = world();
    let out = w
        .llms()
        .arg("serve")
        .arg("--socket")
        .arg(w.socket())
        .arg("--store")
        .arg(w.store())
        .arg("--create")
        .arg("--model")
        .arg(&w.model)
        .args(["--max-context", &(2 * tests::MAX_CONTEXT).to_string()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--max-context 2048 is above the model's context length of 1024 tokens"),
        "{err}"
    );
    let d = w.serve(&[]);
    assert_eq!(
        w.connect("a").hello().max_context_tokens,
        tests::MAX_CONTEXT
    );
    drop(d);
    let _d = w.serve(&["--max-context", "100"]);
    assert_eq!(w.connect("b").hello().max_context_tokens, 100);
}

/// Sends raw lines and reads one reply per line.
struct Raw {
    r: BufReader<UnixStream>,
    w: UnixStream,
}

impl Raw {
    fn new(w: &tests::World) -> Raw {
        let s = UnixStream::connect(w.socket()).unwrap();
        Raw {
            w: s.try_clone().unwrap(),
            r: BufReader::new(s),
        }
    }

    fn send(&mut self, bytes: &[u8]) -> Reply {
        self.w.write_all(bytes).unwrap();
        self.w.write_all(b"\n").unwrap();
        let mut line = String::new();
        self.r.read_line(&mut line).unwrap();
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"))
    }

    /// The error code the daemon answers `bytes` with, and the id it gives.
    fn error(&mut self, bytes: &[u8]) -> (Option<u64>, String) {
        match self.send(bytes) {
            Reply {
                id,
                body: ReplyBody::Error { error },
            } => (id, error.code),
            r => panic!(
                "{}: expected an error, got {r:?}",
                String::from_utf8_lossy(bytes)
            ),
        }
    }
}

/// Every kind of bad request gets its error code, and the daemon's state is as before.
///
/// Kept whole: a table of bad requests against one daemon, then one check that nothing changed.
#[test]
fn bad_input_gets_an_error_and_changes_nothing() {
    let w = world();
    let _d = w.serve(&["--max-line", "4096"]);
    let mut good = w.connect("good");
    let ctx = good.new_context(None, Default::default()).unwrap();
    let first = ask(&mut good, ctx, PROMPTS[0], 6);

    let mut r = Raw::new(&w);
    let e = |id: Option<u64>, code: &str| (id, code.to_owned());
    assert_eq!(r.error(br#"{"op":"list","id":1}"#), e(Some(1), "no_hello"));
    assert_eq!(
        r.send(br#"{"op":"hello","id":2,"version":1,"app":"bad"}"#)
            .id,
        Some(2)
    );
    let huge = vec![b'x'; 10_000];
    type Case = (Vec<u8>, (Option<u64>, String));
    let cases: Vec<Case> = vec![
        (b"{not json".to_vec(), e(None, "bad_request")),
        (
            br#"{"op":"frob","id":3}"#.to_vec(),
            e(Some(3), "bad_request"),
        ),
        (
            br#"{"op":"info","id":4,"context":"one"}"#.to_vec(),
            e(Some(4), "bad_request"),
        ),
        (
            br#"{"op":"list","id":5,"x":1}"#.to_vec(),
            e(Some(5), "bad_request"),
        ),
        (huge, e(None, "too_long")),
        (
            b"{\"op\":\"list\",\"id\":6,\xff}".to_vec(),
            e(None, "bad_request"),
        ),
        (
            format!(r#"{{"op":"call","id":7,"context":{ctx},"prompt":"x","top_p":2}}"#)
                .into_bytes(),
            e(Some(7), "bad_request"),
        ),
        (
            format!(r#"{{"op":"call","id":8,"context":{ctx},"prompt":"x","temperature":-1}}"#)
                .into_bytes(),
            e(Some(8), "bad_request"),
        ),
        (
            br#"{"op":"info","id":9,"context":999}"#.to_vec(),
            e(Some(9), "not_found"),
        ),
        (
            br#"{"op":"hello","id":10,"version":1,"app":"again"}"#.to_vec(),
            e(Some(10), "no_hello"),
        ),
        (
            br#"{"op":"cancel","id":11,"call":77}"#.to_vec(),
            e(Some(11), "not_found"),
        ),
    ];
    for (line, want) in cases {
        assert_eq!(r.error(&line), want, "{}", String::from_utf8_lossy(&line));
    }
    // A deleted context is gone for calls too.
    let gone = good.new_context(None, Default::default()).unwrap();
    good.delete(gone).unwrap();
    let err = good
        .call(gone, "x", &raw(2))
        .unwrap()
        .collect_answer()
        .unwrap_err();
    assert_eq!(err.code(), Some("not_found"));

    // 64 clients that connect and drop, some in the middle of a call.
    for i in 0..64 {
        let mut s = UnixStream::connect(w.socket()).unwrap();
        if i % 2 == 0 {
            let app = format!(r#"{{"op":"hello","id":1,"version":1,"app":"drop{i}"}}"#);
            let call = format!(
                r#"{{"op":"call","id":2,"context":{ctx},"prompt":"x","format":"raw","max_tokens":50}}"#
            );
            s.write_all(format!("{app}\n{call}\n").as_bytes()).unwrap();
            let mut one = [0u8; 1];
            let _ = s.read(&mut one);
        }
    }
    // Random bytes, bounded.
    let seed = seed("bad_input random bytes");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut junk = Raw::new(&w);
    for _ in 0..50 {
        let n = rng.random_range(0..200);
        let mut bytes: Vec<u8> = (0..n).map(|_| rng.random()).collect();
        bytes.retain(|&b| b != b'\n');
        if bytes.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let _ = junk.error(&bytes);
    }

    // The first client's context is as it was, and it goes on (the dropped calls on it were
    // other apps' of the same uid: they ran or were cancelled, each a completed call).
    let again = good.info(ctx).unwrap();
    assert!(again.tokens >= first.done.context_tokens);
    ask(&mut good, ctx, PROMPTS[1], 4);
    let s = good.stats().unwrap();
    assert!(s.daemon.errors >= 12, "{s:?}");
}

#[test]
fn a_full_queue_answers_busy() {
    let w = world();
    let _d = w.serve(&["--queue", "1"]);
    let mut c = w.connect("busy");
    let ctx = c.new_context(None, Default::default()).unwrap();
    let mut r = Raw::new(&w);
    r.send(br#"{"op":"hello","id":1,"version":1,"app":"busy"}"#);
    // Three long calls at once: one runs, one waits, one at least finds the queue full.
    let call = |id: u32| {
        format!(
            r#"{{"op":"call","id":{id},"context":{ctx},"prompt":"x","format":"raw","max_tokens":400}}"#
        )
    };
    r.w.write_all(format!("{}\n{}\n{}\n", call(2), call(3), call(4)).as_bytes())
        .unwrap();
    // Each of the three ends once: done (ran, perhaps cancelled), busy, or cancelled (queued).
    let mut ended = std::collections::BTreeMap::new();
    let mut cancelled = false;
    while ended.len() < 3 {
        let mut line = String::new();
        r.r.read_line(&mut line).unwrap();
        let reply: Reply = serde_json::from_str(&line).unwrap();
        let id = reply.id.unwrap();
        match reply.body {
            _ if id >= 9 => {}
            ReplyBody::Error { error } => {
                ended.insert(id, error.code);
            }
            ReplyBody::Event(protocol::Event::Done(d)) => {
                ended.insert(id, d.stop);
            }
            ReplyBody::Event(_) => {}
        }
        if !cancelled && ended.values().any(|c| c == "busy") {
            // Stop the running and the waiting call so the test does not wait for them.
            r.w.write_all(b"{\"op\":\"cancel\",\"id\":9,\"call\":2}\n")
                .unwrap();
            r.w.write_all(b"{\"op\":\"cancel\",\"id\":10,\"call\":3}\n")
                .unwrap();
            r.w.write_all(b"{\"op\":\"cancel\",\"id\":11,\"call\":4}\n")
                .unwrap();
            cancelled = true;
        }
    }
    // While one call runs and one waits, the third is refused: which one depends on when the
    // engine takes the first, so count them.
    assert!(ended.values().any(|c| c == "busy"), "{ended:?}");
    assert!(
        ended
            .values()
            .all(|c| ["busy", "cancelled", "max_tokens", "stop"].contains(&c.as_str())),
        "{ended:?}"
    );
}

#[test]
fn another_uid_finds_nothing() {
    let w = world();
    let _d = w.serve(&[]);
    let mut c = w.connect("mine");
    let ctx = c.new_context(None, Default::default()).unwrap();
    ask(&mut c, ctx, PROMPTS[0], 4);
    let as_nobody = |args: &[&str]| {
        let out = {
            use std::os::unix::process::CommandExt;
            w.llms()
                .args(args)
                .arg("--socket")
                .arg(w.socket())
                .uid(65534)
                .gid(65534)
                .output()
                .unwrap()
        };
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let id = ctx.to_string();
    let (ok, out, err) = as_nobody(&["ctx", "ls", "--json"]);
    assert!(ok, "{err}");
    assert_eq!(out.trim(), "[]");
    for cmd in [&["ctx", "show", &id][..], &["ctx", "rm", &id][..]] {
        let (ok, _, err) = as_nobody(cmd);
        assert!(!ok);
        assert!(err.contains("not_found"), "{cmd:?}: {err}");
    }
    let (ok, _, err) = as_nobody(&["chat", "--context", &id, "--prompt", "hi"]);
    assert!(!ok);
    assert!(err.contains("not_found"), "{err}");
    // Nor through the daemon's kvfs mount: not listed, no file of it readable.
    let mnt = w.mountpoint();
    let nobody = |prog: &str, path: &std::path::Path| {
        use std::os::unix::process::CommandExt;
        std::process::Command::new(prog)
            .arg(path)
            .uid(65534)
            .gid(65534)
            .output()
            .unwrap()
    };
    let ls = nobody("ls", &mnt);
    assert!(ls.status.success(), "{ls:?}");
    assert!(!String::from_utf8_lossy(&ls.stdout).lines().any(|l| l == id));
    for f in ["info", "text", "tokens", "kv", "chunks/0"] {
        let out = nobody("cat", &mnt.join(&id).join(f));
        assert!(
            !out.status.success() && out.stdout.is_empty(),
            "{f}: {out:?}"
        );
    }
    // Its owner sees it there.
    assert!(
        std::fs::read_dir(&mnt)
            .unwrap()
            .any(|e| e.unwrap().file_name() == id.as_str())
    );
    assert!(std::fs::read_to_string(mnt.join(&id).join("info")).is_ok());
    // Still there for its owner.
    assert_eq!(c.info(ctx).unwrap().calls, 1);
}

/// A person inspecting the daemon's mount, as the issue tried it: a chat context's `text` is its
/// tokens as the model's tokenizer renders them (turns, roles and control tokens visible),
/// `tokens` the ids; `info` and the chunks' attributes show each chunk's bytes, when it was
/// written and whether it is in the daemon's memory (after a restart, none is). Another uid reads
/// none of it.
///
/// Kept whole: one scenario against one daemon, restart included, read top to bottom.
#[test]
fn the_daemons_mount_shows_contexts_as_the_models_text() {
    let w = tests::World::chat(env!("CARGO_BIN_EXE_llms-e2e"));
    let tok = w.tokenizer();
    let mnt = w.mountpoint();
    let d = w.serve(&[]);
    let mut c = w.connect("inspect");
    let ctx = c.new_context(None, Default::default()).unwrap();
    let now = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs()
    };
    let before = kvfs::utc(now());
    let prompt = "Remember: my secret is 4711.";
    let params = protocol::client::CallParams {
        max_tokens: 24,
        ..Default::default()
    };
    c.call(ctx, prompt, &params)
        .unwrap()
        .collect_answer()
        .unwrap();
    let tokens_now = c.info(ctx).unwrap().tokens;
    let dir = mnt.join(ctx.to_string());
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap();
    // The stored rows of info's chunk table, once the AoT writer has written every sealed chunk.
    let stored_rows = |info: &str| -> Vec<Vec<String>> {
        info.lines()
            .map(|l| l.split_whitespace().map(str::to_owned).collect::<Vec<_>>())
            .filter(|cols| cols.get(2).map(String::as_str) == Some("stored"))
            .collect()
    };
    let sealed = tokens_now / 16;
    assert!(sealed > 0, "{tokens_now} tokens seal no chunk");
    let t = std::time::Instant::now();
    while stored_rows(&read("info")).len() < sealed {
        assert!(
            t.elapsed().as_secs() < 60,
            "chunks not written:\n{}",
            read("info")
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let after = kvfs::utc(now());

    let ids: Vec<u32> = read("tokens")
        .split_whitespace()
        .map(|t| t.parse().unwrap())
        .collect();
    assert_eq!(ids.len(), tokens_now);
    let text = read("text");
    assert_eq!(text, tok.decode(&ids));
    let turn = format!("<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n");
    assert!(text.starts_with(&turn), "{text}");
    let info = read("info");
    assert!(info.contains("decoded by this model's tokenizer"), "{info}");
    let rows = stored_rows(&info);
    for row in &rows {
        // index, span, state, format, density, codec, raw, stored, resident, written
        assert_eq!(row.len(), 10, "{info}");
        assert!(
            before <= row[9] && row[9] <= after,
            "{before} <= {} <= {after}",
            row[9]
        );
    }
    let resident: Vec<&str> = rows.iter().map(|r| r[8].as_str()).collect();
    assert!(resident.contains(&"yes"), "{info}");
    assert!(resident.iter().all(|r| ["yes", "no"].contains(r)), "{info}");
    let xattr = |who: Option<u32>, name: &str| {
        let mut cmd = std::process::Command::new("python3");
        cmd.args([
            "-c",
            "import os,sys; print(os.getxattr(sys.argv[1], sys.argv[2]).decode())",
        ])
        .arg(dir.join("chunks/0"))
        .arg(name);
        if let Some(uid) = who {
            use std::os::unix::process::CommandExt;
            cmd.uid(uid).gid(uid);
        }
        let out = cmd.output().unwrap();
        out.status
            .success()
            .then(|| String::from_utf8(out.stdout).unwrap().trim().to_owned())
    };
    assert_eq!(
        xattr(None, "user.kvfs.stored_bytes").as_deref(),
        Some(rows[0][7].as_str())
    );
    assert_eq!(
        xattr(None, "user.kvfs.resident").as_deref(),
        Some(rows[0][8].as_str())
    );
    assert_eq!(
        xattr(None, "user.kvfs.written").as_deref(),
        Some(rows[0][9].as_str())
    );
    // Another uid reads none of it.
    for f in ["text", "tokens", "info"] {
        let out = {
            use std::os::unix::process::CommandExt;
            std::process::Command::new("cat")
                .arg(dir.join(f))
                .uid(65534)
                .gid(65534)
                .output()
                .unwrap()
        };
        assert!(
            !out.status.success() && out.stdout.is_empty(),
            "{f}: {out:?}"
        );
    }
    assert_eq!(xattr(Some(65534), "user.kvfs.stored_bytes"), None);
    drop(c);
    assert!(d.term().success());

    // After a drained restart the context is back, decoded the same, and no chunk is resident
    // until a call loads it.
    let _d = w.serve(&[]);
    assert_eq!(read("text"), text);
    let info = read("info");
    let rows = stored_rows(&info);
    assert_eq!(rows.len(), sealed, "{info}");
    assert!(rows.iter().all(|r| r[8] == "no"), "{info}");
}

#[test]
fn contexts_go_out_and_come_back_through_the_daemons_kvfs_mount() {
    let w = world();
    let local = local_answers(&w, &PROMPTS, 12);
    let mnt = w.mountpoint();
    let mut ctxs = Vec::new();
    let mut answers = vec![Vec::new(); 3];
    // A drained restart between prompts: each context then comes back from kvfs.
    for (round, prompt) in PROMPTS.iter().enumerate() {
        let d = w.serve(&[]);
        assert!(tests::is_mount_point(&mnt), "round {round}: not mounted");
        let mut c = w.connect("mounted");
        if ctxs.is_empty() {
            ctxs = (0..3)
                .map(|_| c.new_context(None, Default::default()).unwrap())
                .collect();
        }
        for (i, &ctx) in ctxs.iter().enumerate() {
            answers[i].push(ask(&mut c, ctx, prompt, 12).tokens);
        }
        let stats = c.stats().unwrap().service;
        let read = stats.chunks_read;
        let m = tests::mount_counts(&mnt);
        if round > 0 {
            // Every chunk came back through the mount's data files, passed through to the
            // store's data files by the kernel, with the reads in flight on an io_uring: none
            // was read by the store's own paths.
            assert!(read > 0, "round {round}: nothing read back");
            assert!(stats.load_io_uring, "round {round}: {stats:?}");
            assert!(m.passthrough_opens > 0, "round {round}: {m:?}");
            assert_eq!(
                (m.store_reads, m.daemon_reads),
                (0, 0),
                "round {round}: reads not through the mount"
            );
        }
        // The AoT writes of this round go through the mount too.
        let t = std::time::Instant::now();
        while tests::mount_counts(&mnt).kv_writes == 0 {
            assert!(t.elapsed().as_secs() < 60, "no write through the mount");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        // What people see there is what the daemon stored.
        let chunks = std::fs::read_dir(mnt.join(format!("{}/chunks", ctxs[0])))
            .unwrap()
            .count();
        assert!(chunks > 0, "round {round}: no chunk files");
        drop(c);
        assert!(d.term().success());
        assert!(!tests::is_mount_point(&mnt), "round {round}: still mounted");
    }
    for a in answers {
        assert_eq!(a, local);
    }
}

/// `--chunk-tokens` sets the size of the chunks a daemon stores its contexts in; a restart with
/// the model's size takes such a context back, keeps its tokens and stores it in that size.
#[test]
fn chunk_tokens_sets_the_size_a_context_is_stored_in() {
    let w = world();
    let meta = |ctx: u64| {
        let store = kvfs::Store::open(&w.store(), kvfs::StoreOptions::default()).unwrap();
        (
            store.meta(kvfs::ContextId(ctx)).unwrap().chunk_tokens,
            store.tokens(kvfs::ContextId(ctx)).unwrap().len(),
        )
    };
    let d = w.serve(&["--chunk-tokens", "8"]);
    let mut c = w.connect("sized");
    let ctx = c.new_context(None, Default::default()).unwrap();
    assert!(!ask(&mut c, ctx, PROMPTS[1], 6).tokens.is_empty());
    drop(c);
    assert!(d.term().success());
    let (tokens_a_chunk, held) = meta(ctx);
    assert_eq!(tokens_a_chunk, 8);
    assert!(held > 16, "{held} tokens");
    let d = w.serve(&[]);
    let mut c = w.connect("sized");
    assert!(!ask(&mut c, ctx, PROMPTS[2], 6).tokens.is_empty());
    drop(c);
    assert!(d.term().success());
    let (tokens_a_chunk, now) = meta(ctx);
    assert_eq!(tokens_a_chunk, 16, "the model's size");
    assert!(now > held, "the context lost tokens: {held} → {now}");
}

/// Chat-format calls: the daemon closes the last answer's turn, opens the user's and then the
/// assistant's, and encodes the text while the context's chunks are read back (each turn after a
/// drained restart, so every one reads from kvfs). Its answers are those of a local manager given
/// the template's tokens.
#[test]
fn chat_turns_answer_as_the_template_encodes_them_while_chunks_are_read() {
    let w = tests::World::chat(env!("CARGO_BIN_EXE_llms-e2e"));
    let tok = w.tokenizer();
    let (start, end) = (
        tok.token_id("<|im_start|>").unwrap(),
        tok.token_id("<|im_end|>").unwrap(),
    );
    let nl = tok.encode("\n");
    let turn = |k: usize, p: &str| -> Vec<u32> {
        if k == 0 {
            let m = model::tokenizer::Message::user(p);
            return tok.encode_chat(&[m], true).unwrap();
        }
        let mut t = vec![end];
        t.extend(&nl);
        t.push(start);
        t.extend(tok.encode(&format!("user\n{p}")));
        t.push(end);
        t.extend(&nl);
        t.push(start);
        t.extend(tok.encode("assistant\n"));
        t
    };
    let turns: Vec<Vec<u32>> = PROMPTS
        .iter()
        .enumerate()
        .map(|(k, p)| turn(k, p))
        .collect();
    let local = tests::local_token_answers(&w, &turns, 12);
    let params = protocol::client::CallParams {
        max_tokens: 12,
        ..Default::default()
    };
    let mut ctxs = Vec::new();
    let mut answers = vec![Vec::new(); 2];
    for (round, prompt) in PROMPTS.iter().enumerate() {
        let d = w.serve(&[]);
        let mut c = w.connect("chat");
        if ctxs.is_empty() {
            ctxs = (0..2)
                .map(|_| c.new_context(None, Default::default()).unwrap())
                .collect();
        }
        for (i, &ctx) in ctxs.iter().enumerate() {
            let a = c
                .call(ctx, prompt, &params)
                .unwrap()
                .collect_answer()
                .unwrap();
            answers[i].push(a.tokens);
        }
        if round > 0 {
            assert!(c.stats().unwrap().service.chunks_read > 0, "round {round}");
        }
        drop(c);
        assert!(d.term().success());
    }
    // Each context holds exactly the turns and their answers.
    let store = kvfs::Store::open(&w.store(), kvfs::StoreOptions::default()).unwrap();
    for (&ctx, a) in ctxs.iter().zip(&answers) {
        let said: Vec<u32> = turns
            .iter()
            .zip(a)
            .flat_map(|(t, a)| [&t[..], a].concat())
            .collect();
        assert_eq!(store.tokens(kvfs::ContextId(ctx)).unwrap(), said);
    }
    for a in answers {
        assert_eq!(a, local);
    }
}

#[test]
fn no_mount_serves_without_kvfs() {
    let w = world();
    let d = w.serve(&["--no-mount"]);
    assert!(!tests::is_mount_point(&w.mountpoint()));
    let mut c = w.connect("plain");
    let ctx = c.new_context(None, Default::default()).unwrap();
    assert!(!ask(&mut c, ctx, PROMPTS[0], 4).tokens.is_empty());
    drop(c);
    assert!(d.term().success());
}

/// A cgroup v1 memory group for one test, removed when dropped (after its tasks are gone).
struct MemoryGroup(std::path::PathBuf);

impl MemoryGroup {
    fn new(name: &str) -> MemoryGroup {
        let dir = std::path::Path::new("/sys/fs/cgroup/memory").join(name);
        std::fs::create_dir(&dir).unwrap();
        MemoryGroup(dir)
    }

    fn set(&self, file: &str, value: &str) {
        std::fs::write(self.0.join(file), value).unwrap();
    }
}

impl Drop for MemoryGroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.0);
    }
}

#[test]
fn a_memory_cgroup_limit_lowers_the_kv_budget_and_its_removal_restores_it() {
    let w = world();
    let max: u64 = 1 << 30;
    let d = w.serve(&[
        "--kv-budget",
        "1G",
        "--min-kv-budget",
        "16M",
        "--pressure-interval",
        "0.05",
    ]);
    let group = MemoryGroup::new(&format!("llms-test-{}", d.pid()));
    group.set("cgroup.procs", &d.pid().to_string());
    let limit: u64 = 512 << 20;
    group.set("memory.limit_in_bytes", &limit.to_string());
    let mut c = w.connect("pressure");
    let wait_for = |c: &mut protocol::client::Client, what: &str, ok: &dyn Fn(u64) -> bool| {
        let t = std::time::Instant::now();
        loop {
            let b = c.stats().unwrap().service.budget_bytes;
            if ok(b) {
                return b;
            }
            assert!(
                t.elapsed().as_secs() < 60,
                "{what}: the budget stayed at {b}"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    };
    // Under the limit, less what else the group uses, less the 64 MiB reserve.
    let lowered = wait_for(&mut c, "limit", &|b| b < max);
    assert!(lowered <= limit - (64 << 20), "{lowered}");
    // Calls still run under the lowered budget.
    let ctx = c.new_context(None, Default::default()).unwrap();
    assert!(!ask(&mut c, ctx, PROMPTS[1], 4).tokens.is_empty());
    group.set("memory.limit_in_bytes", "-1");
    wait_for(&mut c, "no limit", &|b| b == max);
    drop(c);
    assert!(d.term().success());
}

/// The issue's crash loop: at least 20 kills at random moments of a replay of calls (`llms bench
/// crash` runs it; `--kills 100` and the real model for longer runs).
#[test]
fn kill_9_loop_loses_no_completed_call() {
    let w = world();
    let json = w.dir.path().join("out/crash.json");
    let out = w
        .llms()
        .args(["bench", "crash", "--kills", "20", "--seed"])
        .arg(seed("kill_9_loop").to_string())
        .arg("--model")
        .arg(&w.model)
        .arg("--out")
        .arg(w.dir.path().join("out"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(r["kills"], 20);
    for k in ["diverged", "lost", "quarantined"] {
        assert_eq!(r[k], 0, "{k}: {r}");
    }
    assert!(
        r["calls_interrupted"].as_u64().unwrap() + r["calls_completed"].as_u64().unwrap() >= 20
    );
}

#[test]
fn deleting_a_context_right_after_its_call_fails_no_write() {
    let w = world();
    let d = w.serve(&[]);
    let mut c = w.connect("delete");
    for _ in 0..5 {
        let ctx = c.new_context(None, Default::default()).unwrap();
        ask(&mut c, ctx, PROMPTS[1], 8);
        // Its chunks may still wait in the AoT queue.
        c.delete(ctx).unwrap();
    }
    let t = std::time::Instant::now();
    let s = loop {
        let s = c.stats().unwrap().service;
        if s.writes_queued == 0 {
            break s;
        }
        assert!(t.elapsed().as_secs() < 60, "the AoT queue never drained");
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert_eq!(s.write_failures, 0, "{s:?}");
    drop(c);
    assert!(d.term().success());
}

/// A baseline manager through the daemon and its mount: three contexts in turn under a budget
/// of a little more than the largest, so calls bring their context back. `vllm-sq` writes
/// nothing ahead of time: each victim is written through the mount while its reclaim waits
/// (under the pager's lock, so a deadlock there would hang this test), and read back through the
/// mount; the answers are those of the same manager with room for everything.
#[test]
fn a_baseline_manager_writes_victims_back_through_the_mount_and_answers_as_unpressured() {
    let slot = model::Model::load(&world().model)
        .unwrap()
        .chunk_shape(16)
        .slot_bytes(model::kv::KvFormat::Int8);
    let run = |budget: &str| {
        let w = world();
        let d = w.serve(&[
            "--manager",
            "vllm-sq",
            "--kv-budget",
            budget,
            "--no-pressure",
        ]);
        let mut c = w.connect("baseline");
        let ctxs: Vec<u64> = (0..3)
            .map(|_| c.new_context(None, Default::default()).unwrap())
            .collect();
        let mut answers = Vec::new();
        for p in PROMPTS {
            for &ctx in &ctxs {
                answers.push(ask(&mut c, ctx, p, 12).tokens);
            }
        }
        let s = c.stats().unwrap().service;
        let largest = c.list().unwrap().iter().map(|i| i.chunks).max().unwrap();
        let m = tests::mount_counts(&w.mountpoint());
        drop(c);
        assert!(d.term().success());
        (answers, s, largest, m)
    };
    let (free, s, largest, m) = run("256M");
    assert_eq!(
        (s.manager.as_str(), s.sync_reclaims, m.kv_writes),
        ("vllm-sq", 0, 0)
    );
    let budget = ((largest + 2) * slot).to_string();
    let (pressed, s, _, m) = run(&budget);
    assert_eq!(pressed, free);
    assert!(s.sync_reclaims > 0 && s.chunks_read > 0, "{s:?}");
    assert_eq!(
        (s.writes, s.unwritten_reclaims, s.chunks_recomputed),
        (0, 0, 0),
        "{s:?}"
    );
    assert_eq!(
        m.kv_writes, s.sync_reclaims,
        "victims not written through the mount"
    );
    // Read back through the mount's data files, passed through: never by the store itself.
    assert!(m.passthrough_opens > 0, "{m:?}");
    assert_eq!(
        (m.store_reads, m.daemon_reads),
        (0, 0),
        "chunks not read through the mount"
    );
}

#[test]
fn stats_show_weights_resident_and_read_per_token() {
    use model::tiny::{TinySpec, write_tiny_gguf};
    use model::{Model, ModelError, WeightOptions};
    let mut w = world();
    // Wider than the default tiny model, so its matrices outweigh the stream's buffers.
    let wide = w.dir.path().join("wide.gguf");
    let spec = TinySpec {
        hidden: 256,
        n_layers: 6,
        max_ctx: tests::MAX_CONTEXT,
        ..TinySpec::default()
    };
    write_tiny_gguf(&wide, &spec).unwrap();
    w.model = wide;
    let full = Model::load(&w.model).unwrap();
    let total = full.weight_bytes() as u64;
    let minimum = match Model::load_with(
        &w.model,
        &WeightOptions {
            budget: Some(1),
            ..WeightOptions::default()
        },
    ) {
        Err(ModelError::Budget { minimum, .. }) => minimum,
        other => panic!("a 1-byte budget must be refused, got {:?}", other.err()),
    };
    assert!(minimum < total, "minimum {minimum} of {total}");
    // Room for some matrices beside the stream's buffers, not for all of them.
    let budget = minimum + (total - minimum) / 3;
    let local = local_answers(&w, &PROMPTS[..2], 10);

    let d = w.serve(&["--weight-budget", &budget.to_string()]);
    let mut c = w.connect("weights");
    let s = c.stats().unwrap().service.weights;
    assert_eq!(s.budget_bytes, Some(budget), "{s:?}");
    assert!(s.resident_bytes <= budget, "{s:?}");
    assert!(
        s.buffer_bytes > 0 && s.buffer_bytes < s.resident_bytes,
        "{s:?}"
    );
    assert!(s.streamed_bytes > 0, "{s:?}");
    assert_eq!((s.decode_tokens, s.read_bytes_per_token), (0, 0.0), "{s:?}");
    let ctx = c.new_context(None, Default::default()).unwrap();
    let got: Vec<Vec<u32>> = PROMPTS[..2]
        .iter()
        .map(|p| ask(&mut c, ctx, p, 10).tokens)
        .collect();
    assert_eq!(got, local, "a budget changes no token");
    let decoded: u64 = got.iter().map(|t| t.len().saturating_sub(1) as u64).sum();
    assert!(decoded > 0, "{got:?}");
    let s = c.stats().unwrap().service.weights;
    assert!(s.resident_bytes <= budget, "{s:?}");
    assert_eq!(s.decode_tokens, decoded, "{s:?}");
    // Every decode token reads exactly the matrices that are not resident.
    assert_eq!(s.read_bytes_per_token, s.streamed_bytes as f64, "{s:?}");
    // The prefills read them too: at least one pass a call besides the decode tokens.
    assert!(
        s.bytes_read >= (decoded + 2) * s.streamed_bytes,
        "{s:?} after {decoded} decode tokens"
    );
    drop(c);
    assert!(d.term().success());

    let _d = w.serve(&[]);
    let mut c = w.connect("weights");
    let ctx = c.new_context(None, Default::default()).unwrap();
    let tokens = ask(&mut c, ctx, PROMPTS[0], 10).tokens;
    assert_eq!(tokens, local[0]);
    let s = c.stats().unwrap().service.weights;
    assert_eq!(s.budget_bytes, None, "{s:?}");
    assert_eq!(s.residency, "all");
    assert_eq!(s.resident_bytes, total, "{s:?}");
    assert_eq!(
        (s.buffer_bytes, s.streamed_bytes, s.bytes_read),
        (0, 0, 0),
        "{s:?}"
    );
    assert_eq!(
        s.decode_tokens,
        tokens.len().saturating_sub(1) as u64,
        "{s:?}"
    );
    assert_eq!(s.read_bytes_per_token, 0.0, "{s:?}");
}

/// The daemon `llms chat` starts in the background outlives it: it must not keep what the
/// chat's own parent leaked to it (`flock LOCK llms chat` once kept a build lock held for as
/// long as such a daemon ran). And `llms stats --json` prints its counters as the protocol
/// does.
#[test]
fn a_daemon_that_chat_starts_keeps_no_descriptor_of_its_parent() {
    use nix::fcntl::{Flock, FlockArg, OFlag, open};
    use nix::sys::stat::Mode;
    let w = world();
    let d = w.dir.path();
    // A descriptor this test leaks to its children: opened without O_CLOEXEC, as `flock FILE
    // CMD` passes its lock.
    let leaked_path = d.join("leaked");
    let leaked = open(
        &leaked_path,
        OFlag::O_CREAT | OFlag::O_RDWR,
        Mode::from_bits_truncate(0o600),
    )
    .unwrap();
    let fd = std::os::fd::AsRawFd::as_raw_fd(&leaked);
    let fdinfo = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).unwrap();
    assert!(
        fdinfo.contains("flags:\t0") && !fdinfo.contains("flags:\t02"),
        "the descriptor is not inheritable: {fdinfo}"
    );
    let store = d.join("store");
    let config = d.join("serve.toml");
    std::fs::write(
        &config,
        format!(
            "store = {:?}\ncreate = true\nthreads = 1\nmax-context = {}\n",
            store.to_str().unwrap(),
            tests::MAX_CONTEXT
        ),
    )
    .unwrap();
    let out = w
        .llms()
        .args(["chat", "--prompt", "Hello", "--max-tokens", "3", "--socket"])
        .arg(w.socket())
        .arg("--model")
        .arg(&w.model)
        .env("LLMS_CONFIG", &config)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    // The tiny model has no chat template, so the chat itself is refused, by the daemon it
    // started.
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("no_chat_template"),
        "{err}"
    );
    let pid: i32 = err
        .split("llms serve is pid ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("chat did not start a daemon: {err}"));
    let held: Vec<_> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.unwrap().path()).ok())
        .collect();
    let stats = w
        .llms()
        .args(["stats", "--json", "--socket"])
        .arg(w.socket())
        .output()
        .unwrap();
    // SIGTERM drains the daemon; it holds the store's lock until it exits.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let lock = std::fs::File::open(d.join("store.lock")).unwrap();
    let _exited = Flock::lock(lock, FlockArg::LockExclusive).unwrap();
    assert!(
        !held.contains(&leaked_path),
        "the daemon holds the descriptor its parent leaked: {held:?}"
    );
    assert!(held.contains(&d.join("store.lock")), "{held:?}");
    assert!(stats.status.success(), "{stats:?}");
    let s: serde_json::Value = serde_json::from_slice(&stats.stdout).unwrap();
    assert_eq!(
        (s["calls"].as_u64(), s["contexts"].as_u64()),
        (Some(0), Some(0)),
        "{s}"
    );
    assert_eq!(s["switch"]["count"].as_u64(), Some(0), "{s}");
    assert_eq!(s["manager"], "llms", "{s}");
    // The chat's hello, new, call and delete, and this hello and stats.
    assert!(s["daemon"]["requests"].as_u64().unwrap() >= 5, "{s}");
    assert!(s.get("service").is_none(), "{s}");
}

/// `--exit-with-parent`: a daemon whose starter is killed (SIGKILL, no chance to clean up)
/// drains, unmounts its kvfs mount and exits by itself.
#[test]
fn a_daemon_whose_starter_is_killed_exits_and_unmounts() {
    let w = world();
    // The starter: a shell that runs the daemon in the background and waits for it.
    let script = r#""$0" serve --socket "$1" --store "$2" --create --model "$3" --threads 1 --exit-with-parent & echo "pid $!"; wait"#;
    let mut starter = std::process::Command::new("sh")
        .arg("-c")
        .arg(script)
        .arg(&w.bin)
        .arg(w.socket())
        .arg(w.store())
        .arg(&w.model)
        .env_remove("LLMS_CONFIG")
        .env("RUST_LOG", "warn")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(starter.stdout.take().unwrap());
    let (mut first, mut second) = (String::new(), String::new());
    out.read_line(&mut first).unwrap();
    out.read_line(&mut second).unwrap();
    let pid: i32 = first.trim().strip_prefix("pid ").unwrap().parse().unwrap();
    assert!(second.starts_with("llms serve: listening"), "{second:?}");
    let mount = w.mountpoint();
    let mounted = || {
        std::fs::read_to_string("/proc/mounts")
            .unwrap()
            .contains(&format!(" {} ", mount.display()))
    };
    assert!(mounted(), "the daemon mounts kvfs");
    starter.kill().unwrap();
    starter.wait().unwrap();
    // The daemon was reparented: it has exited once it is gone or a zombie its new parent has
    // not reaped yet.
    let alive = || {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
            s.rsplit_once(") ")
                .is_some_and(|(_, r)| !r.starts_with('Z'))
        })
    };
    let t = std::time::Instant::now();
    while alive() {
        assert!(
            t.elapsed() < std::time::Duration::from_secs(30),
            "the daemon {pid} outlived its starter"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(!mounted(), "the daemon left its mount behind");
}
