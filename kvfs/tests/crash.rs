//! Crash test: a writer process is killed with SIGKILL at random points, 50 times; after each kill
//! the store reopens, never returns a corrupt chunk, and holds every write the writer completed.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvfs::{ContextId, Fingerprint, KvFormat, NewContext, Store, StoreOptions, StoreState};
use strum::VariantArray;

const CHILD: &str = "KVFS_CRASH_WRITER";
const FP: Fingerprint = Fingerprint([0xc5; 32]);
const CHUNK_TOKENS: u32 = 16;
const MAX_CHUNKS: u32 = 48;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

fn token(i: u32) -> u32 {
    i.wrapping_mul(7919) % 49152
}

/// The content of chunk `index` written at sequence number `seq`: self-describing, so a reader can
/// tell which write it came from and check every byte.
fn content(index: u32, seq: u64) -> Vec<u8> {
    let len = 12 + (seq.wrapping_mul(7919) % 90_000) as usize;
    let mut b = Vec::with_capacity(len);
    b.extend_from_slice(&index.to_le_bytes());
    b.extend_from_slice(&seq.to_le_bytes());
    let mut r = Rng(seq.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ index as u64 | 1);
    b.extend((12..len).map(|_| (r.next() % 13) as u8));
    b
}

fn writer(dir: &Path, run: u64) {
    let store = Store::open(&dir.join("store"), StoreOptions::default()).unwrap();
    let mut journal = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("journal"))
        .unwrap();
    let id = match store.list_contexts().first() {
        Some(id) => *id,
        None => {
            let id = store
                .create_context(NewContext {
                    owner_uid: 0,
                    app: "crash".into(),
                    fingerprint: FP,
                    chunk_tokens: CHUNK_TOKENS,
                })
                .unwrap();
            journal.write_all(format!("ctx {id}\n").as_bytes()).unwrap();
            id
        }
    };
    let mut rng = Rng(run.wrapping_mul(0x2545_F491_4F6C_DD1D) | 1);
    for k in 0.. {
        let seq = run * 1_000_000 + k;
        let n = store.tokens(id).unwrap().len() as u32;
        if n < CHUNK_TOKENS * MAX_CHUNKS && (n == 0 || rng.next().is_multiple_of(4)) {
            let more: Vec<u32> = (n..n + CHUNK_TOKENS).map(token).collect();
            let total = store.append_tokens(id, &more).unwrap();
            journal
                .write_all(format!("tok {total}\n").as_bytes())
                .unwrap();
        } else {
            let index = (rng.next() % (n / CHUNK_TOKENS) as u64) as u32;
            let format = KvFormat::VARIANTS[(seq % 4) as usize];
            store
                .write_chunk(id, index, &FP, format, 0.5, &content(index, seq))
                .unwrap();
            journal
                .write_all(format!("chunk {index} {seq}\n").as_bytes())
                .unwrap();
        }
    }
}

/// Reopens the store and checks it against the journal of completed operations.
fn check(dir: &Path, run: u64) {
    let store = Store::open(&dir.join("store"), StoreOptions::default()).unwrap();
    for r in store.recovered() {
        assert_eq!(
            r.action,
            "removed",
            "run {run}: recovery had to {} {}: {}",
            r.action,
            r.path.display(),
            r.reason
        );
    }
    let journal = std::fs::read_to_string(dir.join("journal")).unwrap_or_default();
    // A line cut by the kill has no newline; its operation may or may not have completed.
    let complete = &journal[..journal.rfind('\n').map_or(0, |i| i + 1)];
    let mut ctx = None;
    let mut tokens = 0;
    let mut last: BTreeMap<u32, u64> = BTreeMap::new();
    for line in complete.lines() {
        let f: Vec<&str> = line.split(' ').collect();
        match f[0] {
            "ctx" => ctx = Some(ContextId(f[1].parse().unwrap())),
            "tok" => tokens = f[1].parse().unwrap(),
            "chunk" => {
                last.insert(f[1].parse().unwrap(), f[2].parse().unwrap());
            }
            other => panic!("bad journal line {other}"),
        }
    }
    let Some(id) = ctx.or_else(|| store.list_contexts().first().copied()) else {
        return;
    };
    let stored = store.tokens(id).unwrap();
    assert!(
        stored.len() >= tokens,
        "run {run}: {} tokens stored, {tokens} appended",
        stored.len()
    );
    assert!(
        stored
            .iter()
            .enumerate()
            .all(|(i, t)| *t == token(i as u32)),
        "run {run}: tokens differ"
    );
    let info = store.context(id).unwrap();
    for c in &info.chunks {
        match &c.state {
            StoreState::Stored(_) => {
                let data = store
                    .read_chunk(id, c.index, &FP)
                    .unwrap_or_else(|e| panic!("run {run}: {e}"));
                let index = u32::from_le_bytes(data[..4].try_into().unwrap());
                let seq = u64::from_le_bytes(data[4..12].try_into().unwrap());
                assert_eq!(index, c.index, "run {run}");
                assert!(
                    data == content(index, seq),
                    "run {run}: chunk {index} seq {seq} does not match its content"
                );
                if let Some(&done) = last.get(&c.index) {
                    assert!(
                        seq >= done,
                        "run {run}: chunk {index} is at write {seq}, write {done} completed"
                    );
                }
            }
            other => assert!(
                !last.contains_key(&c.index),
                "run {run}: completed chunk {} is {other:?}",
                c.index
            ),
        }
    }
}

#[test]
fn kill_9_a_writer_50_times() {
    if let Ok(dir) = std::env::var(CHILD) {
        let run = std::env::var("KVFS_CRASH_RUN").unwrap().parse().unwrap();
        writer(Path::new(&dir), run);
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // From the clock unless LLMS_TEST_SEED replays a run; printed, so a failure names it.
    let seed = std::env::var("LLMS_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    #[allow(clippy::print_stderr)]
    {
        eprintln!("kill_9_a_writer_50_times: seed {seed} (replay with LLMS_TEST_SEED={seed})");
    }
    let mut rng = Rng(seed | 1);
    for run in 1..=50u64 {
        let lines =
            |p: &Path| std::fs::read(p).map_or(0, |b| b.iter().filter(|c| **c == b'\n').count());
        let journal = dir.path().join("journal");
        let before = lines(&journal);
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "kill_9_a_writer_50_times", "--test-threads=1"])
            .env(CHILD, dir.path())
            .env("KVFS_CRASH_RUN", run.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        // Let the writer complete a random number of operations (0 to 6: a kill may also land in
        // open and recovery), then kill it a random moment later, in the middle of whatever it does.
        let target = before + (rng.next() % 7) as usize;
        while lines(&journal) < target {
            if let Some(status) = child.try_wait().unwrap() {
                panic!("run {run}: the writer exited on its own: {status}");
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        std::thread::sleep(Duration::from_micros(rng.next() % 3_000));
        // Child::kill sends SIGKILL.
        child.kill().unwrap();
        let status = child.wait().unwrap();
        assert!(
            !status.success(),
            "run {run}: the writer stopped on its own: {status}"
        );
        check(dir.path(), run);
    }
}
