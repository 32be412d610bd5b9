//! Shared prefixes: contexts that borrow their first chunks from a shared-prefix context, the
//! checks on a link, the prefix removed with its last referrer, and recovery of every crash point
//! of making one (docs/kvfs.md, "Shared prefixes").

use kvfs::{
    ContextId, Fingerprint, KvFormat, Link, NewContext, Seed, Store, StoreError, StoreOptions,
    StoreState,
};

const FP: Fingerprint = Fingerprint([7; 32]);
const T: usize = 16;

fn new(uid: u32) -> NewContext {
    NewContext {
        owner_uid: uid,
        app: "chat".into(),
        fingerprint: FP,
        chunk_tokens: T as u32,
    }
}

fn tokens(n: usize) -> Vec<u32> {
    (0..n as u32).map(|t| t * 7 + 1).collect()
}

fn open(dir: &std::path::Path) -> Store {
    Store::open(dir, StoreOptions::default()).unwrap()
}

fn bytes(index: u32) -> Vec<u8> {
    (0..3000).map(|i| (i as u32 * 31 + index) as u8).collect()
}

/// A shared prefix of `chunks` chunks, every chunk written.
fn prefix(store: &Store, uid: u32, chunks: u32) -> ContextId {
    let toks = tokens(chunks as usize * T);
    let seed = Seed {
        tokens: &toks,
        shared: true,
        ..Seed::default()
    };
    let id = store.create_context_with(new(uid), seed).unwrap();
    let all: Vec<Vec<u8>> = (0..chunks).map(bytes).collect();
    let writes: Vec<_> = (0..chunks)
        .map(|i| (i, KvFormat::Int8, 0.5, all[i as usize].as_slice()))
        .collect();
    store.write_new_chunks(id, &FP, &writes).unwrap();
    // Written once: a second write of them is refused, and changes nothing.
    let err = store.write_new_chunks(id, &FP, &writes[..1]);
    assert!(matches!(err, Err(StoreError::Invalid { .. })), "{err:?}");
    id
}

/// A context of `n` tokens (the prefix's first ones) linked to `base` for `chunks` chunks.
fn linked(store: &Store, uid: u32, base: ContextId, chunks: u32, n: usize) -> ContextId {
    let toks = tokens(n);
    let seed = Seed {
        tokens: &toks,
        link: Some(Link {
            base: base.0,
            chunks,
        }),
        ..Seed::default()
    };
    store.create_context_with(new(uid), seed).unwrap()
}

#[test]
fn contexts_share_one_stored_copy_until_the_last_goes() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let base = prefix(&store, 1000, 4);
    let a = linked(&store, 1000, base, 4, 5 * T + 3);
    let b = linked(&store, 1000, base, 3, 4 * T);
    assert_eq!(store.referrers(base), 2);
    assert!(store.is_shared(base).unwrap() && !store.is_shared(a).unwrap());
    assert_eq!(store.link(b).unwrap().unwrap().chunks, 3);
    // People inspecting the store see who borrows from whom.
    let info = store.render_info(base).unwrap();
    assert!(info.contains("2 context(s) borrow"), "{info}");
    let info = store.render_info(b).unwrap();
    assert!(
        info.contains(&format!("chunks 0..3 from shared prefix {base}")),
        "{info}"
    );
    // Borrowed chunks are read from the prefix and never written to the borrower.
    assert_eq!(store.read_chunk(base, 2, &FP).unwrap(), bytes(2));
    let err = store.write_chunk(a, 1, &FP, KvFormat::Int8, 0.5, &bytes(9));
    assert!(matches!(err, Err(StoreError::Invalid { .. })), "{err:?}");
    store
        .write_chunk(a, 4, &FP, KvFormat::Int8, 0.5, &bytes(4))
        .unwrap();
    // A prefix still used is not deleted; it goes with its last referrer.
    let err = store.delete_context(base);
    assert!(
        matches!(err, Err(StoreError::Referenced { referrers: 2, .. })),
        "{err:?}"
    );
    store.delete_context(a).unwrap();
    assert!(store.list_contexts().contains(&base));
    drop(store);
    let store = open(dir.path());
    assert_eq!(store.referrers(base), 1);
    assert_eq!(store.link(b).unwrap().unwrap().base, base.0);
    store.delete_context(b).unwrap();
    assert!(
        store.list_contexts().is_empty(),
        "{:?}",
        store.list_contexts()
    );
}

#[test]
fn a_link_that_does_not_check_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let base = prefix(&store, 1000, 2);
    let mut other = tokens(2 * T);
    other[20] += 1;
    let cases: Vec<(u32, Vec<u32>, Link)> = vec![
        // Another uid never borrows.
        (
            1001,
            tokens(2 * T),
            Link {
                base: base.0,
                chunks: 2,
            },
        ),
        // Tokens that differ inside the borrowed chunks.
        (
            1000,
            other,
            Link {
                base: base.0,
                chunks: 2,
            },
        ),
        // More chunks than the prefix holds.
        (
            1000,
            tokens(3 * T),
            Link {
                base: base.0,
                chunks: 3,
            },
        ),
        // No such prefix.
        (
            1000,
            tokens(2 * T),
            Link {
                base: 99,
                chunks: 1,
            },
        ),
    ];
    for (uid, toks, link) in cases {
        let seed = Seed {
            tokens: &toks,
            link: Some(link),
            ..Seed::default()
        };
        let err = store.create_context_with(new(uid), seed);
        assert!(matches!(err, Err(StoreError::Invalid { .. })), "{err:?}");
    }
    // A plain context is not a prefix to borrow from.
    let plain = store.create_context(new(1000)).unwrap();
    store.append_tokens(plain, &tokens(2 * T)).unwrap();
    let c = store.create_context(new(1000)).unwrap();
    store.append_tokens(c, &tokens(2 * T)).unwrap();
    let err = store.set_link(
        c,
        Some(Link {
            base: plain.0,
            chunks: 1,
        }),
    );
    assert!(matches!(err, Err(StoreError::Invalid { .. })), "{err:?}");
    assert_eq!(store.referrers(base), 0);
    assert!(store.link(c).unwrap().is_none());
}

#[test]
fn linking_frees_the_own_copies_and_new_tokens_shorten_the_link() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let base = prefix(&store, 1000, 3);
    let c = store.create_context(new(1000)).unwrap();
    store.append_tokens(c, &tokens(4 * T)).unwrap();
    for i in 0..4 {
        store
            .write_chunk(c, i, &FP, KvFormat::Int8, 0.5, &bytes(i))
            .unwrap();
    }
    store
        .set_link(
            c,
            Some(Link {
                base: base.0,
                chunks: 3,
            }),
        )
        .unwrap();
    let states: Vec<bool> = (0..4)
        .map(|i| matches!(store.chunk_state(c, i).unwrap(), StoreState::Stored(_)))
        .collect();
    assert_eq!(states, [false, false, false, true]);
    // A window slide keeps the first chunk's tokens: the link keeps that chunk alone.
    let mut slid = tokens(T);
    slid.extend(tokens(5 * T)[3 * T..].iter().map(|t| t + 1));
    store.replace_tokens(c, slid).unwrap();
    assert_eq!(store.link(c).unwrap().unwrap().chunks, 1);
    // Tokens that share nothing with it: the link goes, and the prefix with it.
    store.replace_tokens(c, vec![5; 2 * T]).unwrap();
    assert!(store.link(c).unwrap().is_none());
    assert!(!store.list_contexts().contains(&base));
}

/// Every crash point of making a context borrow a new prefix: the prefix created, its chunks
/// written, the link written, the borrower's own copies freed. Each is staged by hand (the
/// process dies between two of these steps) and the store reopened.
#[test]
fn recovery_keeps_links_to_whole_prefixes_and_removes_the_rest() {
    // The prefix made, no link yet: removed at open.
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let c = store.create_context(new(1000)).unwrap();
    store.append_tokens(c, &tokens(3 * T)).unwrap();
    let base = prefix(&store, 1000, 2);
    drop(store);
    let store = open(dir.path());
    assert_eq!(store.list_contexts(), vec![c]);
    assert!(
        store
            .recovered()
            .iter()
            .any(|r| r.reason.contains("no context uses")),
        "{:?}",
        store.recovered()
    );
    assert!(store.tokens(base).is_err());
    drop(store);

    // The link written, the borrower's own copies not yet freed: freed at open.
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let c = store.create_context(new(1000)).unwrap();
    store.append_tokens(c, &tokens(3 * T)).unwrap();
    for i in 0..3 {
        store
            .write_chunk(c, i, &FP, KvFormat::Int8, 0.5, &bytes(i))
            .unwrap();
    }
    let base = prefix(&store, 1000, 2);
    let link = Link {
        base: base.0,
        chunks: 2,
    };
    std::fs::write(
        dir.path().join("contexts").join(c.to_string()).join("link"),
        link.encode(),
    )
    .unwrap();
    drop(store);
    let store = open(dir.path());
    assert_eq!(store.link(c).unwrap(), Some(link));
    assert_eq!(store.chunk_state(c, 0).unwrap(), StoreState::Missing);
    assert!(matches!(
        store.chunk_state(c, 2).unwrap(),
        StoreState::Stored(_)
    ));
    assert_eq!(store.read_chunk(base, 1, &FP).unwrap(), bytes(1));
    drop(store);

    // A link whose prefix is gone (removed by hand): dropped, the chunks recomputed.
    std::fs::remove_dir_all(dir.path().join("contexts").join(base.to_string())).unwrap();
    let store = open(dir.path());
    assert_eq!(store.link(c).unwrap(), None);
    assert!(
        store.recovered().iter().any(|r| r.path.ends_with("link")),
        "{:?}",
        store.recovered()
    );
    drop(store);
    let store = open(dir.path());
    assert!(store.recovered().is_empty(), "{:?}", store.recovered());
}
