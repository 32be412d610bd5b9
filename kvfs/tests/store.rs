//! The store through its Rust API: round trips, persistence, recovery, corruption and model checks.

use std::path::Path;

use kvfs::format::{ChunkHeader, HEADER_LEN};
use kvfs::{
    ChunkState, Codec, ContextId, Fingerprint, KvFormat, NewContext, Store, StoreError,
    StoreOptions,
};

const FP: Fingerprint = Fingerprint([7; 32]);

fn new_ctx(store: &Store, tokens: usize) -> ContextId {
    let id = store
        .create_context(NewContext {
            owner_uid: 1000,
            app: "chat".into(),
            fingerprint: FP,
            chunk_tokens: 16,
        })
        .unwrap();
    store
        .append_tokens(id, &(0..tokens as u32).collect::<Vec<_>>())
        .unwrap();
    id
}

fn chunk_bytes(seed: u32, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(2654435761).wrapping_add(1);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            // Skewed values so zstd has something to find.
            (x % 7) as u8
        })
        .collect()
}

fn open(dir: &Path) -> Store {
    Store::open(dir, StoreOptions::default()).unwrap()
}

#[test]
fn every_format_round_trips_and_survives_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let id = new_ctx(&store, 16 * KvFormat::ALL.len());
    for (i, f) in KvFormat::ALL.into_iter().enumerate() {
        let data = chunk_bytes(i as u32, 4096 << i);
        let meta = store.write_chunk(id, i as u32, &FP, f, 0.5, &data).unwrap();
        assert_eq!(meta.format, f);
        assert_eq!(store.read_chunk(id, i as u32, &FP).unwrap(), data);
    }
    drop(store);
    let store = open(dir.path());
    assert!(store.recovered().is_empty(), "{:?}", store.recovered());
    for (i, f) in KvFormat::ALL.into_iter().enumerate() {
        assert_eq!(
            store.read_chunk(id, i as u32, &FP).unwrap(),
            chunk_bytes(i as u32, 4096 << i)
        );
        match store.chunk_state(id, i as u32).unwrap() {
            ChunkState::Stored(s) => {
                assert_eq!(s.format, f);
                assert_eq!(s.density, 0.5);
                assert_eq!(s.tokens, (i as u32 * 16)..(i as u32 * 16 + 16));
            }
            other => panic!("chunk {i} is {other:?}"),
        }
    }
    let n = 16 * KvFormat::ALL.len() as u32;
    assert_eq!(store.tokens(id).unwrap(), (0..n).collect::<Vec<u32>>());
}

#[test]
fn compression_is_kept_only_where_it_pays() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let id = new_ctx(&store, 32);
    let skewed = chunk_bytes(1, 65536);
    let mut x = 88172645463325252u64;
    let noise: Vec<u8> = (0..65536)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 32) as u8
        })
        .collect();
    assert_eq!(
        store
            .write_chunk(id, 0, &FP, KvFormat::Int8, 0.0, &skewed)
            .unwrap()
            .codec,
        Codec::Zstd
    );
    let raw = store
        .write_chunk(id, 1, &FP, KvFormat::Int8, 0.0, &noise)
        .unwrap();
    assert_eq!(raw.codec, Codec::Raw);
    assert_eq!(raw.stored_len, raw.raw_len);
    assert_eq!(store.read_chunk(id, 1, &FP).unwrap(), noise);
}

#[test]
fn flipped_bits_are_detected_quarantined_and_marked_for_recompute() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let id = new_ctx(&store, 16 * 8);
    let data = chunk_bytes(3, 20000);
    // Flip one bit at a spread of offsets: header fields, header crc, payload start, middle and end.
    let file_len = {
        store
            .write_chunk(id, 0, &FP, KvFormat::Int8, 0.1, &data)
            .unwrap();
        std::fs::metadata(store.chunk_path(id, 0)).unwrap().len() as usize
    };
    let offsets = [
        0,
        9,
        13,
        20,
        40,
        60,
        70,
        97,
        104,
        105,
        file_len / 2,
        file_len - 1,
    ];
    for (n, at) in offsets.into_iter().enumerate() {
        let index = (n % 8) as u32;
        store
            .write_chunk(id, index, &FP, KvFormat::Int8, 0.1, &data)
            .unwrap();
        let path = store.chunk_path(id, index);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[at] ^= 0x04;
        std::fs::write(&path, &bytes).unwrap();
        let err = store.read_chunk(id, index, &FP).unwrap_err();
        assert!(
            matches!(err, StoreError::Corrupt { .. }),
            "offset {at}: {err}"
        );
        assert!(err.needs_recompute());
        assert!(matches!(
            store.chunk_state(id, index).unwrap(),
            ChunkState::Quarantined { .. }
        ));
        assert!(!path.exists(), "corrupt file left in place");
        // Asking again does not serve anything either.
        assert!(store.read_chunk(id, index, &FP).is_err());
    }
    let q = std::fs::read_dir(dir.path().join("quarantine"))
        .unwrap()
        .count();
    assert_eq!(q, offsets.len());
}

fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 32) as u8
        })
        .collect()
}

/// Reads chunk `index` every way the API offers and checks they all give `data`.
fn check_every_read_path(store: &Store, id: ContextId, index: u32, data: &[u8]) {
    assert_eq!(store.read_chunk(id, index, &FP).unwrap(), data);
    // Into a larger caller buffer: the chunk at the front, the rest untouched.
    let mut buf = vec![0xa5u8; data.len() + 4099];
    let meta = store.read_chunk_into(id, index, &FP, &mut buf).unwrap();
    assert_eq!(meta.raw_len as usize, data.len());
    assert_eq!(&buf[..data.len()], data);
    assert!(buf[data.len()..].iter().all(|&b| b == 0xa5));
    // Into an exact buffer.
    let mut exact = vec![0u8; data.len()];
    store.read_chunk_into(id, index, &FP, &mut exact).unwrap();
    assert_eq!(exact, data);
    // Into a reused vector, which shrinks and grows to the chunk.
    let mut v = vec![9u8; 3];
    store.read_chunk_into_vec(id, index, &FP, &mut v).unwrap();
    assert_eq!(v, data);
    // The image the mount serves: a valid raw chunk file of the plain bytes.
    let image = store
        .with_chunk_image(id, index, &FP, |_, image| image.to_vec())
        .unwrap();
    let h = ChunkHeader::decode(&image).unwrap();
    assert_eq!((h.context, h.index, h.codec), (id.0, index, Codec::Raw));
    assert_eq!(h.raw_len as usize, data.len());
    h.check_payload(&image[HEADER_LEN..]).unwrap();
    assert_eq!(&image[HEADER_LEN..], data);
    assert_eq!(
        meta,
        store
            .with_chunk_image(id, index, &FP, |m, _| m.clone())
            .unwrap()
    );
}

#[test]
fn reads_into_a_caller_buffer_equal_read_chunk_for_every_format_and_codec() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let id = new_ctx(&store, 16 * 4 * KvFormat::ALL.len());
    let mut index = 0;
    for f in KvFormat::ALL {
        // Skewed bytes compress (zstd), noise does not (raw); sizes around the O_DIRECT alignment.
        for (data, codec) in [
            (chunk_bytes(index, 212 << 10), Codec::Zstd),
            (noise(index as u64, 120 << 10), Codec::Raw),
            (noise(7 + index as u64, 4096 - HEADER_LEN), Codec::Raw),
            (chunk_bytes(index, 1), Codec::Raw),
        ] {
            let meta = store.write_chunk(id, index, &FP, f, 0.25, &data).unwrap();
            assert_eq!(meta.codec, codec, "format {f} len {}", data.len());
            check_every_read_path(&store, id, index, &data);
            index += 1;
        }
    }
    // The same after a reopen, from other threads (each with its own buffers).
    drop(store);
    let store = open(dir.path());
    std::thread::scope(|s| {
        for t in 0..2u32 {
            let store = &store;
            s.spawn(move || {
                for i in (t..index).step_by(2) {
                    let data = store.read_chunk(id, i, &FP).unwrap();
                    check_every_read_path(store, id, i, &data);
                }
            });
        }
    });
}

#[test]
fn a_buffer_too_small_is_an_error_that_quarantines_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let id = new_ctx(&store, 32);
    for (i, data) in [chunk_bytes(1, 50000), noise(2, 50000)].iter().enumerate() {
        store
            .write_chunk(id, i as u32, &FP, KvFormat::Int8, 0.0, data)
            .unwrap();
        let mut small = vec![0u8; 49999];
        let err = store
            .read_chunk_into(id, i as u32, &FP, &mut small)
            .unwrap_err();
        assert!(
            matches!(
                err,
                StoreError::BufferTooSmall {
                    need: 50000,
                    have: 49999,
                    ..
                }
            ),
            "{err}"
        );
        assert!(!err.needs_recompute());
        assert!(matches!(
            store.chunk_state(id, i as u32).unwrap(),
            ChunkState::Stored(_)
        ));
        assert_eq!(&store.read_chunk(id, i as u32, &FP).unwrap(), data);
    }
}

#[test]
fn a_corrupt_chunk_is_refused_by_every_read_path_and_quarantined() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let id = new_ctx(&store, 16 * 6);
    // Raw and zstd chunks, one flipped bit in the payload, read through each path in turn.
    let cases = [chunk_bytes(1, 30000), noise(2, 30000)];
    let mut index = 0;
    for data in &cases {
        for path in 0..3 {
            store
                .write_chunk(id, index, &FP, KvFormat::Int4, 0.0, data)
                .unwrap();
            let file = store.chunk_path(id, index);
            let mut bytes = std::fs::read(&file).unwrap();
            let at = HEADER_LEN + (bytes.len() - HEADER_LEN) / 3;
            bytes[at] ^= 0x10;
            std::fs::write(&file, &bytes).unwrap();
            let mut buf = vec![0u8; data.len()];
            let mut served = false;
            let err = match path {
                0 => store.read_chunk_into(id, index, &FP, &mut buf).unwrap_err(),
                1 => store
                    .read_chunk_into_vec(id, index, &FP, &mut buf)
                    .unwrap_err(),
                _ => store
                    .with_chunk_image(id, index, &FP, |_, _| served = true)
                    .unwrap_err(),
            };
            assert!(!served, "a corrupt image was handed out");
            assert!(matches!(err, StoreError::Corrupt { .. }), "{err}");
            assert!(err.needs_recompute());
            assert!(matches!(
                store.chunk_state(id, index).unwrap(),
                ChunkState::Quarantined { .. }
            ));
            assert!(!file.exists(), "corrupt file left in place");
            assert!(store.read_chunk_into(id, index, &FP, &mut buf).is_err());
            index += 1;
        }
    }
    assert_eq!(
        store
            .counters()
            .corrupt_detected
            .load(std::sync::atomic::Ordering::Relaxed),
        6
    );
    // A chunk of another model is refused before any read.
    let other = Fingerprint([8; 32]);
    let mut buf = vec![0u8; 16];
    assert!(matches!(
        store.read_chunk_into(id, 0, &other, &mut buf),
        Err(StoreError::ForeignModel { .. })
    ));
}

#[test]
fn flipped_bits_found_at_open_with_full_verification() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let id = new_ctx(&store, 32);
    store
        .write_chunk(id, 0, &FP, KvFormat::Int4, 0.1, &chunk_bytes(1, 5000))
        .unwrap();
    store
        .write_chunk(id, 1, &FP, KvFormat::Int4, 0.1, &chunk_bytes(2, 5000))
        .unwrap();
    let path = store.chunk_path(id, 1);
    drop(store);
    let mut bytes = std::fs::read(&path).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x80;
    std::fs::write(&path, &bytes).unwrap();
    let store = Store::open(
        dir.path(),
        StoreOptions {
            verify_on_open: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(store.recovered().len(), 1, "{:?}", store.recovered());
    assert!(matches!(
        store.chunk_state(id, 1).unwrap(),
        ChunkState::Quarantined { .. }
    ));
    assert_eq!(store.read_chunk(id, 0, &FP).unwrap(), chunk_bytes(1, 5000));
}

#[test]
fn recovery_removes_unfinished_writes_and_quarantines_torn_files() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let id = new_ctx(&store, 48);
    for i in 0..3 {
        store
            .write_chunk(id, i, &FP, KvFormat::Int8, 0.0, &chunk_bytes(i, 3000))
            .unwrap();
    }
    let chunks = store.chunk_path(id, 0).parent().unwrap().to_owned();
    drop(store);
    // A temp file of a write that never renamed, a torn chunk, a half-created and a half-deleted context.
    std::fs::write(chunks.join(".tmp-1-99"), b"partial").unwrap();
    let torn = chunks.join("2");
    let len = std::fs::metadata(&torn).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&torn)
        .unwrap()
        .set_len(len - 10)
        .unwrap();
    std::fs::create_dir_all(dir.path().join("staging/9/chunks")).unwrap();
    std::fs::create_dir_all(dir.path().join("trash/4.123/chunks")).unwrap();
    let store = open(dir.path());
    let actions: Vec<_> = store.recovered().iter().map(|r| r.action).collect();
    assert_eq!(
        actions.iter().filter(|a| **a == "removed").count(),
        3,
        "{:?}",
        store.recovered()
    );
    assert_eq!(
        actions.iter().filter(|a| **a == "quarantined").count(),
        1,
        "{:?}",
        store.recovered()
    );
    assert!(!chunks.join(".tmp-1-99").exists());
    assert_eq!(store.read_chunk(id, 1, &FP).unwrap(), chunk_bytes(1, 3000));
    let err = store.read_chunk(id, 2, &FP).unwrap_err();
    assert!(err.needs_recompute(), "{err}");
    assert_eq!(store.list_contexts(), vec![id]);
    // A new context never reuses an id, and a new write clears the quarantine.
    assert!(new_ctx(&store, 1).0 > id.0);
    store
        .write_chunk(id, 2, &FP, KvFormat::Int8, 0.0, &chunk_bytes(2, 3000))
        .unwrap();
    assert_eq!(store.read_chunk(id, 2, &FP).unwrap(), chunk_bytes(2, 3000));
}

#[test]
fn a_chunk_of_another_model_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let id = new_ctx(&store, 16);
    let other = Fingerprint([8; 32]);
    let err = store
        .write_chunk(id, 0, &other, KvFormat::Int8, 0.0, b"abc")
        .unwrap_err();
    assert!(matches!(err, StoreError::ForeignModel { .. }), "{err}");
    store
        .write_chunk(id, 0, &FP, KvFormat::Int8, 0.0, b"abc")
        .unwrap();
    let err = store.read_chunk(id, 0, &other).unwrap_err();
    assert!(matches!(err, StoreError::ForeignModel { .. }), "{err}");
    // A chunk file copied in from a context of another model is refused and quarantined.
    let id2 = store
        .create_context(NewContext {
            owner_uid: 0,
            app: "x".into(),
            fingerprint: other,
            chunk_tokens: 16,
        })
        .unwrap();
    store
        .append_tokens(id2, &(0..16).collect::<Vec<_>>())
        .unwrap();
    store
        .write_chunk(id2, 0, &other, KvFormat::Int8, 0.0, b"xyz")
        .unwrap();
    let path = store.chunk_path(id, 0);
    drop(store);
    let foreign = std::fs::read(dir.path().join(format!("contexts/{}/chunks/0", id2))).unwrap();
    std::fs::write(&path, foreign).unwrap();
    let store = open(dir.path());
    let r = &store.recovered()[0];
    assert!(
        r.reason.contains("context") || r.reason.contains("model"),
        "{r:?}"
    );
    assert!(store.read_chunk(id, 0, &FP).unwrap_err().needs_recompute());
}

#[test]
fn chunks_need_their_tokens_first_and_go_stale_when_tokens_change() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let id = new_ctx(&store, 20);
    let err = store
        .write_chunk(id, 2, &FP, KvFormat::Int8, 0.0, b"late")
        .unwrap_err();
    assert!(matches!(err, StoreError::BeyondTokens { .. }), "{err}");
    store
        .write_chunk(id, 0, &FP, KvFormat::Int8, 0.0, b"zero")
        .unwrap();
    store
        .write_chunk(id, 1, &FP, KvFormat::Int8, 0.0, b"partial")
        .unwrap();
    // Appending keeps the partial chunk valid over the tokens it covered.
    store.append_tokens(id, &[100, 101]).unwrap();
    assert_eq!(store.read_chunk(id, 1, &FP).unwrap(), b"partial");
    match store.chunk_state(id, 1).unwrap() {
        ChunkState::Stored(s) => assert_eq!(s.tokens, 16..20),
        other => panic!("{other:?}"),
    }
    // Replacing token 17 invalidates chunk 1 only.
    let mut t = store.tokens(id).unwrap();
    t[17] = 999;
    store.replace_tokens(id, t.clone()).unwrap();
    assert_eq!(store.read_chunk(id, 0, &FP).unwrap(), b"zero");
    assert!(matches!(
        store.read_chunk(id, 1, &FP),
        Err(StoreError::ChunkMissing { .. })
    ));
    // A crash between the tokens write and the stale chunk's removal: the stale file is dropped at open.
    store
        .write_chunk(id, 1, &FP, KvFormat::Int8, 0.0, b"new")
        .unwrap();
    let stale = std::fs::read(store.chunk_path(id, 1)).unwrap();
    t[18] = 5;
    store.replace_tokens(id, t).unwrap();
    std::fs::write(store.chunk_path(id, 1), stale).unwrap();
    drop(store);
    let store = open(dir.path());
    assert_eq!(store.recovered().len(), 1);
    assert!(store.recovered()[0].reason.contains("stale"));
    assert!(matches!(
        store.read_chunk(id, 1, &FP),
        Err(StoreError::ChunkMissing { .. })
    ));
}

#[test]
fn delete_and_list() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let a = new_ctx(&store, 16);
    let b = new_ctx(&store, 16);
    store
        .write_chunk(a, 0, &FP, KvFormat::Int2, 0.9, b"a")
        .unwrap();
    assert_eq!(store.list_contexts(), vec![a, b]);
    store.delete_context(a).unwrap();
    assert_eq!(store.list_contexts(), vec![b]);
    assert!(matches!(
        store.read_chunk(a, 0, &FP),
        Err(StoreError::NoSuchContext { .. })
    ));
    assert!(matches!(
        store.delete_context(a),
        Err(StoreError::NoSuchContext { .. })
    ));
    drop(store);
    let store = open(dir.path());
    assert_eq!(store.list_contexts(), vec![b]);
    assert_eq!(
        std::fs::read_dir(dir.path().join("trash")).unwrap().count(),
        0
    );
}

#[test]
fn a_creation_killed_before_the_marker_is_finished_at_the_next_open() {
    let dir = tempfile::tempdir().unwrap();
    for sub in ["contexts", "staging"] {
        std::fs::create_dir(dir.path().join(sub)).unwrap();
    }
    std::fs::write(dir.path().join(".tmp-KVFS.123"), b"half").unwrap();
    let store = Store::open(dir.path(), StoreOptions::default()).unwrap();
    assert!(store.list_contexts().is_empty());
    assert!(!dir.path().join(".tmp-KVFS.123").exists());
    // A skeleton folder with something in it is not an interrupted creation.
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("contexts")).unwrap();
    std::fs::write(dir.path().join("contexts").join("precious"), b"x").unwrap();
    let err = Store::open(dir.path(), StoreOptions::default()).unwrap_err();
    assert!(matches!(err, StoreError::NotAStore { .. }), "{err}");
}

#[test]
fn a_non_empty_directory_is_not_taken_over() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("precious"), b"x").unwrap();
    let err = Store::open(dir.path(), StoreOptions::default()).unwrap_err();
    assert!(matches!(err, StoreError::NotAStore { .. }), "{err}");
}

#[test]
fn bad_arguments_get_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let err = store
        .create_context(NewContext {
            owner_uid: 0,
            app: "x".into(),
            fingerprint: FP,
            chunk_tokens: 0,
        })
        .unwrap_err();
    assert!(err.to_string().contains("chunk size"), "{err}");
    let err = store
        .create_context(NewContext {
            owner_uid: 0,
            app: "x".repeat(300),
            fingerprint: FP,
            chunk_tokens: 16,
        })
        .unwrap_err();
    assert!(err.to_string().contains("app name"), "{err}");
    assert!(matches!(
        store.read_chunk(ContextId(77), 0, &FP),
        Err(StoreError::NoSuchContext { .. })
    ));
}

/// Bytes of `path` in the page cache, by fincore (util-linux), which asks mincore(2).
fn resident(path: &Path) -> u64 {
    let out = std::process::Command::new("fincore")
        .args(["--bytes", "--noheadings", "--output", "RES"])
        .arg(path)
        .output()
        .expect("fincore from util-linux");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

/// Every file under `dir`.
fn files_under(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(files_under(&p));
        } else {
            out.push(p);
        }
    }
    out
}

#[test]
fn written_chunks_leave_the_page_cache() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let id = new_ctx(&store, 48);
    let data = chunk_bytes(5, 1 << 20);
    store
        .write_chunk(id, 0, &FP, KvFormat::F16, 0.0, &data)
        .unwrap();
    store
        .write_chunk(id, 1, &FP, KvFormat::Int8, 0.0, &noise(1, 212 << 10))
        .unwrap();
    store
        .write_chunk(id, 2, &FP, KvFormat::Int2, 0.0, &chunk_bytes(6, 76 << 10))
        .unwrap();
    let path = store.chunk_path(id, 0);
    assert_eq!(resident(&path), 0, "written chunk still cached");
    assert_eq!(store.read_chunk(id, 0, &FP).unwrap(), data);
    assert_eq!(resident(&path), 0, "read chunk cached");
    let mut buf = vec![0u8; 1 << 20];
    for i in 0..3 {
        store.read_chunk_into(id, i, &FP, &mut buf).unwrap();
        store.with_chunk_image(id, i, &FP, |_, _| ()).unwrap();
    }
    // No file of the store (markers, meta, tokens, chunks) holds a cached page after the writes
    // and reads, nor after a reopen, which reads every meta, tokens and chunk header.
    drop(store);
    let store = open(dir.path());
    store.read_chunk_into(id, 2, &FP, &mut buf).unwrap();
    let files = files_under(dir.path());
    assert!(files.len() >= 6, "{files:?}");
    for f in &files {
        assert_eq!(resident(f), 0, "{} cached", f.display());
    }
    // The control: a plain read does fill the cache, so fincore sees caching when there is some.
    let _ = std::fs::read(&path).unwrap();
    assert!(resident(&path) > 0);
}

#[test]
fn info_and_stats_describe_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let id = new_ctx(&store, 40);
    store
        .write_chunk(id, 0, &FP, KvFormat::Int4, 0.25, &chunk_bytes(0, 1000))
        .unwrap();
    let info = store.render_info(id).unwrap();
    for want in [
        "tokens       40",
        "1 stored, 2 missing",
        "int4 1",
        "0.2500",
        "0..16",
        "32..40",
    ] {
        assert!(info.contains(want), "{want:?} not in\n{info}");
    }
    let stats = store.render_stats();
    assert!(stats.contains("contexts     1"), "{stats}");
    assert!(stats.contains("writes       1"), "{stats}");
    assert_eq!(
        store.render_text(id).unwrap().split_whitespace().count(),
        40
    );
    store.set_decoder(std::sync::Arc::new(|t: &[u32]| {
        format!("{} tokens of text", t.len())
    }));
    assert_eq!(store.render_text(id).unwrap(), "40 tokens of text");
}

#[test]
fn a_read_only_open_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let err = Store::open(
        &dir.path().join("none"),
        StoreOptions {
            read_only: true,
            ..Default::default()
        },
    )
    .unwrap_err();
    assert!(matches!(err, StoreError::NotAStore { .. }), "{err}");
    assert!(!dir.path().join("none").exists());
    let store = open(dir.path());
    let id = new_ctx(&store, 32);
    store
        .write_chunk(id, 0, &FP, KvFormat::Int8, 0.0, &chunk_bytes(0, 5000))
        .unwrap();
    store
        .write_chunk(id, 1, &FP, KvFormat::Int8, 0.0, &chunk_bytes(1, 5000))
        .unwrap();
    let chunks = store.chunk_path(id, 0).parent().unwrap().to_owned();
    drop(store);
    // An in-flight write of a running service, and a corrupt chunk.
    std::fs::write(chunks.join(".tmp-0-77"), b"in flight").unwrap();
    let mut b = std::fs::read(chunks.join("1")).unwrap();
    b[150] ^= 2;
    std::fs::write(chunks.join("1"), &b).unwrap();
    let listing = |d: &Path| {
        let mut v: Vec<_> = walk(d);
        v.sort();
        v
    };
    fn walk(d: &Path) -> Vec<(std::path::PathBuf, Vec<u8>)> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                out.extend(walk(&p));
            } else {
                out.push((p.clone(), std::fs::read(&p).unwrap()));
            }
        }
        out
    }
    let before = listing(dir.path());
    let ro = Store::open(
        dir.path(),
        StoreOptions {
            read_only: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(ro.read_chunk(id, 0, &FP).unwrap(), chunk_bytes(0, 5000));
    assert!(ro.read_chunk(id, 1, &FP).unwrap_err().needs_recompute());
    let err = ro
        .write_chunk(id, 0, &FP, KvFormat::Int8, 0.0, b"x")
        .unwrap_err();
    assert!(matches!(err, StoreError::ReadOnly { .. }), "{err}");
    assert!(matches!(
        ro.append_tokens(id, &[1]),
        Err(StoreError::ReadOnly { .. })
    ));
    assert!(matches!(
        ro.delete_context(id),
        Err(StoreError::ReadOnly { .. })
    ));
    assert!(ro.render_info(id).unwrap().contains("1 quarantined"));
    drop(ro);
    assert!(
        listing(dir.path()) == before,
        "a read-only open changed the store"
    );
}

#[test]
fn one_writer_per_store_and_readers_alongside() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let id = new_ctx(&store, 16);
    store
        .write_chunk(id, 0, &FP, KvFormat::Int8, 0.0, b"held")
        .unwrap();
    let err = Store::open(dir.path(), StoreOptions::default()).unwrap_err();
    assert!(matches!(err, StoreError::Locked { .. }), "{err}");
    let ro = Store::open(
        dir.path(),
        StoreOptions {
            read_only: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(ro.read_chunk(id, 0, &FP).unwrap(), b"held");
    drop(store);
    assert_eq!(open(dir.path()).read_chunk(id, 0, &FP).unwrap(), b"held");
}
