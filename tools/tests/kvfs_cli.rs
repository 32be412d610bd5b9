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
    let tmp = store.join(format!("contexts/{id}/chunks/.tmp-0-99"));
    std::fs::write(&tmp, b"a write in flight").unwrap();
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
    assert!(tmp.exists(), "inspect removed a file of a running writer");
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
