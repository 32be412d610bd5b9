//! The context managers the paper compares (§4, Fig. 9-13), as configurations of the one
//! manager: the same engine, pager, store and Load pipeline, with settings for the chunk format,
//! compression, victim choice, write-out and how missing chunks come back. `llms serve
//! --manager NAME` picks one; `llms bench switch` replays a trace against each.

use std::fmt;
use std::str::FromStr;

use crate::kv::KvFormat;
use crate::service::load::LoadMode;
use crate::service::manager::{ManagerConfig, VictimPolicy, WriteOut};

/// A context manager: LLMS, its ablations, and the baselines.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "kebab-case")]
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
    /// Every manager, LLMS first.
    pub const ALL: [ManagerKind; 8] = [
        ManagerKind::Llms,
        ManagerKind::LlmsNoCompression,
        ManagerKind::LlmsNoPipeline,
        ManagerKind::LlmsNoLifecycle,
        ManagerKind::VllmSq,
        ManagerKind::VllmS,
        ManagerKind::Swapping,
        ManagerKind::Lmk,
    ];

    /// Its name on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            ManagerKind::Llms => "llms",
            ManagerKind::LlmsNoCompression => "llms-no-compression",
            ManagerKind::LlmsNoPipeline => "llms-no-pipeline",
            ManagerKind::LlmsNoLifecycle => "llms-no-lifecycle",
            ManagerKind::VllmSq => "vllm-sq",
            ManagerKind::VllmS => "vllm-s",
            ManagerKind::Swapping => "swapping",
            ManagerKind::Lmk => "lmk",
        }
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
                "16-token chunks compressed by attention, written ahead of time, LCTRU victims, \
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
            Some(
                cfg.compress_bits
                    .unwrap_or(crate::service::manager::DEFAULT_KV_BITS),
            )
        } else {
            None
        };
        cfg.victims = victims;
        cfg.write_out = write_out;
        cfg.load = load;
    }
}

impl fmt::Display for ManagerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An unknown manager name.
#[derive(Debug, thiserror::Error)]
#[error("no manager {0:?}; the managers are {names}", names = names())]
pub struct UnknownManager(pub String);

fn names() -> String {
    ManagerKind::ALL
        .iter()
        .map(|k| k.name())
        .collect::<Vec<_>>()
        .join(", ")
}

impl FromStr for ManagerKind {
    type Err = UnknownManager;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim().to_ascii_lowercase().replace('_', "-");
        ManagerKind::ALL
            .into_iter()
            .find(|k| k.name() == t)
            .ok_or_else(|| UnknownManager(s.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_list_the_choices() {
        for k in ManagerKind::ALL {
            assert_eq!(k.name().parse::<ManagerKind>().unwrap(), k);
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
