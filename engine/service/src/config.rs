//! The context manager's settings, and the context managers the paper compares (§4,
//! Fig. 9-13) as named configurations of them: the same engine, pager, store and Load pipeline,
//! with settings for the chunk format, compression, victim choice, write-out and how missing
//! chunks come back. `llms serve --manager NAME` picks one; `llms bench switch` replays a trace
//! against each.

use std::path::PathBuf;
use std::str::FromStr;

use model::kv::KvFormat;
use policy::{CostModel, LinearCost};
use strum::VariantArray;

use crate::load::LoadMode;

/// Which chunks the pager gives up when it needs room.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum VictimPolicy {
    /// LCTRU: the heaviest level first, least recently used among them (LLMS).
    #[default]
    Lctru,
    /// Least recently used chunk first.
    Lru,
    /// The least recently used context, whole (the Swapping and LMK baselines).
    Context,
}

/// When a chunk is written to kvfs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum WriteOut {
    /// Ahead of time, at the end of the call that made or changed it (LLMS); a victim reclaimed
    /// before its write finished is written then ("sync reclaim").
    #[default]
    Aot,
    /// Only when it is reclaimed, and the reclaim waits for the write (vLLM, Swapping).
    OnReclaim,
    /// Never: a reclaimed chunk is gone and its context recomputes it (LMK).
    Never,
}

/// The default budget of the tolerance-aware compression, in all-in stored bits per value
/// (issue 14: int8's fidelity within 1% at about half its memory; docs/kv-formats.md).
pub const DEFAULT_KV_BITS: f64 = 4.5;

/// The manager's settings.
#[derive(Clone, Debug)]
pub struct ManagerConfig {
    /// The kvfs store directory (created if it does not exist).
    pub store: PathBuf,
    /// Where to mount the store; every chunk read and write then goes through the mount (the data
    /// path people inspect). `None` moves chunks through the store's API directly.
    pub mount: Option<PathBuf>,
    /// How to start the mount's guard process (see `kvfs::guard`), for a process that may be
    /// killed while chunks move through its own mount: `llms serve` runs itself.
    pub mount_guard: Option<kvfs::guard::GuardCommand>,
    /// Bytes of KV chunks that may be resident at once, across contexts.
    pub kv_budget: u64,
    /// The format new chunks are sealed in.
    pub kv_format: KvFormat,
    /// Tokens per chunk; 0 (the default): the model's (`ModelConfig::chunk_tokens`: 16, and 32
    /// for Gemma 3, whose chunks past the window are small).
    pub chunk_tokens: usize,
    /// The most tokens one context holds.
    pub max_tokens: usize,
    /// The budget of the tolerance-aware compression at the end of every call, in all-in stored
    /// bits per K/V value (payload, parameters and kvfs's header; the mean over the context's
    /// chunks, paper Eq. 3), or `None` to keep every chunk in `kv_format`.
    pub compress_bits: Option<f64>,
    /// The formats chunks may be compressed to, heaviest first (`policy::LevelSet` over their
    /// stored bytes). A chunk sealed in a heavier format (int8) moves at least to the first.
    pub levels: Vec<KvFormat>,
    /// Which manager this configuration is (set by [`ManagerKind::apply`]; reported in stats).
    pub kind: ManagerKind,
    /// How the pager picks victims.
    pub victims: VictimPolicy,
    /// When chunks are written to kvfs.
    pub write_out: WriteOut,
    /// How missing chunks come back.
    pub load: LoadMode,
    /// The costs the planner starts from ([`default_cost`], or a profile of this machine:
    /// [`crate::profile::read_cost_model`]); refined with every Load's measurements.
    pub cost: CostModel,
    /// Chunks the AoT writer may hold queued (bounds its memory).
    pub writer_queue: usize,
    /// Where the Load cannot read through an io_uring (no mount, or the kernel refuses it):
    /// threads that read chunks during a Load with nothing to recompute (one otherwise: the
    /// engine thread recomputes on the other core). Each keeps one read in flight, into its part
    /// of the readers' buffer (a chunk of the Load's largest format; eight int8 parts fit one
    /// 2 MiB huge page). With reads into huge pages, eight bring a 2048-token int8 context back
    /// in 10.6-12.4 ms against 12.5-14.0 with four (docs/service.md).
    pub io_threads: usize,
    /// A call that would overflow `max_tokens` slides the context's window instead of failing:
    /// the first chunk (the attention sink) and the most recent tokens are kept, the rest is
    /// dropped, and the kept tokens are prefilled again with the prompt (StreamingLLM's sink and
    /// window at chunk granularity). `false` refuses such a call with `context_full`.
    pub window: bool,
    /// A new context whose first tokens (a system prompt, a transcript) a context of the same
    /// owner computed already borrows those chunks from a shared prefix instead of computing and
    /// holding them again (docs/service.md, "Forks and shared prefixes"). Forks share whatever
    /// this says. Off for the paper's baselines (`ManagerKind::apply`).
    pub share_prefixes: bool,
}

impl ManagerConfig {
    /// The LLMS defaults over the store at `store` with a KV budget of `kv_budget` bytes.
    pub fn new(store: impl Into<PathBuf>, kv_budget: u64) -> Self {
        Self {
            store: store.into(),
            mount: None,
            mount_guard: None,
            kv_budget,
            kv_format: KvFormat::Int8,
            chunk_tokens: 0,
            max_tokens: 2048,
            compress_bits: Some(DEFAULT_KV_BITS),
            levels: KvFormat::CODED.to_vec(),
            kind: ManagerKind::Llms,
            victims: VictimPolicy::Lctru,
            write_out: WriteOut::Aot,
            load: LoadMode::Planned,
            cost: default_cost(),
            writer_queue: 16,
            io_threads: 8,
            window: true,
            share_prefixes: true,
        }
    }
}

/// Starting costs, before any Load was measured on this machine: reads at 1 GB/s after 100 us,
/// recompute at 50 ms per chunk after 10 ms; every Load refines them. The recompute figure is
/// what chunks cost deep in a long context on a 2-core CPU (a whole 2048-token context: 47 ms a
/// chunk; one chunk at 1500 tokens: 123 ms, docs/bench.md): a cheaper guess made a fresh daemon
/// recompute where reading was several times faster, and a dearer one only reads a little more
/// until the first Loads teach it the machine.
pub fn default_cost() -> CostModel {
    CostModel::new(
        LinearCost::new(10e-3, 50e-3).expect("valid constants"),
        LinearCost::new(100e-6, 1e-9).expect("valid constants"),
    )
}

/// A context manager: LLMS, its ablations, and the baselines. Every manager is in
/// `<ManagerKind as strum::VariantArray>::VARIANTS`, LLMS first; its name on the command line
/// and in reports ([`ManagerKind::name`], `Display`, serde) is the variant's in kebab case.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Hash,
    Default,
    serde::Serialize,
    serde::Deserialize,
    strum::Display,
    strum::IntoStaticStr,
    strum::VariantArray,
)]
#[serde(rename_all = "kebab-case")]
#[strum(serialize_all = "kebab-case")]
pub enum ManagerKind {
    /// Every technique: tolerance-aware compression, AoT write-out, LCTRU, the
    /// read-and-recompute pipeline.
    #[default]
    Llms,
    /// LLMS with every chunk kept in the sealing format (no tolerance-aware compression).
    LlmsNoCompression,
    /// LLMS that reads every stored chunk back (no recompute beside the reads).
    LlmsNoPipeline,
    /// LLMS without the chunk lifecycle: no AoT write-out (victims are written when reclaimed)
    /// and plain LRU instead of LCTRU.
    LlmsNoLifecycle,
    /// vLLM-style paging with int8 chunks: written out only when reclaimed, read back whole.
    VllmSq,
    /// vLLM-style paging with f16 chunks.
    VllmS,
    /// Whole contexts, f16, swapped out when reclaimed and read back whole.
    Swapping,
    /// Android's low-memory killer: a whole context is dropped and re-prefilled from its text.
    Lmk,
}

impl ManagerKind {
    /// Its name on the command line and in reports.
    pub fn name(self) -> &'static str {
        self.into()
    }

    /// The chunk format a baseline is defined by (LLMS and its ablations seal in the configured
    /// format).
    pub fn fixed_format(self) -> Option<KvFormat> {
        match self {
            ManagerKind::VllmSq => Some(KvFormat::Int8),
            ManagerKind::VllmS | ManagerKind::Swapping | ManagerKind::Lmk => Some(KvFormat::F16),
            _ => None,
        }
    }

    /// One line on what it does.
    pub fn describe(self) -> &'static str {
        match self {
            ManagerKind::Llms => {
                "chunks compressed by attention, written ahead of time, LCTRU victims, \
                 loaded by reads and recomputes at once"
            }
            ManagerKind::LlmsNoCompression => "llms with every chunk kept in its sealing format",
            ManagerKind::LlmsNoPipeline => "llms that reads every stored chunk (no recompute)",
            ManagerKind::LlmsNoLifecycle => {
                "llms with no ahead-of-time writes (victims written when reclaimed), LRU victims"
            }
            ManagerKind::VllmSq => {
                "int8 chunks, LRU, written when reclaimed, every missing chunk read back"
            }
            ManagerKind::VllmS => {
                "f16 chunks, LRU, written when reclaimed, every missing chunk read back"
            }
            ManagerKind::Swapping => {
                "whole contexts in f16, the least recent swapped out and read back whole"
            }
            ManagerKind::Lmk => {
                "whole contexts in f16, the least recent killed and re-prefilled from its text"
            }
        }
    }

    /// Sets `cfg` up as this manager (format, compression, victims, write-out, load). The
    /// format of LLMS and its ablations is left as configured.
    pub fn apply(self, cfg: &mut ManagerConfig) {
        cfg.kind = self;
        if let Some(f) = self.fixed_format() {
            cfg.kv_format = f;
        }
        let compress = cfg.kv_format != KvFormat::F16;
        let (ratio, victims, write_out, load) = match self {
            ManagerKind::Llms => (
                compress,
                VictimPolicy::Lctru,
                WriteOut::Aot,
                LoadMode::Planned,
            ),
            ManagerKind::LlmsNoCompression => {
                (false, VictimPolicy::Lctru, WriteOut::Aot, LoadMode::Planned)
            }
            ManagerKind::LlmsNoPipeline => (
                compress,
                VictimPolicy::Lctru,
                WriteOut::Aot,
                LoadMode::ReadOnly,
            ),
            ManagerKind::LlmsNoLifecycle => (
                compress,
                VictimPolicy::Lru,
                WriteOut::OnReclaim,
                LoadMode::Planned,
            ),
            ManagerKind::VllmSq | ManagerKind::VllmS => (
                false,
                VictimPolicy::Lru,
                WriteOut::OnReclaim,
                LoadMode::ReadOnly,
            ),
            ManagerKind::Swapping => (
                false,
                VictimPolicy::Context,
                WriteOut::OnReclaim,
                LoadMode::ReadOnly,
            ),
            ManagerKind::Lmk => (
                false,
                VictimPolicy::Context,
                WriteOut::Never,
                LoadMode::RecomputeOnly,
            ),
        };
        cfg.compress_bits = if ratio {
            Some(cfg.compress_bits.unwrap_or(DEFAULT_KV_BITS))
        } else {
            None
        };
        cfg.victims = victims;
        cfg.write_out = write_out;
        cfg.load = load;
        // The paper's baselines keep one copy per context, as they were measured; forks share
        // whatever the manager.
        cfg.share_prefixes = !matches!(
            self,
            ManagerKind::VllmSq | ManagerKind::VllmS | ManagerKind::Swapping | ManagerKind::Lmk
        );
    }
}

/// An unknown manager name.
#[derive(Debug, thiserror::Error)]
#[error("no manager {0:?}; the managers are {names}", names = names())]
pub struct UnknownManager(pub String);

fn names() -> String {
    ManagerKind::VARIANTS
        .iter()
        .map(|k| k.name())
        .collect::<Vec<_>>()
        .join(", ")
}

impl FromStr for ManagerKind {
    type Err = UnknownManager;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim().to_ascii_lowercase().replace('_', "-");
        ManagerKind::VARIANTS
            .iter()
            .copied()
            .find(|k| k.name() == t)
            .ok_or_else(|| UnknownManager(s.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_list_the_choices() {
        for &k in ManagerKind::VARIANTS {
            assert_eq!(k.name().parse::<ManagerKind>().unwrap(), k);
            assert_eq!(k.to_string(), k.name());
            let json = serde_json::to_string(&k).unwrap();
            assert_eq!(json, format!("\"{}\"", k.name()));
        }
        assert_eq!(
            "VLLM_SQ".parse::<ManagerKind>().unwrap(),
            ManagerKind::VllmSq
        );
        let e = "vllm".parse::<ManagerKind>().unwrap_err().to_string();
        assert!(e.contains("vllm-sq") && e.contains("lmk"), "{e}");
    }

    #[test]
    fn each_baseline_is_a_configuration_of_the_one_manager() {
        let base = ManagerConfig::new("/nonexistent", 1 << 20);
        let of = |k: ManagerKind| {
            let mut c = base.clone();
            k.apply(&mut c);
            c
        };
        let llms = of(ManagerKind::Llms);
        assert_eq!(
            (
                llms.kv_format,
                llms.compress_bits,
                llms.victims,
                llms.write_out,
                llms.load
            ),
            (
                KvFormat::Int8,
                Some(4.5),
                VictimPolicy::Lctru,
                WriteOut::Aot,
                LoadMode::Planned
            )
        );
        assert_eq!(of(ManagerKind::LlmsNoCompression).compress_bits, None);
        assert_eq!(of(ManagerKind::LlmsNoPipeline).load, LoadMode::ReadOnly);
        assert_eq!(
            of(ManagerKind::LlmsNoLifecycle).write_out,
            WriteOut::OnReclaim
        );
        let sq = of(ManagerKind::VllmSq);
        assert_eq!((sq.kv_format, sq.compress_bits), (KvFormat::Int8, None));
        assert_eq!(of(ManagerKind::VllmS).kv_format, KvFormat::F16);
        assert_eq!(of(ManagerKind::Swapping).victims, VictimPolicy::Context);
        let lmk = of(ManagerKind::Lmk);
        assert_eq!(
            (lmk.write_out, lmk.load, lmk.kind),
            (WriteOut::Never, LoadMode::RecomputeOnly, ManagerKind::Lmk)
        );
        // LLMS sealing in f16 has no lower level to compress to.
        let mut f16 = base.clone();
        f16.kv_format = KvFormat::F16;
        ManagerKind::Llms.apply(&mut f16);
        assert_eq!(f16.compress_bits, None);
        // LLMS compresses int8 chunks to the coded formats.
        assert_eq!(llms.levels, KvFormat::CODED);
    }
}
