//! The context manager with the real model (SmolLM2-135M, fetched as `llms model fetch` does): a
//! context swapped out entirely (its region's RSS back to zero) and brought back, by reads
//! through a real kvfs mount or by recompute, gives the same greedy tokens as a context never
//! swapped, for every KV format the service keeps chunks in and for the LLMS mix.

use std::sync::{Arc, OnceLock};
use std::time::Instant;

use model::Model;
use model::fetch::{self, FetchOptions};
use model::kv::KvFormat;
use model::tokenizer::Tokenizer;
use service::{CallOptions, LoadMode, Manager, ManagerConfig, Owner};
use uffd_pager::ContextId;

const TEXT: &str = "The lighthouse keeper climbed the spiral stairs every evening at dusk, \
counting the steps as his father had taught him. One hundred and twelve steps, each worn smooth \
in the middle by a century of boots. At the top he trimmed the wick, polished the great lens, \
and wrote the weather in a ledger whose first pages were older than the town itself. Ships no \
longer needed the light, for they carried their own maps of the sea inside small glowing \
screens, but the harbour council had voted, year after year, to keep the lamp burning.";

/// Tokens generated per call: enough to see a divergence, few enough to keep the test short.
const ANSWER: usize = 4;

struct Fixture {
    model: Arc<Model>,
    /// The system prompt, and the prompts of the two calls.
    system: Vec<u32>,
    first: Vec<u32>,
    second: Vec<u32>,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let path = fetch::default_model_path(&FetchOptions::default())
            .unwrap_or_else(|e| panic!("cannot fetch the default model: {e}"));
        let model = Arc::new(Model::load(&path).unwrap());
        let tokens = Tokenizer::from_gguf_file(&path).unwrap().encode(TEXT);
        assert!(tokens.len() >= 108, "{} tokens", tokens.len());
        Fixture {
            model,
            // 37 + 59 tokens: the first call ends with 6 sealed chunks and an open one.
            system: tokens[..37].to_vec(),
            first: tokens[37..96].to_vec(),
            second: tokens[96..108].to_vec(),
        }
    })
}

/// How a context keeps its chunks: a format it seals them in, and whether the end of each call
/// compresses them to the LLMS mix (k8v8, k4v4, k4v3 under the default bit budget).
#[derive(Clone, Copy, Debug)]
struct Keeping {
    format: KvFormat,
    mix: bool,
}

/// Two calls of one context; before the second, when `swap` is given, the context is swapped
/// out entirely and brought back that way. Returns both answers.
fn conversation(k: Keeping, swap: Option<LoadMode>) -> Vec<Vec<u32>> {
    let f = fixture();
    let store = tempfile::tempdir().unwrap();
    let mnt = tempfile::tempdir().unwrap();
    let mut cfg = ManagerConfig::new(store.path(), 256 << 20);
    cfg.mount = Some(mnt.path().join("kv"));
    cfg.kv_format = k.format;
    cfg.max_tokens = 512;
    cfg.load = swap.unwrap_or(LoadMode::Planned);
    if !k.mix {
        cfg.compress_bits = None;
    }
    let mut m = Manager::open(Arc::clone(&f.model), cfg).unwrap();
    let o = Owner {
        uid: 1000,
        app: "test".into(),
    };
    let id = m.create(&o, &f.system).unwrap();
    let opts = CallOptions {
        max_tokens: ANSWER,
        ..CallOptions::default()
    };
    let mut answers = Vec::new();
    for (call, prompt) in [&f.first, &f.second].into_iter().enumerate() {
        if let (Some(load), 1) = (swap, call) {
            m.flush();
            m.swap_out(&o, id).unwrap();
            let ctx = ContextId(id);
            assert_eq!(m.pager().context_resident(ctx).unwrap(), 0, "{k:?}");
            assert_eq!(m.pager().region_rss(ctx).unwrap(), 0, "{k:?}: region RSS");
            let r = m
                .call(&o, id, prompt, &opts, Instant::now(), |_| true)
                .unwrap();
            assert!(r.load.missing >= 6, "{k:?} {load:?}: {:?}", r.load);
            match load {
                LoadMode::ReadOnly => {
                    assert_eq!(r.load.read.len(), r.load.missing, "{k:?}: {:?}", r.load);
                }
                LoadMode::RecomputeOnly => {
                    assert!(r.load.read.is_empty(), "{k:?}: {:?}", r.load);
                }
                LoadMode::Planned => {}
            }
            answers.push(r.tokens);
        } else {
            let r = m
                .call(&o, id, prompt, &opts, Instant::now(), |_| true)
                .unwrap();
            answers.push(r.tokens);
        }
        if k.mix && call == 0 {
            // The mix is in effect: the chunks moved down from the sealing format.
            m.flush();
            let info = m.store().context(kvfs::ContextId(id)).unwrap();
            let stored: Vec<String> = info
                .chunks
                .iter()
                .filter_map(|c| match &c.state {
                    kvfs::StoreState::Stored(s) => Some(s.format.name().to_owned()),
                    _ => None,
                })
                .collect();
            assert!(
                !stored.is_empty()
                    && stored
                        .iter()
                        .all(|s| KvFormat::CODED.iter().any(|c| c.name() == s)),
                "{stored:?}"
            );
        }
    }
    assert_eq!(m.stats().faults, 0, "{k:?}: a chunk was faulted in");
    answers
}

#[test]
fn a_context_swapped_out_and_brought_back_answers_as_one_never_swapped_in_every_format() {
    let plain = [
        KvFormat::F16,
        KvFormat::Int8,
        KvFormat::K8v8,
        KvFormat::K4v4,
        KvFormat::K4v3,
    ]
    .map(|format| Keeping { format, mix: false });
    let mix = Keeping {
        format: KvFormat::Int8,
        mix: true,
    };
    for k in plain.into_iter().chain([mix]) {
        let kept = conversation(k, None);
        assert_eq!(kept.len(), 2);
        assert!(kept.iter().all(|a| a.len() == ANSWER), "{k:?}: {kept:?}");
        for load in [LoadMode::ReadOnly, LoadMode::RecomputeOnly] {
            let swapped = conversation(k, Some(load));
            assert_eq!(kept, swapped, "{k:?} brought back by {load:?}");
        }
    }
}
