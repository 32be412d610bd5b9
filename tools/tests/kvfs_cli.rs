//! `llms kvfs mount` and `llms kvfs inspect` as a user runs them: a real mount, unmounted cleanly
//! on SIGINT and SIGTERM, and an inspection that changes nothing.

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
