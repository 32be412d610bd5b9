//! What the fetch tests share: the leftovers a fetch may leave, and a fetch interrupted by
//! `kill -9` at the moment it writes the model file.

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// The names a fetch leaves in `dir` while it works (`.fetch-*`), sorted.
pub fn leftovers(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|it| {
            it.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(".fetch-"))
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// Runs test `test` of this test binary in a child process group with `env` set, and kills the
/// group (the child and its pip) with SIGKILL once a `.partial` model file appears in `dir`: the
/// model downloaded and being written. Panics if the child ends first or writes nothing in 300 s.
pub fn kill_fetch_while_it_writes(test: &str, env: (&str, String), dir: &Path) {
    let exe = std::env::current_exe().unwrap_or_else(|e| panic!("no test executable: {e}"));
    let mut child = Command::new(exe)
        .args(["--exact", test, "--test-threads=1"])
        .env(env.0, env.1)
        .process_group(0)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start the child: {e}"));
    let started = Instant::now();
    while !leftovers(dir).iter().any(|n| n.ends_with(".partial")) {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("the child fetch ended ({status}) before it could be interrupted");
        }
        if started.elapsed() > Duration::from_secs(300) {
            let _ = child.kill();
            panic!("the child fetch wrote no model file in 300 s");
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let killed = Command::new("kill")
        .args(["-KILL", "--", &format!("-{}", child.id())])
        .status();
    assert!(
        killed.is_ok_and(|s| s.success()),
        "cannot kill the child's process group"
    );
    let status = child
        .wait()
        .unwrap_or_else(|e| panic!("cannot reap the child: {e}"));
    assert!(!status.success());
}
