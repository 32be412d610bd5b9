//! `llms kvfs mount` and `llms kvfs inspect` as a user runs them: a real mount, unmounted cleanly
//! on SIGINT and SIGTERM, decoding text with the tokenizer of the model it is given, and an
//! inspection that changes nothing.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};

use kvfs::{Fingerprint, KvFormat, NewContext, Store, StoreOptions};

const LLMS: &str = env!("CARGO_BIN_EXE_llms");

fn is_mounted(path: &Path) -> bool {
    let path = std::fs::canonicalize(path).unwrap();
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    info.lines()
        .any(|l| l.split(' ').nth(4) == Some(path.to_str().unwrap()))
}

fn store_with_a_chunk(dir: &Path) -> kvfs::ContextId {
    let store = Store::open(dir, StoreOptions::default()).unwrap();
    let fp = Fingerprint([1; 32]);
    let id = store
        .create_context(NewContext {
            owner_uid: 0,
            app: "cli".into(),
            fingerprint: fp,
            chunk_tokens: 16,
        })
        .unwrap();
    store.append_tokens(id, &[5; 20]).unwrap();
    store
        .write_chunk(id, 0, &fp, KvFormat::Int4, 0.5, b"chunk zero")
        .unwrap();
    id
}

#[test]
fn mount_serves_until_a_signal_then_unmounts() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let id = store_with_a_chunk(&store);
    for signal in ["-INT", "-TERM"] {
        let mut child = Command::new(LLMS)
            .args(["kvfs", "mount", "--store"])
            .arg(&store)
            .arg(&mnt)
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut err = BufReader::new(child.stderr.take().unwrap());
        let mut line = String::new();
        while !line.contains("mounted at") {
            line.clear();
            assert!(
                err.read_line(&mut line).unwrap() > 0,
                "llms exited before mounting"
            );
        }
        assert!(is_mounted(&mnt));
        let chunk = mnt.join(format!("{id}/chunks/0"));
        assert_eq!(std::fs::read(&chunk).unwrap(), b"chunk zero");
        let write = std::fs::write(&chunk, b"x").unwrap_err();
        assert_eq!(write.raw_os_error(), Some(libc::EROFS));
        let kill = Command::new("kill")
            .arg(signal)
            .arg(child.id().to_string())
            .status()
            .unwrap();
        assert!(kill.success());
        let status = child.wait().unwrap();
        assert!(status.success(), "{signal}: {status}");
        assert!(!is_mounted(&mnt), "{signal}: still mounted");
    }
}

#[test]
fn inspect_lists_contexts_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let id = store_with_a_chunk(&store);
    // A write in flight: a new copy's payload in chunk 0's free slot, its header not yet written.
    use std::os::unix::fs::FileExt;
    let data = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(store.join(format!("contexts/{id}/data")))
        .unwrap();
    let in_flight = kvfs::slot_offset(0, 1) + kvfs::HEADER_PAGE as u64;
    data.write_all_at(b"a write in flight", in_flight).unwrap();
    let out = Command::new(LLMS)
        .args(["kvfs", "inspect", "--verify", "--store"])
        .arg(&store)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("contexts     1"), "{text}");
    assert!(
        text.lines()
            .any(|l| l.starts_with(&format!("{id} ")) && l.contains("cli")),
        "{text}"
    );
    assert!(text.contains("every stored chunk checks out"), "{text}");
    let mut left = [0u8; 17];
    data.read_exact_at(&mut left, in_flight).unwrap();
    assert_eq!(
        &left, b"a write in flight",
        "inspect removed a write of a running writer"
    );
    let out = Command::new(LLMS)
        .args(["kvfs", "inspect", "--context", &id.to_string(), "--store"])
        .arg(&store)
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("int4 1") && text.contains("tokens       20"),
        "{text}"
    );
    let out = Command::new(LLMS)
        .args(["kvfs", "inspect", "--store"])
        .arg(dir.path().join("nothing"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(
        err.contains("not a kvfs store") && !err.contains("panicked"),
        "{err}"
    );
}

#[test]
fn inspect_json_is_the_same_inspection_on_stdout() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let id = store_with_a_chunk(&store);
    let inspect = |extra: &[&str]| {
        let out = Command::new(LLMS)
            .args(["kvfs", "inspect", "--json"])
            .args(extra)
            .arg("--store")
            .arg(&store)
            .output()
            .unwrap();
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!("{e}: {}", String::from_utf8_lossy(&out.stdout));
        });
        (out.status.success(), json)
    };
    let (ok, all) = inspect(&["--verify"]);
    assert!(ok, "{all}");
    assert_eq!(all["store"], store.to_str().unwrap());
    assert_eq!(all["problems"], serde_json::json!([]));
    assert_eq!(all["verify"]["corrupt"], serde_json::json!([]));
    let contexts = all["contexts"].as_array().unwrap();
    assert_eq!(contexts.len(), 1);
    let c = &contexts[0];
    assert_eq!(c["id"], id.0);
    assert_eq!(c["app"], "cli");
    assert_eq!(c["owner_uid"], 0);
    assert_eq!(
        (c["tokens"].as_u64(), c["chunk_tokens"].as_u64()),
        (Some(20), Some(16))
    );
    // 20 tokens are two chunk slots: the first stored, the second never written.
    assert_eq!(
        (c["stored"].as_u64(), c["missing"].as_u64()),
        (Some(1), Some(1))
    );
    let chunks = c["chunks"].as_array().unwrap();
    assert_eq!(chunks.len(), 2);
    assert_eq!(chunks[0]["state"], "stored");
    assert_eq!(chunks[0]["format"], "int4");
    assert_eq!(chunks[0]["tokens"], serde_json::json!([0, 16]));
    assert_eq!(chunks[0]["raw_bytes"], b"chunk zero".len());
    let written = chunks[0]["written"].as_u64().unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    assert!(written <= now && now - written < 600, "{written} {now}");
    assert_eq!(chunks[1]["state"], "missing");
    assert_eq!(chunks[1]["tokens"], serde_json::json!([16, 20]));

    // One context, no --verify: the same context, and `verify` null.
    let (ok, one) = inspect(&["--context", &id.to_string()]);
    assert!(ok, "{one}");
    assert_eq!(one["contexts"], all["contexts"]);
    assert!(one["verify"].is_null(), "{one}");

    // A damaged chunk: still the JSON on stdout, naming it, and a failure.
    use std::os::unix::fs::FileExt;
    let data = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(store.join(format!("contexts/{id}/data")))
        .unwrap();
    // The first copy of chunk 0, "chunk zero" stored raw: flip its last byte.
    let last = kvfs::slot_offset(0, 0) + kvfs::HEADER_PAGE as u64 + 9;
    let mut b = [0u8];
    data.read_exact_at(&mut b, last).unwrap();
    data.write_all_at(&[b[0] ^ 0xFF], last).unwrap();
    let (ok, bad) = inspect(&["--verify"]);
    assert!(!ok);
    let corrupt = bad["verify"]["corrupt"].as_array().unwrap();
    assert_eq!(corrupt.len(), 1, "{bad}");
    assert_eq!(
        (corrupt[0]["context"].as_u64(), corrupt[0]["chunk"].as_u64()),
        (Some(id.0), Some(0))
    );
}

/// `llms kvfs mount` running in the background until dropped (then SIGTERM, and it must unmount).
struct Mounted {
    child: std::process::Child,
    mnt: std::path::PathBuf,
    /// What it said on stderr up to "mounted at".
    said: String,
}

impl Mounted {
    fn start(store: &Path, mnt: &Path, extra: &[&std::ffi::OsStr]) -> Mounted {
        let mut child = Command::new(LLMS)
            .args(["kvfs", "mount", "--store"])
            .arg(store)
            .arg(mnt)
            .args(extra)
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut err = BufReader::new(child.stderr.take().unwrap());
        let mut said = String::new();
        while !said.contains("mounted at") {
            assert!(
                err.read_line(&mut said).unwrap() > 0,
                "llms exited before mounting: {said}"
            );
        }
        Mounted {
            child,
            mnt: mnt.to_owned(),
            said,
        }
    }

    fn read(&self, rel: String) -> String {
        std::fs::read_to_string(self.mnt.join(rel)).unwrap()
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .arg(self.child.id().to_string())
            .status();
        let _ = self.child.wait();
    }
}

/// `--model FILE` and `--model NAME` decode the contexts of that model with its tokenizer, control
/// tokens visible; a context of another model is not decoded (its text and info say so); without
/// a model, text says no tokenizer is loaded and points at `tokens`. Another uid reads nothing.
///
/// Kept whole: one scenario through the real CLI's mounts, read top to bottom.
#[test]
fn mount_with_a_model_shows_its_contexts_as_text() {
    use model::tiny::{TINY_CHATML, TinySpec, write_tiny_gguf};
    use model::tokenizer::{Message, Tokenizer};
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    // Other uids must reach the mount point for the ownership checks.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let models = dir.path().join("models");
    std::fs::create_dir(&models).unwrap();
    let gguf = models.join("tiny-chat.gguf");
    write_tiny_gguf(
        &gguf,
        &TinySpec {
            chat_template: Some(TINY_CHATML.into()),
            ..TinySpec::default()
        },
    )
    .unwrap();
    let tok = Tokenizer::from_gguf_file(&gguf).unwrap();
    let fp = service::source::model_fingerprint(&gguf).unwrap();
    let said = tok
        .encode_chat(&[Message::user("Remember: my secret is 4711.")], true)
        .unwrap();
    let store_dir = dir.path().join("store");
    let (mine, nobodys, foreign) = {
        let store = Store::open(&store_dir, StoreOptions::default()).unwrap();
        let context = |owner: u32, fingerprint: Fingerprint, tokens: &[u32]| {
            let id = store
                .create_context(NewContext {
                    owner_uid: owner,
                    app: "cli".into(),
                    fingerprint,
                    chunk_tokens: 16,
                })
                .unwrap();
            store.append_tokens(id, tokens).unwrap();
            store
                .write_chunk(id, 0, &fingerprint, KvFormat::Int8, 0.5, b"sixteen tokens")
                .unwrap();
            id
        };
        (
            context(0, fp, &said),
            context(65534, fp, &said),
            context(0, Fingerprint([fp.0[0] ^ 1; 32]), &said),
        )
    };
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let name = std::ffi::OsStr::new("tiny-chat");
    for model in [gguf.as_os_str(), name] {
        let m = Mounted::start(
            &store_dir,
            &mnt,
            &[
                "--model".as_ref(),
                model,
                "--models-dir".as_ref(),
                models.as_os_str(),
            ],
        );
        assert!(
            m.said.contains("1 of 3 contexts belong to another model"),
            "{}",
            m.said
        );
        let text = m.read(format!("{mine}/text"));
        assert_eq!(text, tok.decode(&said));
        assert!(
            text.starts_with(
                "<|im_start|>user\nRemember: my secret is 4711.<|im_end|>\n<|im_start|>assistant\n"
            ),
            "{text}"
        );
        let ids: Vec<String> = said.iter().map(u32::to_string).collect();
        assert_eq!(
            m.read(format!("{mine}/tokens")),
            format!("{}\n", ids.join(" "))
        );
        assert!(
            m.read(format!("{mine}/info"))
                .contains("decoded by this model's tokenizer")
        );
        // The same tokens under another model: never decoded with this tokenizer.
        let text = m.read(format!("{foreign}/text"));
        assert!(text.contains("not decoded"), "{text}");
        assert!(!text.contains("Remember"), "{text}");
        let info = m.read(format!("{foreign}/info"));
        assert!(
            info.lines()
                .any(|l| l.starts_with("note") && l.contains(&fp.to_string())),
            "{info}"
        );
        // Another uid reads nothing of root's context; its own, it does (the control).
        let nobody = |rel: String| {
            use std::os::unix::process::CommandExt;
            Command::new("cat")
                .arg(mnt.join(rel))
                .uid(65534)
                .gid(65534)
                .output()
                .unwrap()
        };
        for f in ["text", "tokens", "info"] {
            let out = nobody(format!("{mine}/{f}"));
            assert!(
                !out.status.success() && out.stdout.is_empty(),
                "{f}: {out:?}"
            );
        }
        let out = nobody(format!("{nobodys}/text"));
        assert!(out.status.success(), "{out:?}");
        assert_eq!(String::from_utf8(out.stdout).unwrap(), tok.decode(&said));
    }
    // No model: text says so and where the ids are.
    let m = Mounted::start(&store_dir, &mnt, &[]);
    let text = m.read(format!("{mine}/text"));
    assert!(
        text.contains("no tokenizer is loaded") && text.contains("`tokens`"),
        "{text}"
    );
    drop(m);
    // A model that is neither a file nor cached: a clear error, nothing mounted.
    let out = Command::new(LLMS)
        .args(["kvfs", "mount", "--model", "no-such-model", "--models-dir"])
        .arg(&models)
        .arg("--store")
        .arg(&store_dir)
        .arg(&mnt)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(
        err.contains("no model no-such-model") && !err.contains("panicked"),
        "{err}"
    );
    assert!(!is_mounted(&mnt));
}
