//! The store through its Rust API: round trips, persistence, recovery, corruption and model checks.

use std::os::unix::fs::FileExt;
use std::path::Path;

use kvfs::format::{ChunkHeader, HEADER_LEN};
use kvfs::{
    Codec, ContextId, Fingerprint, HEADER_PAGE, KvFormat, NewContext, Store, StoreError,
    StoreOptions, StoreState, slot_offset,
};
use strum::VariantArray;

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

/// `len` bytes of the file at `path` from `at` (zeros past its end, as in a hole).
fn read_at(path: &Path, at: u64, len: usize) -> Vec<u8> {
    let f = std::fs::File::open(path).unwrap();
    let mut b = vec![0u8; len];
    let mut done = 0;
    while done < len {
        match f.read_at(&mut b[done..], at + done as u64).unwrap() {
            0 => break,
            n => done += n,
        }
    }
    b
}

/// Overwrites bytes of the file at `path` from `at`, as a failing disk or a stray writer would.
fn write_at(path: &Path, at: u64, bytes: &[u8]) {
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(bytes, at).unwrap();
}

/// Flips the bits of `mask` in the byte at `at` of the file at `path`.
fn flip(path: &Path, at: u64, mask: u8) {
    let mut b = read_at(path, at, 1);
    b[0] ^= mask;
    write_at(path, at, &b);
}

fn zeros(b: &[u8]) -> bool {
    b.iter().all(|&b| b == 0)
}

/// Where the first allocated byte of the file at `path` at or after `from` is (`SEEK_DATA`).
fn next_data(path: &Path, from: u64) -> Option<u64> {
    let f = std::fs::File::open(path).unwrap();
    match nix::unistd::lseek(&f, from as libc::off_t, nix::unistd::Whence::SeekData) {
        Ok(at) => Some(at as u64),
        Err(nix::errno::Errno::ENXIO) => None,
        Err(e) => panic!("SEEK_DATA {}: {e}", path.display()),
    }
}

/// The files in `quarantine/` whose names start with `prefix`.
fn quarantined_as(dir: &Path, prefix: &str) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(dir.join("quarantine"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with(prefix))
        .collect()
}

#[test]
fn every_format_round_trips_and_survives_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let id = new_ctx(&store, 16 * KvFormat::VARIANTS.len());
    for (i, f) in KvFormat::VARIANTS.iter().copied().enumerate() {
        let data = chunk_bytes(i as u32, 4096 << i);
        let meta = store.write_chunk(id, i as u32, &FP, f, 0.5, &data).unwrap();
        assert_eq!(meta.format, f);
        assert_eq!(store.read_chunk(id, i as u32, &FP).unwrap(), data);
    }
    drop(store);
    let store = open(dir.path());
    assert!(store.recovered().is_empty(), "{:?}", store.recovered());
    for (i, f) in KvFormat::VARIANTS.iter().copied().enumerate() {
        assert_eq!(
            store.read_chunk(id, i as u32, &FP).unwrap(),
            chunk_bytes(i as u32, 4096 << i)
        );
        match store.chunk_state(id, i as u32).unwrap() {
            StoreState::Stored(s) => {
                assert_eq!(s.format, f);
                assert_eq!(s.density, 0.5);
                assert_eq!(s.tokens, (i as u32 * 16)..(i as u32 * 16 + 16));
            }
            other => panic!("chunk {i} is {other:?}"),
        }
    }
    let n = 16 * KvFormat::VARIANTS.len() as u32;
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
    let stored_len = store
        .write_chunk(id, 0, &FP, KvFormat::Int8, 0.1, &data)
        .unwrap()
        .stored_len as u64;
    let page = HEADER_PAGE as u64;
    // Flip one bit at a spread of offsets into the chunk's slot: header fields, header crc,
    // payload start, middle and end.
    let offsets = [
        0,
        9,
        13,
        20,
        40,
        60,
        70,
        97,
        page,
        page + 1,
        page + stored_len / 2,
        page + stored_len - 1,
    ];
    let file = store.data_path(id);
    for (n, at) in offsets.into_iter().enumerate() {
        let index = (n % 8) as u32;
        let written = store
            .write_chunk(id, index, &FP, KvFormat::Int8, 0.1, &data)
            .unwrap();
        assert_eq!(written.stored_len as u64, stored_len);
        let slot = store.chunk_offset(id, index).unwrap();
        assert_eq!(slot, slot_offset(index, written.copy));
        let len = HEADER_PAGE + stored_len as usize;
        flip(&file, slot + at, 0x04);
        let corrupted = read_at(&file, slot, len);
        let err = store.read_chunk(id, index, &FP).unwrap_err();
        assert!(
            matches!(err, StoreError::Corrupt { .. }),
            "offset {at}: {err}"
        );
        assert!(err.needs_recompute());
        assert!(matches!(
            store.chunk_state(id, index).unwrap(),
            StoreState::Quarantined { .. }
        ));
        assert_eq!(store.chunk_offset(id, index), None);
        assert!(
            zeros(&read_at(&file, slot, len)),
            "offset {at}: corrupt slot left in place"
        );
        // The slot's bytes, as they were found, are kept in quarantine/.
        let kept = quarantined_as(dir.path(), &format!("{id}-{index}.{}.", written.copy));
        assert!(
            kept.iter().any(|p| std::fs::read(p).unwrap() == corrupted),
            "offset {at}: {kept:?}"
        );
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
    // The slot as the data file holds it (what the mount's `kv` file shows): the header page
    // (the header, then zeros) and the stored payload, raw or zstd, which gives the plain bytes.
    let (seen, slot) = store
        .with_slot(id, index, &FP, |m, slot| (m.clone(), slot.to_vec()))
        .unwrap();
    assert_eq!(meta, seen);
    assert_eq!(slot.len(), HEADER_PAGE + meta.stored_len as usize);
    let h = ChunkHeader::decode(&slot).unwrap();
    assert_eq!(
        (h.context, h.index, h.codec, h.generation),
        (id.0, index, meta.codec, meta.generation)
    );
    assert_eq!(h.raw_len as usize, data.len());
    assert!(zeros(&slot[HEADER_LEN..HEADER_PAGE]));
    let payload = &slot[HEADER_PAGE..];
    h.check_payload(payload).unwrap();
    match h.codec {
        Codec::Raw => assert_eq!(payload, data),
        Codec::Zstd => assert_eq!(zstd::bulk::decompress(payload, data.len()).unwrap(), data),
    }
    let at = store.chunk_offset(id, index).unwrap();
    assert_eq!(at, slot_offset(index, meta.copy));
    assert!(read_at(&store.data_path(id), at, slot.len()) == slot);
}

#[test]
fn reads_into_a_caller_buffer_equal_read_chunk_for_every_format_and_codec() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let id = new_ctx(&store, 16 * 4 * KvFormat::VARIANTS.len());
    let mut index = 0;
    for &f in KvFormat::VARIANTS {
        // Skewed bytes compress (zstd), noise does not (raw); sizes around the O_DIRECT alignment
        // (a payload of one whole page, and slots that end mid-page).
        for (data, codec) in [
            (chunk_bytes(index, 212 << 10), Codec::Zstd),
            (noise(index as u64, 120 << 10), Codec::Raw),
            (noise(7 + index as u64, HEADER_PAGE), Codec::Raw),
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
            StoreState::Stored(_)
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
            let written = store
                .write_chunk(id, index, &FP, KvFormat::Int4, 0.0, data)
                .unwrap();
            let file = store.data_path(id);
            let slot = store.chunk_offset(id, index).unwrap();
            let len = HEADER_PAGE + written.stored_len as usize;
            flip(
                &file,
                slot + (HEADER_PAGE + written.stored_len as usize / 3) as u64,
                0x10,
            );
            let mut buf = vec![0u8; data.len()];
            let mut served = false;
            let err = match path {
                0 => store.read_chunk_into(id, index, &FP, &mut buf).unwrap_err(),
                1 => store
                    .read_chunk_into_vec(id, index, &FP, &mut buf)
                    .unwrap_err(),
                _ => store
                    .with_slot(id, index, &FP, |_, _| served = true)
                    .unwrap_err(),
            };
            assert!(!served, "a corrupt slot was handed out");
            assert!(matches!(err, StoreError::Corrupt { .. }), "{err}");
            assert!(err.needs_recompute());
            assert!(matches!(
                store.chunk_state(id, index).unwrap(),
                StoreState::Quarantined { .. }
            ));
            assert!(
                zeros(&read_at(&file, slot, len)),
                "corrupt slot left in place"
            );
            assert_eq!(
                quarantined_as(dir.path(), &format!("{id}-{index}.{}.", written.copy)).len(),
                1
            );
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
    let written = store
        .write_chunk(id, 1, &FP, KvFormat::Int4, 0.1, &chunk_bytes(2, 5000))
        .unwrap();
    let path = store.data_path(id);
    let slot = store.chunk_offset(id, 1).unwrap();
    drop(store);
    // The payload's last byte: only a full check of the payload finds it.
    let len = HEADER_PAGE + written.stored_len as usize;
    flip(&path, slot + len as u64 - 1, 0x80);
    let store = Store::open(
        dir.path(),
        StoreOptions {
            verify_on_open: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(store.recovered().len(), 1, "{:?}", store.recovered());
    assert_eq!(store.recovered()[0].action, "quarantined");
    assert!(matches!(
        store.chunk_state(id, 1).unwrap(),
        StoreState::Quarantined { .. }
    ));
    assert!(
        zeros(&read_at(&path, slot, len)),
        "corrupt slot left in place"
    );
    assert_eq!(
        quarantined_as(dir.path(), &format!("{id}-1.{}.", written.copy)).len(),
        1
    );
    assert!(store.read_chunk(id, 1, &FP).unwrap_err().needs_recompute());
    assert_eq!(store.read_chunk(id, 0, &FP).unwrap(), chunk_bytes(1, 5000));
}

#[test]
fn recovery_removes_unfinished_writes_and_quarantines_torn_files() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let id = new_ctx(&store, 48);
    let mut written = Vec::new();
    for i in 0..3 {
        let w = store
            .write_chunk(id, i, &FP, KvFormat::Int8, 0.0, &chunk_bytes(i, 3000))
            .unwrap();
        assert_eq!(w.copy, 0);
        written.push(w);
    }
    let data = store.data_path(id);
    drop(store);
    let page = HEADER_PAGE as u64;
    // A rewrite of chunk 1 cut short before its header: its payload in the free slot, no header.
    let unfinished = slot_offset(1, 1);
    write_at(&data, unfinished + page, &chunk_bytes(11, 3000));
    // Chunk 2's header page torn into garbage: found at open.
    write_at(&data, slot_offset(2, 0), &noise(5, HEADER_LEN));
    // Chunk 0's payload without its tail (header whole): found at read.
    let tail = slot_offset(0, 0) + page + written[0].stored_len as u64 - 10;
    assert!(!zeros(&read_at(&data, tail, 10)));
    write_at(&data, tail, &[0; 10]);
    // A half-created and a half-deleted context.
    std::fs::create_dir_all(dir.path().join("staging/9")).unwrap();
    std::fs::write(dir.path().join("staging/9/data"), b"").unwrap();
    std::fs::create_dir_all(dir.path().join("trash/4.123")).unwrap();
    std::fs::write(dir.path().join("trash/4.123/data"), b"x").unwrap();
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
    let slot_of = |action: &str| {
        store
            .recovered()
            .iter()
            .filter(|r| r.action == action && r.path.starts_with(&data))
            .map(|r| r.path.file_name().unwrap().to_string_lossy().into_owned())
            .collect::<Vec<_>>()
    };
    assert_eq!(slot_of("removed"), ["1.1"], "{:?}", store.recovered());
    assert_eq!(slot_of("quarantined"), ["2.0"], "{:?}", store.recovered());
    assert!(!dir.path().join("staging/9").exists());
    assert!(!dir.path().join("trash/4.123").exists());
    // The unfinished copy is freed; the chunk's whole copy stays where it was, readable.
    assert!(zeros(&read_at(&data, unfinished, HEADER_PAGE + 3000)));
    assert_eq!(store.chunk_offset(id, 1), Some(slot_offset(1, 0)));
    assert_eq!(store.read_chunk(id, 1, &FP).unwrap(), chunk_bytes(1, 3000));
    // The torn header's slot is in quarantine/ and freed.
    assert!(matches!(
        store.chunk_state(id, 2).unwrap(),
        StoreState::Quarantined { .. }
    ));
    assert_eq!(quarantined_as(dir.path(), &format!("{id}-2.0.")).len(), 1);
    assert!(zeros(&read_at(&data, slot_offset(2, 0), HEADER_PAGE)));
    let err = store.read_chunk(id, 2, &FP).unwrap_err();
    assert!(err.needs_recompute(), "{err}");
    // The torn payload is caught by its crc at the first read, and quarantined then.
    let err = store.read_chunk(id, 0, &FP).unwrap_err();
    assert!(matches!(err, StoreError::Corrupt { .. }), "{err}");
    assert_eq!(quarantined_as(dir.path(), &format!("{id}-0.0.")).len(), 1);
    assert!(zeros(&read_at(
        &data,
        slot_offset(0, 0),
        HEADER_PAGE + written[0].stored_len as usize
    )));
    assert_eq!(store.list_contexts(), vec![id]);
    // A new context never reuses an id, and a new write clears the quarantine.
    assert!(new_ctx(&store, 1).0 > id.0);
    for i in [0, 2] {
        store
            .write_chunk(id, i, &FP, KvFormat::Int8, 0.0, &chunk_bytes(i, 3000))
            .unwrap();
        assert_eq!(store.read_chunk(id, i, &FP).unwrap(), chunk_bytes(i, 3000));
    }
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
    // A slot copied in from a context of another model is refused and quarantined.
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
    let theirs = store
        .write_chunk(id2, 0, &other, KvFormat::Int8, 0.0, b"xyz")
        .unwrap();
    let (ours_path, ours_at) = (store.data_path(id), store.chunk_offset(id, 0).unwrap());
    let (theirs_path, theirs_at) = (store.data_path(id2), store.chunk_offset(id2, 0).unwrap());
    drop(store);
    let foreign = read_at(
        &theirs_path,
        theirs_at,
        HEADER_PAGE + theirs.stored_len as usize,
    );
    write_at(&ours_path, ours_at, &foreign);
    let store = open(dir.path());
    assert_eq!(store.recovered().len(), 1, "{:?}", store.recovered());
    let r = &store.recovered()[0];
    assert_eq!(r.action, "quarantined", "{r:?}");
    assert!(
        r.reason.contains("context") || r.reason.contains("model"),
        "{r:?}"
    );
    assert!(store.read_chunk(id, 0, &FP).unwrap_err().needs_recompute());
    assert!(zeros(&read_at(&ours_path, ours_at, foreign.len())));
    // The other context's own copy is untouched.
    assert_eq!(store.read_chunk(id2, 0, &other).unwrap(), b"xyz");
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
        StoreState::Stored(s) => assert_eq!(s.tokens, 16..20),
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
    // A crash between the tokens write and the stale chunk's removal: the stale slot is dropped at open.
    let written = store
        .write_chunk(id, 1, &FP, KvFormat::Int8, 0.0, b"new")
        .unwrap();
    let data = store.data_path(id);
    let at = store.chunk_offset(id, 1).unwrap();
    let stale = read_at(&data, at, HEADER_PAGE + written.stored_len as usize);
    t[18] = 5;
    store.replace_tokens(id, t).unwrap();
    assert_eq!(store.chunk_offset(id, 1), None);
    assert!(zeros(&read_at(&data, at, stale.len())));
    write_at(&data, at, &stale);
    drop(store);
    let store = open(dir.path());
    assert_eq!(store.recovered().len(), 1, "{:?}", store.recovered());
    assert_eq!(store.recovered()[0].action, "removed");
    assert!(store.recovered()[0].reason.contains("stale"));
    assert!(matches!(
        store.read_chunk(id, 1, &FP),
        Err(StoreError::ChunkMissing { .. })
    ));
    assert!(zeros(&read_at(&data, at, stale.len())));
    assert_eq!(store.read_chunk(id, 0, &FP).unwrap(), b"zero");
}

#[test]
fn a_rewrite_keeps_the_old_copy_until_the_new_one_is_whole() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let id = new_ctx(&store, 16);
    let data = store.data_path(id);
    let (v1, v2, v3) = (
        chunk_bytes(1, 40000),
        noise(2, 30000),
        chunk_bytes(3, 20000),
    );
    let slot_bytes = |s: &kvfs::StoredChunk| {
        read_at(
            &data,
            slot_offset(0, s.copy),
            HEADER_PAGE + s.stored_len as usize,
        )
    };
    let first = store
        .write_chunk(id, 0, &FP, KvFormat::Int8, 0.0, &v1)
        .unwrap();
    assert_eq!(first.copy, 0);
    assert_eq!(store.chunk_offset(id, 0), Some(slot_offset(0, 0)));
    let first_slot = slot_bytes(&first);
    // The rewrite goes to the other slot; the first is freed once the second is whole.
    let second = store
        .write_chunk(id, 0, &FP, KvFormat::Int8, 0.0, &v2)
        .unwrap();
    assert_eq!(second.copy, 1);
    assert!(second.generation > first.generation);
    assert_eq!(store.chunk_offset(id, 0), Some(slot_offset(0, 1)));
    assert_eq!(store.read_chunk(id, 0, &FP).unwrap(), v2);
    assert!(
        zeros(&read_at(&data, slot_offset(0, 0), first_slot.len())),
        "the replaced copy was not freed"
    );
    assert_eq!(next_data(&data, 0), Some(slot_offset(0, 1)));
    let second_slot = slot_bytes(&second);

    // A crash after the second version's header, before the first's slot was freed: both copies
    // are on disk, and the newer one wins.
    drop(store);
    write_at(&data, slot_offset(0, 0), &first_slot);
    let store = open(dir.path());
    let rec = store.recovered();
    assert_eq!(rec.len(), 1, "{rec:?}");
    assert_eq!(rec[0].action, "removed", "{rec:?}");
    assert!(rec[0].reason.contains("older"), "{rec:?}");
    assert!(rec[0].path.ends_with("0.0"), "{rec:?}");
    assert_eq!(
        store.chunk_state(id, 0).unwrap(),
        StoreState::Stored(second.clone())
    );
    assert_eq!(store.read_chunk(id, 0, &FP).unwrap(), v2);
    assert!(zeros(&read_at(&data, slot_offset(0, 0), first_slot.len())));

    // A crash in the next rewrite after its payload, before its header: the payload is in the
    // free slot with no header, and the current copy is still served.
    drop(store);
    write_at(&data, slot_offset(0, 0) + HEADER_PAGE as u64, &v3);
    let store = open(dir.path());
    let rec = store.recovered();
    assert_eq!(rec.len(), 1, "{rec:?}");
    assert_eq!(rec[0].action, "removed", "{rec:?}");
    assert!(rec[0].path.ends_with("0.0"), "{rec:?}");
    assert_eq!(
        store.chunk_state(id, 0).unwrap(),
        StoreState::Stored(second.clone())
    );
    assert_eq!(store.read_chunk(id, 0, &FP).unwrap(), v2);
    assert!(zeros(&read_at(
        &data,
        slot_offset(0, 0),
        HEADER_PAGE + v3.len()
    )));

    // Generations keep growing across opens: the next rewrite (back in slot 0) is the newest,
    // also when the older copy it replaced is found again in slot 1.
    let third = store
        .write_chunk(id, 0, &FP, KvFormat::Int8, 0.0, &v3)
        .unwrap();
    assert_eq!(third.copy, 0);
    assert!(third.generation > second.generation);
    assert_eq!(store.read_chunk(id, 0, &FP).unwrap(), v3);
    assert!(zeros(&read_at(&data, slot_offset(0, 1), second_slot.len())));
    drop(store);
    write_at(&data, slot_offset(0, 1), &second_slot);
    let store = open(dir.path());
    let rec = store.recovered();
    assert_eq!(rec.len(), 1, "{rec:?}");
    assert_eq!(rec[0].action, "removed", "{rec:?}");
    assert!(rec[0].path.ends_with("0.1"), "{rec:?}");
    assert_eq!(store.chunk_state(id, 0).unwrap(), StoreState::Stored(third));
    assert_eq!(store.read_chunk(id, 0, &FP).unwrap(), v3);
    assert!(zeros(&read_at(&data, slot_offset(0, 1), second_slot.len())));
    drop(store);
    let store = open(dir.path());
    assert!(store.recovered().is_empty(), "{:?}", store.recovered());
    assert_eq!(store.read_chunk(id, 0, &FP).unwrap(), v3);
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
    let path = store.data_path(id);
    assert_eq!(resident(&path), 0, "written chunks still cached");
    // A rewrite too (to the chunk's other slot, freeing the first).
    store
        .write_chunk(id, 0, &FP, KvFormat::F16, 0.0, &data)
        .unwrap();
    assert_eq!(resident(&path), 0, "rewritten chunk still cached");
    assert_eq!(store.read_chunk(id, 0, &FP).unwrap(), data);
    assert_eq!(resident(&path), 0, "read chunk cached");
    let mut buf = vec![0u8; 1 << 20];
    for i in 0..3 {
        store.read_chunk_into(id, i, &FP, &mut buf).unwrap();
        store.with_slot(id, i, &FP, |_, _| ()).unwrap();
    }
    let slot = store.chunk_offset(id, 0).unwrap();
    // No file of the store (marker, meta, tokens, data) holds a cached page after the writes and
    // reads, nor after a reopen, which reads every meta, tokens and chunk header.
    drop(store);
    let store = open(dir.path());
    store.read_chunk_into(id, 2, &FP, &mut buf).unwrap();
    let files = files_under(dir.path());
    assert!(files.len() >= 4, "{files:?}");
    for want in ["KVFS", "meta", "tokens", "data"] {
        assert!(
            files.iter().any(|f| f.file_name().unwrap() == want),
            "no {want} in {files:?}"
        );
    }
    for f in &files {
        assert_eq!(resident(f), 0, "{} cached", f.display());
    }
    // The control: a plain read does fill the cache, so fincore sees caching when there is some.
    let _ = read_at(&path, slot, HEADER_PAGE + (64 << 10));
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
    // No decoder: `text` says so and where the ids are; `tokens` holds them.
    let text = store.render_text(id).unwrap();
    assert!(
        text.contains("no tokenizer is loaded") && text.contains("`tokens`"),
        "{text}"
    );
    assert!(info.contains("no tokenizer is loaded"), "{info}");
    let ids = store.render_tokens(id).unwrap();
    let want: Vec<String> = store
        .tokens(id)
        .unwrap()
        .iter()
        .map(u32::to_string)
        .collect();
    assert_eq!(ids, format!("{}\n", want.join(" ")));
    // Another model's decoder is never used on this context: `text` and `info` say why.
    let other = kvfs::Fingerprint([FP.0[0] ^ 1; 32]);
    let decoder: kvfs::Decoder =
        std::sync::Arc::new(|t: &[u32]| format!("{} tokens of text", t.len()));
    store.set_decoder(other, decoder.clone());
    let text = store.render_text(id).unwrap();
    assert!(
        !text.contains("tokens of text") && text.contains(&other.to_string()),
        "{text}"
    );
    let info = store.render_info(id).unwrap();
    assert!(
        info.lines()
            .any(|l| l.starts_with("note") && l.contains(&other.to_string())),
        "{info}"
    );
    // This model's decoder decodes it.
    store.set_decoder(FP, decoder);
    assert_eq!(store.render_text(id).unwrap(), "40 tokens of text");
    assert!(
        store
            .render_info(id)
            .unwrap()
            .contains("decoded by this model's tokenizer")
    );
}

/// `utc` against the system's `date`, at the epoch, a leap day, the end of a century and now.
#[test]
fn utc_agrees_with_date() {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    for secs in [0, 951_868_799, 951_868_800, 4_102_444_799, now] {
        let out = std::process::Command::new("date")
            .args(["-u", "+%Y-%m-%dT%H:%M:%SZ", "-d"])
            .arg(format!("@{secs}"))
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        assert_eq!(
            kvfs::utc(secs),
            String::from_utf8(out.stdout).unwrap().trim(),
            "{secs}"
        );
    }
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
    let data = store.data_path(id);
    assert_eq!(store.chunk_offset(id, 0), Some(slot_offset(0, 0)));
    let one = store.chunk_offset(id, 1).unwrap();
    drop(store);
    // An in-flight rewrite of chunk 0 by a running service (its payload, no header yet), and a
    // corrupt chunk 1.
    write_at(&data, slot_offset(0, 1) + HEADER_PAGE as u64, b"in flight");
    flip(&data, one + HEADER_PAGE as u64 + 46, 2);
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
    // Nothing was freed either: the in-flight slot and the corrupt one still hold their blocks.
    assert_eq!(next_data(&data, 0), Some(slot_offset(0, 0)));
    assert_eq!(
        next_data(&data, slot_offset(0, 1)),
        Some(slot_offset(0, 1) + HEADER_PAGE as u64)
    );
    assert_eq!(next_data(&data, one), Some(one));
    assert_eq!(
        std::fs::read_dir(dir.path().join("quarantine"))
            .unwrap()
            .count(),
        0
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

#[test]
fn raw_chunks_are_read_straight_into_an_aligned_buffer_and_bad_ones_still_quarantined() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let id = new_ctx(&store, 16 * 4);
    let data: Vec<Vec<u8>> = (0..4).map(|i| noise(i, 20000)).collect();
    for (i, d) in data.iter().enumerate() {
        let s = store
            .write_chunk(id, i as u32, &FP, KvFormat::Int8, 0.1, d)
            .unwrap();
        assert_eq!((s.codec, s.stored_len), (Codec::Raw, 20000));
    }
    let mut buf = kvfs::io::AlignedBuf::new(64 << 10);
    // Aligned and rounded up to whole pages: the kernel reads the payload into it (where the
    // filesystem takes O_DIRECT); unaligned or exactly the chunk's length: through the store's
    // own buffer. The same bytes either way.
    for (i, d) in data.iter().enumerate().take(3) {
        let i = i as u32;
        let meta = store.read_chunk_into(id, i, &FP, buf.get(20480)).unwrap();
        assert_eq!(meta.raw_len, 20000);
        assert_eq!(&buf[..20000], &d[..]);
        buf.get(64 << 10).fill(0);
        store
            .read_chunk_into(id, i, &FP, &mut buf[1..20001])
            .unwrap();
        assert_eq!(&buf[1..20001], &d[..]);
        store.read_chunk_into(id, i, &FP, buf.get(20000)).unwrap();
        assert_eq!(&buf[..20000], &d[..]);
    }
    // A bit flipped in a payload is found on the direct read as on the other, and the slot is
    // quarantined whole, as it was found.
    let file = store.data_path(id);
    let slot = store.chunk_offset(id, 3).unwrap();
    let copy = (slot / slot_offset(0, 1)) % 2;
    flip(&file, slot + HEADER_PAGE as u64 + 12345, 0x10);
    let corrupted = read_at(&file, slot, HEADER_PAGE + 20000);
    let err = store
        .read_chunk_into(id, 3, &FP, buf.get(20480))
        .unwrap_err();
    assert!(matches!(err, StoreError::Corrupt { .. }), "{err}");
    assert!(matches!(
        store.chunk_state(id, 3).unwrap(),
        StoreState::Quarantined { .. }
    ));
    let kept = quarantined_as(dir.path(), &format!("{id}-3.{copy}."));
    assert!(
        kept.iter().any(|p| std::fs::read(p).unwrap() == corrupted),
        "{kept:?}"
    );
    // The others are untouched.
    store.read_chunk_into(id, 2, &FP, buf.get(20480)).unwrap();
    assert_eq!(&buf[..20000], &data[2][..]);
}

#[test]
fn a_transcript_is_kept_beside_the_tokens_and_a_rebuild_swaps_the_context_whole() {
    let dir = tempfile::tempdir().unwrap();
    let id = {
        let store = open(dir.path());
        let id = new_ctx(&store, 40);
        assert_eq!(store.transcript(id).unwrap(), None);
        store.write_transcript(id, b"first").unwrap();
        store.write_transcript(id, b"second").unwrap();
        store
            .write_chunk(id, 0, &FP, KvFormat::Int8, 0.5, &chunk_bytes(1, 4096))
            .unwrap();
        id
    };
    let store = open(dir.path());
    assert_eq!(
        store.transcript(id).unwrap().as_deref(),
        Some(&b"second"[..])
    );
    assert!(matches!(
        store.context(id).unwrap().chunks[0].state,
        StoreState::Stored(_)
    ));
    // Rebuilt under another model: same id, new meta, tokens and transcript, no chunk left.
    let other = Fingerprint([9; 32]);
    let new = NewContext {
        owner_uid: 1000,
        app: "chat".into(),
        fingerprint: other,
        chunk_tokens: 16,
    };
    store
        .rebuild_context(id, new, &[5, 6, 7], Some(b"rebuilt"))
        .unwrap();
    let check = |store: &Store| {
        assert_eq!(store.fingerprint(id).unwrap(), other);
        assert_eq!(store.tokens(id).unwrap(), [5, 6, 7]);
        assert_eq!(
            store.transcript(id).unwrap().as_deref(),
            Some(&b"rebuilt"[..])
        );
        assert!(
            store
                .context(id)
                .unwrap()
                .chunks
                .iter()
                .all(|c| !matches!(c.state, StoreState::Stored(_)))
        );
        assert_eq!(store.list_contexts(), vec![id]);
    };
    check(&store);
    drop(store);
    check(&open(dir.path()));
    let staging = std::fs::read_dir(dir.path().join("staging"))
        .unwrap()
        .count();
    assert_eq!(staging, 0, "the replaced context is gone");
}
