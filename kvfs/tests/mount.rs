//! The store through a real FUSE mount (/dev/fuse, as root): round trips, sizes, concurrency,
//! permissions for another uid, read-only mounts, corruption and stale-mount cleanup.

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::sync::atomic::Ordering;

use kvfs::io::AlignedBuf;
use kvfs::{
    ContextId, Fingerprint, HEADER_PAGE, KvFormat, Mount, MountConfig, MountReader, NewContext,
    Store, StoreError, StoreOptions, StoreState, kv_offset, slot_offset,
};
use strum::VariantArray;

const FP: Fingerprint = Fingerprint([3; 32]);

/// A store and its live mount in a temp dir; the mount is dropped (unmounted) first, even on panic.
struct Fixture {
    mount: Option<Mount>,
    store: Arc<Store>,
    mnt: PathBuf,
    _dir: tempfile::TempDir,
}

impl Fixture {
    fn new(read_only: bool) -> Fixture {
        Fixture::with(read_only, true)
    }

    /// A fixture whose mount passes `O_DIRECT` readers of `kv` files through or not.
    fn with(read_only: bool, passthrough: bool) -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        // Other uids must be able to reach the mount point for the permission tests.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let mnt = dir.path().join("mnt");
        std::fs::create_dir(&mnt).unwrap();
        let store =
            Arc::new(Store::open(&dir.path().join("store"), StoreOptions::default()).unwrap());
        let mount = kvfs::mount(
            store.clone(),
            &mnt,
            &MountConfig {
                read_only,
                passthrough,
                ..MountConfig::default()
            },
        )
        .unwrap();
        Fixture {
            mount: Some(mount),
            store,
            mnt,
            _dir: dir,
        }
    }

    fn context(&self, owner: u32, tokens: u32) -> ContextId {
        let id = self
            .store
            .create_context(NewContext {
                owner_uid: owner,
                app: "test".into(),
                fingerprint: FP,
                chunk_tokens: 16,
            })
            .unwrap();
        self.store
            .append_tokens(id, &(0..tokens).collect::<Vec<_>>())
            .unwrap();
        id
    }

    fn path(&self, rel: impl AsRef<Path>) -> PathBuf {
        self.mnt.join(rel)
    }

    /// Flips one bit of a stored chunk's payload, `at` bytes in, in the context's data file.
    fn damage(&self, id: ContextId, index: u32, at: u64) {
        let slot = self.store.chunk_offset(id, index).expect("stored");
        let data = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(self.store.data_path(id))
            .unwrap();
        let stored = match self.store.chunk_state(id, index).unwrap() {
            StoreState::Stored(s) => s.stored_len as u64,
            other => panic!("chunk {index}: {other:?}"),
        };
        let mut b = [0u8];
        let at = slot + HEADER_PAGE as u64 + at % stored;
        data.read_exact_at(&mut b, at).unwrap();
        data.write_all_at(&[b[0] ^ 0x40], at).unwrap();
    }

    fn counters(&self) -> &kvfs::MountCounters {
        self.mount.as_ref().unwrap().counters()
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        if let Some(m) = self.mount.take() {
            m.unmount().unwrap();
        }
    }
}

fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 11) as u8
        })
        .collect()
}

fn set_xattr(path: &Path, name: &str, value: &str) {
    let out = Command::new("python3")
        .args([
            "-c",
            "import os,sys; os.setxattr(sys.argv[1], sys.argv[2], sys.argv[3].encode())",
        ])
        .arg(path)
        .args([name, value])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "setxattr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn get_xattr(path: &Path, name: &str) -> String {
    let out = Command::new("python3")
        .args([
            "-c",
            "import os,sys; print(os.getxattr(sys.argv[1], sys.argv[2]).decode())",
        ])
        .arg(path)
        .arg(name)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "getxattr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

#[test]
fn every_format_round_trips_through_the_mount() {
    let fx = Fixture::new(false);
    // Chunks 0..7 through the mount, 4..11 through the API: 11 chunks of tokens.
    let id = fx.context(0, 16 * 11);
    for (i, f) in KvFormat::VARIANTS.iter().copied().enumerate() {
        // Written through the mount, format set while the file is open, committed on close.
        let data = bytes(i as u64, 16384 << i);
        let p = fx.path(format!("{id}/chunks/{i}"));
        let mut file = std::fs::File::create(&p).unwrap();
        file.write_all(&data).unwrap();
        set_xattr(&p, "user.kvfs.format", f.name());
        set_xattr(&p, "user.kvfs.density", "0.75");
        drop(file);
        assert_eq!(std::fs::read(&p).unwrap(), data, "format {f}");
        assert_eq!(fx.store.read_chunk(id, i as u32, &FP).unwrap(), data);
        match fx.store.chunk_state(id, i as u32).unwrap() {
            StoreState::Stored(s) => {
                assert_eq!((s.format, s.density), (f, 0.75));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(get_xattr(&p, "user.kvfs.format"), f.name());
        assert_eq!(get_xattr(&p, "user.kvfs.state"), "stored");
        // Written through the API, read through the mount.
        let j = 4 + i as u32;
        let data = bytes(100 + i as u64, 4096 * (i + 1) + 17);
        fx.store.write_chunk(id, j, &FP, f, 0.5, &data).unwrap();
        assert_eq!(
            std::fs::read(fx.path(format!("{id}/chunks/{j}"))).unwrap(),
            data
        );
    }
    // Rewriting in place through the mount keeps the format unless told otherwise.
    let p = fx.path(format!("{id}/chunks/2"));
    std::fs::write(&p, b"shorter").unwrap();
    assert_eq!(std::fs::read(&p).unwrap(), b"shorter");
    assert_eq!(get_xattr(&p, "user.kvfs.format"), "int4");
}

#[test]
fn ls_cat_and_stat_agree_on_sizes() {
    let fx = Fixture::new(false);
    let id = fx.context(0, 40);
    for i in 0..3 {
        fx.store
            .write_chunk(
                id,
                i,
                &FP,
                KvFormat::Int8,
                0.1,
                &bytes(i as u64, 1000 * (i as usize + 1)),
            )
            .unwrap();
    }
    let mut names: Vec<String> = std::fs::read_dir(fx.path(id.to_string()))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["chunks", "data", "info", "kv", "text", "tokens"]);
    let mut chunks: Vec<String> = std::fs::read_dir(fx.path(format!("{id}/chunks")))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    chunks.sort();
    assert_eq!(chunks, ["0", "1", "2"]);
    let files = [
        "stats".to_owned(),
        format!("{id}/info"),
        format!("{id}/text"),
        format!("{id}/tokens"),
        format!("{id}/chunks/1"),
    ];
    for f in &files {
        let p = fx.path(f);
        let stat_len = std::fs::metadata(&p).unwrap().len();
        let cat_len = std::fs::read(&p).unwrap().len() as u64;
        let out = Command::new("stat")
            .args(["-c", "%s"])
            .arg(&p)
            .output()
            .unwrap();
        let stat_cmd: u64 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
        let out = Command::new("cat").arg(&p).output().unwrap();
        assert_eq!(
            (stat_len, stat_cmd, out.stdout.len() as u64),
            (cat_len, cat_len, cat_len),
            "{f}"
        );
    }
    assert_eq!(
        std::fs::metadata(fx.path(format!("{id}/chunks/1")))
            .unwrap()
            .len(),
        2000
    );
    let ls = Command::new("ls")
        .arg("-l")
        .arg(fx.path(format!("{id}/chunks")))
        .output()
        .unwrap();
    let ls = String::from_utf8(ls.stdout).unwrap();
    assert!(
        ls.lines()
            .any(|l| l.contains(" 3000 ") && l.ends_with(" 2")),
        "{ls}"
    );
    assert!(
        ls.lines().filter(|l| l.starts_with("-rw-------")).count() == 3,
        "{ls}"
    );
    let info = std::fs::read_to_string(fx.path(format!("{id}/info"))).unwrap();
    assert!(info.contains("3 stored"), "{info}");
    let tokens = std::fs::read_to_string(fx.path(format!("{id}/tokens"))).unwrap();
    assert_eq!(tokens.split_whitespace().count(), 40);
}

/// What a person inspecting sees: `text` decoded by the decoder registered for the context's
/// model (never by another model's), `tokens`, and per chunk its format, bytes, density, when it
/// was written and whether the registered residency says it is in memory, in `info` and as xattrs.
/// Kept whole: one scenario through one mount, read top to bottom; each check reads the
/// state the steps before it left.
#[test]
fn inspection_shows_text_tokens_and_each_chunks_state() {
    let fx = Fixture::new(false);
    let id = fx.context(0, 40);
    let before = kvfs::utc(unix_now());
    for (i, format) in [KvFormat::Int8, KvFormat::Int4].into_iter().enumerate() {
        fx.store
            .write_chunk(
                id,
                i as u32,
                &FP,
                format,
                0.25 * (i + 1) as f32,
                &bytes(i as u64, 3000),
            )
            .unwrap();
    }
    let after = kvfs::utc(unix_now());
    let other = Fingerprint([FP.0[0] + 1; 32]);
    let foreign = fx
        .store
        .create_context(NewContext {
            owner_uid: 0,
            app: "other model".into(),
            fingerprint: other,
            chunk_tokens: 16,
        })
        .unwrap();
    fx.store.append_tokens(foreign, &[7, 8, 9]).unwrap();
    let read = |rel: String| std::fs::read_to_string(fx.path(rel)).unwrap();

    // No decoder yet: text says so and where the ids are; no residency: "-".
    let text = read(format!("{id}/text"));
    assert!(text.contains("no tokenizer is loaded"), "{text}");
    assert!(text.contains("`tokens`"), "{text}");
    let ids: Vec<String> = (0..40).map(|t: u32| t.to_string()).collect();
    assert_eq!(read(format!("{id}/tokens")), format!("{}\n", ids.join(" ")));
    let chunk0 = fx.path(format!("{id}/chunks/0"));
    assert_eq!(
        get_xattr_err(&chunk0, "user.kvfs.resident"),
        Some(libc::ENODATA)
    );

    // A decoder for this model, and a residency that says even chunks are in memory.
    let decoder: kvfs::Decoder = Arc::new(|t: &[u32]| {
        t.iter()
            .map(|&i| char::from(b'a' + (i % 26) as u8))
            .collect()
    });
    fx.store.set_decoder(FP, decoder.clone());
    fx.store
        .set_residency(Arc::new(move |c| (c == id).then(|| vec![true, false])));
    let text = read(format!("{id}/text"));
    assert_eq!(text, decoder(&fx.store.tokens(id).unwrap()));
    let info = read(format!("{id}/info"));
    assert!(info.contains("decoded by this model's tokenizer"), "{info}");
    for i in 0..2u32 {
        let p = fx.path(format!("{id}/chunks/{i}"));
        let s = match fx.store.chunk_state(id, i).unwrap() {
            StoreState::Stored(s) => s,
            other => panic!("chunk {i}: {other:?}"),
        };
        assert_eq!(get_xattr(&p, "user.kvfs.format"), s.format.name());
        assert_eq!(get_xattr(&p, "user.kvfs.density"), s.density.to_string());
        assert_eq!(
            get_xattr(&p, "user.kvfs.stored_bytes"),
            s.stored_len.to_string()
        );
        assert_eq!(get_xattr(&p, "user.kvfs.raw_bytes"), "3000");
        let written = get_xattr(&p, "user.kvfs.written");
        assert!(
            before <= written && written <= after,
            "{before} <= {written} <= {after}"
        );
        assert_eq!(Some(written.clone()), s.written.map(kvfs::utc));
        let resident = if i % 2 == 0 { "yes" } else { "no" };
        assert_eq!(get_xattr(&p, "user.kvfs.resident"), resident);
        // The same in info's chunk table.
        let row = info
            .lines()
            .find(|l| l.starts_with(&format!("{i} ")))
            .unwrap_or_else(|| panic!("no row {i} in\n{info}"));
        let cols: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(
            cols,
            [
                &i.to_string(),
                &format!("{}..{}", 16 * i, 16 * (i + 1)),
                "stored",
                s.format.name(),
                &format!("{:.4}", s.density),
                s.codec.name(),
                "3000",
                &s.stored_len.to_string(),
                resident,
                &written
            ],
            "{info}"
        );
    }
    let names = list_xattrs(&chunk0);
    for x in ["stored_bytes", "written", "resident", "format", "density"] {
        assert!(names.contains(&format!("user.kvfs.{x}")), "{names:?}");
    }

    // The context of another model: never decoded by this model's tokenizer, and info says why.
    let text = read(format!("{foreign}/text"));
    assert!(
        text.contains("not decoded") && text.contains(&FP.to_string()),
        "{text}"
    );
    assert_ne!(text, decoder(&[7, 8, 9]));
    assert_eq!(read(format!("{foreign}/tokens")), "7 8 9\n");
    let info = read(format!("{foreign}/info"));
    assert!(
        info.lines()
            .any(|l| l.starts_with("note") && l.contains(&FP.to_string())),
        "{info}"
    );
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// The errno of a failed getxattr, or `None` when it succeeds.
fn get_xattr_err(path: &Path, name: &str) -> Option<i32> {
    let out = Command::new("python3")
        .args([
            "-c",
            "import os,sys\ntry:\n os.getxattr(sys.argv[1], sys.argv[2])\nexcept OSError as e:\n print(e.errno)",
        ])
        .arg(path)
        .arg(name)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout).unwrap().trim().parse().ok()
}

fn list_xattrs(path: &Path) -> Vec<String> {
    let out = Command::new("python3")
        .args([
            "-c",
            "import os,sys; print(chr(10).join(os.listxattr(sys.argv[1])))",
        ])
        .arg(path)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect()
}

#[test]
fn concurrent_readers_and_a_writer_see_only_whole_versions() {
    let fx = Fixture::new(false);
    let id = fx.context(0, 16 * 4);
    // Version v of chunk i: 64 KiB whose first 8 bytes are v and the rest derived from (i, v).
    let version = |i: u32, v: u64| {
        let mut b = v.to_le_bytes().to_vec();
        b.extend(bytes(v * 31 + i as u64, 65536 - 8));
        b
    };
    for i in 0..4 {
        fx.store
            .write_chunk(id, i, &FP, KvFormat::Int8, 0.0, &version(i, 0))
            .unwrap();
    }
    std::thread::scope(|s| {
        let writer = s.spawn(|| {
            for v in 1..=30u64 {
                let i = (v % 4) as u32;
                std::fs::write(fx.path(format!("{id}/chunks/{i}")), version(i, v)).unwrap();
            }
        });
        for r in 0..3u32 {
            let fx = &fx;
            s.spawn(move || {
                for n in 0..60 {
                    let i = (n + r) % 4;
                    let mut data = Vec::new();
                    std::fs::File::open(fx.path(format!("{id}/chunks/{i}")))
                        .unwrap()
                        .read_to_end(&mut data)
                        .unwrap();
                    let v = u64::from_le_bytes(data[..8].try_into().unwrap());
                    assert_eq!(data, version(i, v), "reader {r} chunk {i} version {v} torn");
                }
            });
        }
        writer.join().unwrap();
    });
    for i in 0..4u32 {
        let last = (1..=30u64).filter(|v| v % 4 == i as u64).max().unwrap();
        assert_eq!(
            std::fs::read(fx.path(format!("{id}/chunks/{i}"))).unwrap(),
            version(i, last)
        );
    }
}

/// Runs `args` as uid/gid 65534 (nobody) with no supplementary groups.
fn as_nobody(args: &[&str]) -> std::process::Output {
    Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .args(args)
        .output()
        .expect("setpriv from util-linux")
}

#[test]
fn another_uid_cannot_list_or_read_a_context_it_does_not_own() {
    let fx = Fixture::new(false);
    let theirs = fx.context(1000, 16);
    let mine = fx.context(65534, 16);
    fx.store
        .write_chunk(theirs, 0, &FP, KvFormat::Int8, 0.0, b"secret")
        .unwrap();
    fx.store
        .write_chunk(mine, 0, &FP, KvFormat::Int8, 0.0, b"nobody's")
        .unwrap();
    let mnt = fx.mnt.to_str().unwrap();
    let p = |rel: String| format!("{mnt}/{rel}");

    let ls = as_nobody(&["ls", "-1", mnt]);
    assert!(ls.status.success(), "{ls:?}");
    let listed = String::from_utf8(ls.stdout).unwrap();
    assert_eq!(
        listed.lines().collect::<Vec<_>>(),
        vec![mine.to_string().as_str(), "stats"]
    );
    for target in [p(format!("{theirs}")), p(format!("{theirs}/chunks"))] {
        let out = as_nobody(&["ls", &target]);
        assert!(!out.status.success(), "nobody listed {target}: {out:?}");
    }
    for target in [
        p(format!("{theirs}/info")),
        p(format!("{theirs}/text")),
        p(format!("{theirs}/tokens")),
        p(format!("{theirs}/kv")),
        p(format!("{theirs}/chunks/0")),
    ] {
        let out = as_nobody(&["cat", &target]);
        assert!(
            !out.status.success() && out.stdout.is_empty(),
            "nobody read {target}: {out:?}"
        );
    }
    // Nor its chunks' attributes.
    let out = as_nobody(&[
        "python3",
        "-c",
        "import os,sys; print(os.getxattr(sys.argv[1], 'user.kvfs.stored_bytes'))",
        &p(format!("{theirs}/chunks/0")),
    ]);
    assert!(
        !out.status.success() && out.stdout.is_empty(),
        "nobody read their attributes: {out:?}"
    );
    let out = as_nobody(&[
        "sh",
        "-c",
        &format!("echo x > {}", p(format!("{theirs}/chunks/1"))),
    ]);
    assert!(
        !out.status.success(),
        "nobody wrote into another's context: {out:?}"
    );
    // The control: nobody reads its own context, so the refusals above are about ownership.
    let out = as_nobody(&["cat", &p(format!("{mine}/chunks/0"))]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(out.stdout, b"nobody's");
    // Its kv file shows chunk 0's slot: the header page, then the bytes; its data file, read
    // with O_DIRECT (passed through), the same.
    let out = as_nobody(&["cat", &p(format!("{mine}/kv"))]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(out.stdout.len(), HEADER_PAGE + 8);
    assert!(out.stdout.ends_with(b"nobody's"));
    let dd = |file: String| {
        as_nobody(&[
            "dd",
            &format!("if={file}"),
            "iflag=direct",
            "bs=8192",
            "count=1",
            "status=none",
        ])
    };
    let out = dd(p(format!("{mine}/data")));
    assert!(out.status.success(), "{out:?}");
    assert!(out.stdout.ends_with(b"nobody's"), "{out:?}");
    // The other context's data file cannot be read, and no view of it opened for writing.
    let out = dd(p(format!("{theirs}/data")));
    assert!(!out.status.success(), "nobody read their data: {out:?}");
    for target in [
        p(format!("{theirs}/kv")),
        p(format!("{theirs}/chunks/0")),
        p(format!("{theirs}/data")),
    ] {
        let out = as_nobody(&["sh", "-c", &format!("exec 3<>{target}")]);
        assert!(!out.status.success(), "nobody opened {target}: {out:?}");
    }
    // Root (the service) sees both.
    let all: Vec<_> = std::fs::read_dir(&fx.mnt).unwrap().collect();
    assert_eq!(all.len(), 3);
    assert_eq!(fx.store.read_chunk(theirs, 0, &FP).unwrap(), b"secret");
}

#[test]
fn a_read_only_mount_refuses_writes() {
    let fx = Fixture::new(true);
    let id = fx.context(0, 16);
    fx.store
        .write_chunk(id, 0, &FP, KvFormat::Int2, 0.0, b"data")
        .unwrap();
    let p = fx.path(format!("{id}/chunks/0"));
    assert_eq!(std::fs::read(&p).unwrap(), b"data");
    let err = std::fs::write(&p, b"new").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EROFS), "{err}");
    let err = std::fs::write(fx.path(format!("{id}/chunks/1")), b"new").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EROFS), "{err}");
    assert_eq!(fx.store.read_chunk(id, 0, &FP).unwrap(), b"data");
}

#[test]
fn a_corrupt_chunk_is_an_io_error_through_the_mount() {
    let fx = Fixture::new(false);
    let id = fx.context(0, 16);
    fx.store
        .write_chunk(id, 0, &FP, KvFormat::Int8, 0.0, &bytes(1, 10000))
        .unwrap();
    fx.damage(id, 0, 96);
    let err = std::fs::read(fx.path(format!("{id}/chunks/0"))).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    // Quarantined: gone from the listing, reported in info.
    assert_eq!(
        std::fs::read_dir(fx.path(format!("{id}/chunks")))
            .unwrap()
            .count(),
        0
    );
    let info = std::fs::read_to_string(fx.path(format!("{id}/info"))).unwrap();
    assert!(info.contains("1 quarantined"), "{info}");
}

#[test]
fn a_stale_mount_of_a_killed_server_is_cleaned_up() {
    const CHILD: &str = "KVFS_TEST_STALE_CHILD";
    if let Ok(paths) = std::env::var(CHILD) {
        // Child: mount and wait to be killed.
        let (store, mnt) = paths.split_once('\n').unwrap();
        let store = Arc::new(Store::open(Path::new(store), StoreOptions::default()).unwrap());
        let m = kvfs::mount(store, Path::new(mnt), &MountConfig::default()).unwrap();
        std::io::stdout().write_all(b"mounted\n").unwrap();
        std::io::stdout().flush().unwrap();
        std::thread::sleep(std::time::Duration::from_secs(60));
        drop(m);
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let store_dir = dir.path().join("store");
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_stale_mount_of_a_killed_server_is_cleaned_up",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, format!("{}\n{}", store_dir.display(), mnt.display()))
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    while !line.contains("mounted") {
        line.clear();
        assert!(
            std::io::BufRead::read_line(&mut out, &mut line).unwrap() > 0,
            "child died before mounting"
        );
    }
    // The root's attributes are cached by the kernel now (for a second), so a `stat` of the mount
    // point right after the kill still answers, as if the server lived: only a request that
    // reaches the server shows it dead.
    assert!(std::fs::metadata(&mnt).unwrap().is_dir());
    child.kill().unwrap();
    child.wait().unwrap();
    let err = nix::sys::statvfs::statvfs(&mnt).unwrap_err();
    assert_eq!(err, nix::errno::Errno::ENOTCONN, "{err}");
    let store = Arc::new(Store::open(&store_dir, StoreOptions::default()).unwrap());
    let id = store
        .create_context(NewContext {
            owner_uid: 0,
            app: "a".into(),
            fingerprint: FP,
            chunk_tokens: 16,
        })
        .unwrap();
    let m = kvfs::mount(store, &mnt, &MountConfig::default()).unwrap();
    assert!(
        std::fs::metadata(mnt.join(id.to_string()))
            .unwrap()
            .is_dir()
    );
    // A live mount is refused rather than stacked over.
    let again = kvfs::mount(
        Arc::new(Store::open(&dir.path().join("s2"), StoreOptions::default()).unwrap()),
        &mnt,
        &MountConfig::default(),
    );
    assert!(
        matches!(again, Err(kvfs::MountError::AlreadyMounted { .. })),
        "{again:?}"
    );
    m.unmount().unwrap();
}

/// Incompressible bytes (stored raw).
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

/// The whole-context `kv` file and the per-chunk views give the same bytes, for every format.
///
/// Kept whole: one scenario through one mount, read top to bottom.
#[test]
fn the_kv_file_and_the_chunk_view_agree_byte_for_byte() {
    let fx = Fixture::new(false);
    let id = fx.context(0, 16 * 12);
    // Every format, raw and zstd payloads, real chunk sizes, one larger than a FUSE request
    // (split over requests), and holes at 3 and 9.
    let chunks: Vec<(u32, KvFormat, Vec<u8>)> = vec![
        (0, KvFormat::Int8, noise(1, 212 << 10)),
        (1, KvFormat::Int4, noise(2, 120 << 10)),
        (2, KvFormat::Int2, bytes(3, 76 << 10)),
        (4, KvFormat::F16, bytes(4, 368 << 10)),
        (5, KvFormat::Int8, noise(5, (1 << 20) + 4097)),
        (6, KvFormat::Int8, bytes(6, 3 << 20)),
        (7, KvFormat::Int2, noise(7, 1)),
        (8, KvFormat::Int4, noise(8, 4096 - 104)),
    ];
    for (i, f, data) in &chunks {
        fx.store.write_chunk(id, *i, &FP, *f, 0.5, data).unwrap();
    }
    // Both ways the kv file is read: passed through to the data file (O_DIRECT, the service's
    // way) and served by the daemon (any other open), and both kinds of buffer: page-aligned and
    // long enough (one read straight into it) or not (read aside, then copied or decompressed).
    let passthrough = fx.counters().passthrough_opens.load(Ordering::Relaxed);
    let kv = MountReader::open(&fx.mnt, id, FP).unwrap();
    assert_eq!(
        fx.counters().passthrough_opens.load(Ordering::Relaxed),
        passthrough + 1,
        "the reader's open was passed through"
    );
    let served = fx.counters().kv_reads.load(Ordering::Relaxed);
    let mut aligned = AlignedBuf::new(4 << 20);
    let mut unaligned = vec![0u8; (4 << 20) + 1];
    for (i, f, data) in &chunks {
        for buf in [aligned.get(4 << 20), &mut unaligned[1..]] {
            let meta = kv.read_chunk_into(&fx.store, *i, buf).unwrap();
            assert_eq!((meta.format, meta.raw_len as usize), (*f, data.len()));
            assert_eq!(&buf[..data.len()], &data[..], "chunk {i} through kv");
        }
    }
    assert_eq!(
        fx.counters().kv_reads.load(Ordering::Relaxed),
        served,
        "no passed-through read reached the daemon"
    );
    let by_daemon = std::fs::File::open(fx.path(format!("{id}/kv"))).unwrap();
    let direct = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(fx.path(format!("{id}/kv")))
        .unwrap();
    for (i, _, data) in &chunks {
        let view = std::fs::read(fx.path(format!("{id}/chunks/{i}"))).unwrap();
        assert_eq!(&view, data, "chunk {i} through chunks/");
        // The slot in the file: the header page, then the stored payload, the same bytes
        // whether the daemon serves them or the kernel reads the data file.
        let at = match fx.store.chunk_state(id, *i).unwrap() {
            StoreState::Stored(s) => s,
            other => panic!("chunk {i}: {other:?}"),
        };
        let len = HEADER_PAGE + at.stored_len as usize;
        let mut slot = vec![0u8; len];
        by_daemon
            .read_exact_at(&mut slot, slot_offset(*i, at.copy))
            .unwrap();
        let h = kvfs::format::ChunkHeader::decode(&slot).unwrap();
        h.check_payload(&slot[HEADER_PAGE..]).unwrap();
        let payload = &slot[HEADER_PAGE..];
        match h.codec {
            kvfs::Codec::Raw => assert_eq!(payload, &data[..]),
            kvfs::Codec::Zstd => {
                assert_eq!(&zstd::bulk::decompress(payload, data.len()).unwrap(), data)
            }
        }
        let round = len.next_multiple_of(4096);
        let mut pt = AlignedBuf::new(round);
        let n = direct
            .read_at(pt.get(round), slot_offset(*i, at.copy))
            .unwrap();
        assert!(n >= len, "chunk {i}: {n} bytes");
        assert_eq!(&pt.get(round)[..len], &slot[..], "chunk {i} passed through");
    }
    let buf = aligned.get(4 << 20);
    for hole in [3, 9, 100] {
        assert!(
            matches!(
                kv.read_chunk_into(&fx.store, hole, buf),
                Err(StoreError::ChunkMissing { .. })
            ),
            "hole {hole}"
        );
    }
    let err = kv
        .read_chunk_into(&fx.store, 0, &mut buf[..1000])
        .unwrap_err();
    assert!(
        matches!(err, StoreError::BufferTooSmall { need, .. } if need == 212 << 10),
        "{err}"
    );
    // The file is the data file, offset for offset.
    let len = std::fs::metadata(fx.path(format!("{id}/kv")))
        .unwrap()
        .len();
    assert_eq!(
        len,
        std::fs::metadata(fx.store.data_path(id)).unwrap().len()
    );
    // A reader of another model is refused.
    let other = MountReader::open(&fx.mnt, id, Fingerprint([9; 32])).unwrap();
    assert!(matches!(
        other.read_chunk_into(&fx.store, 0, buf),
        Err(StoreError::ForeignModel { .. })
    ));
    assert!(matches!(
        MountReader::open(&fx.mnt, ContextId(999), FP),
        Err(StoreError::NoSuchContext { .. })
    ));
}

#[test]
fn without_passthrough_the_daemon_serves_the_same_chunks() {
    let fx = Fixture::with(false, false);
    let id = fx.context(0, 16 * 3);
    let chunks = [
        noise(1, 212 << 10),
        bytes(2, 76 << 10),
        noise(3, (1 << 20) + 4097),
    ];
    for (i, d) in chunks.iter().enumerate() {
        fx.store
            .write_chunk(id, i as u32, &FP, KvFormat::Int8, 0.0, d)
            .unwrap();
    }
    let kv = MountReader::open(&fx.mnt, id, FP).unwrap();
    let mut buf = AlignedBuf::new(2 << 20);
    for (i, d) in chunks.iter().enumerate() {
        let meta = kv
            .read_chunk_into(&fx.store, i as u32, buf.get(2 << 20))
            .unwrap();
        assert_eq!(&buf.get(2 << 20)[..meta.raw_len as usize], &d[..]);
    }
    assert_eq!(fx.counters().passthrough_opens.load(Ordering::Relaxed), 0);
    assert_eq!(fx.counters().kv_reads.load(Ordering::Relaxed), 3);
    // A chunk damaged on disk is caught by the reader's checks and quarantined by the store.
    fx.damage(id, 1, 5);
    let err = kv
        .read_chunk_into(&fx.store, 1, buf.get(2 << 20))
        .unwrap_err();
    assert!(matches!(err, StoreError::Corrupt { .. }), "{err}");
    assert!(matches!(
        fx.store.chunk_state(id, 1).unwrap(),
        StoreState::Quarantined { .. }
    ));
}

#[test]
fn writes_through_the_kv_file_are_checked_and_durable() {
    let fx = Fixture::new(false);
    let id = fx.context(0, 16 * 4);
    let kv = MountReader::open_rw(&fx.mnt, id, FP).unwrap();
    let chunks = [
        (KvFormat::Int8, noise(1, 212 << 10)),
        (KvFormat::Int4, bytes(2, 120 << 10)),
        (KvFormat::Int2, noise(3, (2 << 20) + 333)),
    ];
    for (i, (f, data)) in chunks.iter().enumerate() {
        kv.write_chunk(i as u32, *f, 0.25, data).unwrap();
        // Durable and visible as soon as the write returned.
        match fx.store.chunk_state(id, i as u32).unwrap() {
            StoreState::Stored(s) => assert_eq!((s.format, s.density), (*f, 0.25)),
            other => panic!("chunk {i}: {other:?}"),
        }
        assert_eq!(&fx.store.read_chunk(id, i as u32, &FP).unwrap(), data);
        let mut buf = vec![0u8; data.len()];
        kv.read_chunk_into(&fx.store, i as u32, &mut buf).unwrap();
        assert_eq!(&buf, data);
    }
    // Rewriting replaces the chunk whole.
    kv.write_chunk(0, KvFormat::Int4, 0.5, b"shorter").unwrap();
    assert_eq!(fx.store.read_chunk(id, 0, &FP).unwrap(), b"shorter");
    // A chunk beyond the stored tokens is refused, as through the API.
    let err = kv.write_chunk(4, KvFormat::Int8, 0.0, b"x").unwrap_err();
    assert!(err.to_string().contains("Invalid argument"), "{err}");
    // A damaged image (payload crc wrong) and an image for another slot are refused.
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(fx.path(format!("{id}/kv")))
        .unwrap();
    let mut header = kvfs::format::ChunkHeader {
        format: KvFormat::Int8,
        codec: kvfs::Codec::Raw,
        context: id.0,
        index: 1,
        token_start: 0,
        token_end: 0,
        tokens_crc: 0,
        density: 0.0,
        raw_len: 4,
        stored_len: 4,
        payload_crc: 0,
        generation: 0,
        fingerprint: FP,
        written: 0,
    };
    let mut image = header.encode().to_vec();
    image.extend_from_slice(b"data");
    let err = std::os::unix::fs::FileExt::write_at(&f, &image, kv_offset(1)).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    header.payload_crc = crc32c::crc32c(b"data");
    let mut image = header.encode().to_vec();
    image.extend_from_slice(b"data");
    let err = std::os::unix::fs::FileExt::write_at(&f, &image, kv_offset(2)).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EINVAL), "{err}");
    assert_eq!(&fx.store.read_chunk(id, 1, &FP).unwrap(), &chunks[1].1);
    // The accepted image commits.
    std::os::unix::fs::FileExt::write_all_at(&f, &image, kv_offset(1)).unwrap();
    assert_eq!(fx.store.read_chunk(id, 1, &FP).unwrap(), b"data");
    // What was written is on disk: a second, read-only open of the store sees it.
    let again = Store::open(
        fx.store.root(),
        StoreOptions {
            read_only: true,
            verify_on_open: true,
            ..StoreOptions::default()
        },
    )
    .unwrap();
    assert!(again.recovered().is_empty(), "{:?}", again.recovered());
    assert_eq!(again.read_chunk(id, 2, &FP).unwrap(), chunks[2].1);
    // A read-only mount refuses kv writes too.
    drop(kv);
    let ro = Fixture::new(true);
    let rid = ro.context(0, 16);
    let kv = MountReader::open(&ro.mnt, rid, FP).unwrap();
    drop(kv);
    assert!(MountReader::open_rw(&ro.mnt, rid, FP).is_err());
}

#[test]
fn a_corrupt_chunk_is_refused_with_eio_through_the_kv_file_and_quarantined() {
    let fx = Fixture::new(false);
    let id = fx.context(0, 16 * 4);
    let data = [noise(1, 212 << 10), bytes(2, 120 << 10), noise(3, 2 << 20)];
    let mut slots = Vec::new();
    for (i, d) in data.iter().enumerate() {
        let s = fx
            .store
            .write_chunk(id, i as u32, &FP, KvFormat::Int8, 0.0, d)
            .unwrap();
        slots.push((HEADER_PAGE + s.stored_len as usize) as u64);
        fx.damage(id, i as u32, (d.len() - 1 - i * 1000) as u64);
    }
    let kv = MountReader::open(&fx.mnt, id, FP).unwrap();
    let mut buf = AlignedBuf::new(4 << 20);
    let buf = buf.get(4 << 20);
    // Chunks 0 and 2 read through kv first (passed through: the reader finds the damage and
    // the store quarantines it), chunk 1 through its chunks/ file first (the daemon finds it).
    for i in [0u32, 2] {
        let slot = fx.store.chunk_offset(id, i).unwrap();
        let err = kv.read_chunk_into(&fx.store, i, buf).unwrap_err();
        assert!(
            matches!(err, StoreError::Corrupt { .. }) && err.needs_recompute(),
            "{err}"
        );
        // Refused from now on through the daemon too, and its slot is freed.
        let raw = std::fs::File::open(fx.path(format!("{id}/kv"))).unwrap();
        let err = raw.read_at(&mut buf[..4096], kv_offset(i));
        assert_eq!(err.unwrap_err().raw_os_error(), Some(libc::EIO));
        let data = std::fs::File::open(fx.store.data_path(id)).unwrap();
        let mut head = [0u8; 104];
        data.read_exact_at(&mut head, slot).unwrap();
        assert_eq!(head, [0; 104], "chunk {i}'s slot still holds it");
    }
    let err = std::fs::read(fx.path(format!("{id}/chunks/1"))).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    let err = kv.read_chunk_into(&fx.store, 1, buf).unwrap_err();
    assert!(matches!(err, StoreError::Corrupt { .. }), "{err}");
    for i in 0..3 {
        assert!(matches!(
            fx.store.chunk_state(id, i).unwrap(),
            StoreState::Quarantined { .. }
        ));
        assert_eq!(fx.store.chunk_offset(id, i), None);
    }
    // Each bad slot is kept aside whole, as it was on disk: its header page and payload.
    let mut kept: Vec<u64> = std::fs::read_dir(fx.store.root().join("quarantine"))
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .collect();
    kept.sort_unstable();
    slots.sort_unstable();
    assert_eq!(kept, slots);
    let info = std::fs::read_to_string(fx.path(format!("{id}/info"))).unwrap();
    assert!(info.contains("3 quarantined"), "{info}");
}

#[test]
fn concurrent_kv_readers_and_writers_never_see_a_torn_chunk() {
    let fx = Fixture::new(false);
    let id = fx.context(0, 16 * 4);
    // Version v of chunk i: its first 8 bytes are v, the rest derived from (i, v); sizes vary by
    // version, and chunk 3 is larger than one FUSE request, so its reads are split.
    let version = |i: u32, v: u64| {
        let len = if i == 3 {
            (1 << 20) + 8192 * (v as usize % 5)
        } else {
            (64 << 10) + 4096 * (v as usize % 7)
        };
        let mut b = v.to_le_bytes().to_vec();
        b.extend(noise(v * 31 + i as u64, len - 8));
        b
    };
    for i in 0..4 {
        fx.store
            .write_chunk(id, i, &FP, KvFormat::Int8, 0.0, &version(i, 0))
            .unwrap();
    }
    std::thread::scope(|s| {
        let writer = s.spawn(|| {
            let kv = MountReader::open_rw(&fx.mnt, id, FP).unwrap();
            for v in 1..=24u64 {
                let i = (v % 4) as u32;
                if v % 3 == 0 {
                    // Through the per-chunk view too.
                    std::fs::write(fx.path(format!("{id}/chunks/{i}")), version(i, v)).unwrap();
                } else {
                    kv.write_chunk(i, KvFormat::Int8, 0.0, &version(i, v))
                        .unwrap();
                }
            }
        });
        for r in 0..3u32 {
            let fx = &fx;
            s.spawn(move || {
                let kv = MountReader::open(&fx.mnt, id, FP).unwrap();
                let mut buf = AlignedBuf::new(2 << 20);
                let buf = buf.get(2 << 20);
                for n in 0..40 {
                    let i = (n + r) % 4;
                    let meta = kv.read_chunk_into(&fx.store, i, buf).unwrap();
                    let data = &buf[..meta.raw_len as usize];
                    let v = u64::from_le_bytes(data[..8].try_into().unwrap());
                    let want = version(i, v);
                    let first = data.iter().zip(&want).position(|(a, b)| a != b);
                    assert!(
                        data == want,
                        "reader {r} chunk {i} version {v} torn: {} bytes, want {}, first diff {first:?}, gen {}",
                        data.len(), want.len(), meta.generation
                    );
                }
            });
        }
        writer.join().unwrap();
    });
    let kv = MountReader::open(&fx.mnt, id, FP).unwrap();
    let mut buf = vec![0u8; 2 << 20];
    for i in 0..4u32 {
        let last = (1..=24u64).filter(|v| v % 4 == i as u64).max().unwrap();
        let meta = kv.read_chunk_into(&fx.store, i, &mut buf).unwrap();
        assert!(buf[..meta.raw_len as usize] == version(i, last)[..]);
    }
}
