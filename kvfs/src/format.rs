//! The on-disk encodings of kvfs: the chunk header (at the start of each slot of a data file), the
//! context metadata file and the tokens file.
//!
//! Every integer is little-endian.
//! Every file carries a crc32c, so a torn or flipped file is detected before anything in it is trusted.

use std::fmt;
use std::str::FromStr;

use strum::VariantArray;

/// Magic bytes at the start of every chunk header.
pub const CHUNK_MAGIC: [u8; 8] = *b"KVFSCHNK";
/// Magic bytes at the start of every context metadata file.
pub const META_MAGIC: [u8; 8] = *b"KVFSCTXM";
/// Magic bytes at the start of every tokens file.
pub const TOKENS_MAGIC: [u8; 8] = *b"KVFSTOKS";
/// Version of the metadata and tokens files written by this code.
pub const FORMAT_VERSION: u16 = 1;
/// Version of the chunk headers written by this code: version 2 records when the chunk was written
/// (bytes 100..104, under the header's crc); version-1 headers, which do not, are still read.
pub const HEADER_VERSION: u16 = 2;
/// Size of a chunk header in bytes.
pub const HEADER_LEN: usize = 104;
/// Length of a model fingerprint in bytes.
pub const FINGERPRINT_LEN: usize = 32;

/// An error decoding one of the on-disk encodings.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FormatError {
    #[error("{what} is {len} bytes, shorter than its {need}-byte minimum")]
    Truncated {
        what: &'static str,
        len: usize,
        need: usize,
    },
    #[error("{what} has bad magic bytes {found:02x?}")]
    BadMagic { what: &'static str, found: [u8; 8] },
    #[error("{what} has format version {found}, this build reads versions up to {max}")]
    BadVersion {
        what: &'static str,
        found: u16,
        max: u16,
    },
    #[error("{what} checksum mismatch: stored {stored:#010x}, computed {computed:#010x}")]
    Checksum {
        what: &'static str,
        stored: u32,
        computed: u32,
    },
    #[error("{what} has length {len}, its header says {expected}")]
    Length {
        what: &'static str,
        len: usize,
        expected: usize,
    },
    #[error("unknown {what} tag {tag}")]
    UnknownTag { what: &'static str, tag: u8 },
    #[error("app name is not valid utf-8")]
    AppName,
}

/// The model a chunk was computed by: opaque bytes chosen by the caller (a hash of the weights, say).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint(pub [u8; FINGERPRINT_LEN]);

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({self})")
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in &self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

/// The quantization format of a KV chunk's bytes: the one type every crate names formats by
/// (the engine re-exports it as `model::kv::KvFormat`). kvfs records it and knows what its name
/// says (bits per key and per value); the byte layouts are the engine's (`kv::codec`).
///
/// `K8v8`, `K4v4` and `K4v3` are the formats with 8-bit coded parameters (key bits, value bits).
/// Every format is in `<KvFormat as strum::VariantArray>::VARIANTS`, in tag order; its name
/// ([`KvFormat::name`], `Display`, serde) is the variant's in lowercase.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    serde::Serialize,
    serde::Deserialize,
    strum::Display,
    strum::IntoStaticStr,
    strum::VariantArray,
)]
#[serde(rename_all = "lowercase")]
#[strum(serialize_all = "lowercase")]
pub enum KvFormat {
    /// IEEE half precision: the reference and the uncompressed baseline.
    F16,
    /// 8-bit: the base format; keys per channel, values per token, symmetric, f32 scales.
    Int8,
    /// 4-bit packed: asymmetric, keys per channel, values per token, f16 min and scale.
    Int4,
    /// 2-bit packed: as int4 with four levels.
    Int2,
    /// 8-bit keys and values, asymmetric, with 8-bit coded parameters.
    K8v8,
    /// 4-bit keys and values with 8-bit coded parameters.
    K4v4,
    /// 4-bit keys and 3-bit values with 8-bit coded parameters.
    K4v3,
}

impl KvFormat {
    /// The coded formats, the levels of the tolerance-aware mix, heaviest first.
    pub const CODED: [KvFormat; 3] = [KvFormat::K8v8, KvFormat::K4v4, KvFormat::K4v3];

    /// Bits per stored key, not counting parameters.
    #[inline]
    pub fn key_bits(self) -> u32 {
        match self {
            KvFormat::F16 => 16,
            KvFormat::Int8 | KvFormat::K8v8 => 8,
            KvFormat::Int4 | KvFormat::K4v4 | KvFormat::K4v3 => 4,
            KvFormat::Int2 => 2,
        }
    }

    /// Bits per stored value, not counting parameters.
    #[inline]
    pub fn value_bits(self) -> u32 {
        match self {
            KvFormat::K4v3 => 3,
            f => f.key_bits(),
        }
    }

    /// Mean bits per stored K/V value, not counting parameters.
    pub fn bits(self) -> f64 {
        f64::from(self.key_bits() + self.value_bits()) / 2.0
    }

    /// The format of a bit width among f16, int8, int4 and int2 (the paper's levels).
    pub fn from_bits(bits: u32) -> Option<KvFormat> {
        KvFormat::VARIANTS[..4]
            .iter()
            .copied()
            .find(|f| f.key_bits() == bits)
    }

    /// Whether the group parameters are 8-bit codes against a per-head `amax`.
    #[inline]
    pub fn coded(self) -> bool {
        matches!(self, KvFormat::K8v8 | KvFormat::K4v4 | KvFormat::K4v3)
    }

    /// The on-disk tag.
    pub fn tag(self) -> u8 {
        match self {
            KvFormat::F16 => 0,
            KvFormat::Int8 => 1,
            KvFormat::Int4 => 2,
            KvFormat::Int2 => 3,
            KvFormat::K8v8 => 4,
            KvFormat::K4v4 => 5,
            KvFormat::K4v3 => 6,
        }
    }

    /// The format of an on-disk tag.
    pub fn from_tag(tag: u8) -> Result<Self, FormatError> {
        Self::VARIANTS
            .iter()
            .copied()
            .find(|f| f.tag() == tag)
            .ok_or(FormatError::UnknownTag {
                what: "kv format",
                tag,
            })
    }

    /// The name used in `info`, xattrs and the command line.
    pub fn name(self) -> &'static str {
        self.into()
    }
}

/// The name is not one of `f16`, `int8`, `int4`, `int2`, `k8v8`, `k4v4`, `k4v3`.
#[derive(Debug, thiserror::Error)]
#[error("unknown kv format {name:?}: expected f16, int8, int4, int2, k8v8, k4v4 or k4v3")]
pub struct UnknownFormat {
    pub name: String,
}

impl FromStr for KvFormat {
    type Err = UnknownFormat;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::VARIANTS
            .iter()
            .copied()
            .find(|f| f.name() == s.trim())
            .ok_or_else(|| UnknownFormat { name: s.to_owned() })
    }
}

/// How a chunk's payload is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, strum::IntoStaticStr)]
#[strum(serialize_all = "lowercase")]
pub enum Codec {
    /// The plain bytes, when compression would not pay.
    Raw,
    /// A zstd frame.
    Zstd,
}

impl Codec {
    fn tag(self) -> u8 {
        match self {
            Codec::Raw => 0,
            Codec::Zstd => 1,
        }
    }

    fn from_tag(tag: u8) -> Result<Self, FormatError> {
        match tag {
            0 => Ok(Codec::Raw),
            1 => Ok(Codec::Zstd),
            tag => Err(FormatError::UnknownTag { what: "codec", tag }),
        }
    }

    /// The name used in `info`.
    pub fn name(self) -> &'static str {
        self.into()
    }
}

/// The header at the start of every chunk slot; the payload follows its page.
///
/// Layout (104 bytes): magic 8, version u16, header length u16, format u8, codec u8, reserved u16,
/// context u64, index u32, token start u32, token end u32, tokens crc u32, density f32,
/// raw length u32, stored length u32, payload crc u32, generation u64, fingerprint 32,
/// header crc u32 (of the 96 bytes before it, then of bytes 100..104 in version 2), written u32
/// (version 2; zero in version 1).
#[derive(Clone, Debug, PartialEq)]
pub struct ChunkHeader {
    pub format: KvFormat,
    pub codec: Codec,
    pub context: u64,
    pub index: u32,
    pub token_start: u32,
    pub token_end: u32,
    /// crc32c of the token ids `token_start..token_end` the chunk was computed from.
    pub tokens_crc: u32,
    pub density: f32,
    pub raw_len: u32,
    pub stored_len: u32,
    pub payload_crc: u32,
    /// Store-wide write sequence number: a larger one is a later write.
    pub generation: u64,
    pub fingerprint: Fingerprint,
    /// When the store wrote the chunk, in seconds since the Unix epoch; 0 when unknown (a
    /// version-1 header).
    pub written: u32,
}

/// The crc a header of `version` carries: of bytes 0..96, and in version 2 of `written` too.
fn header_crc(b: &[u8], version: u16) -> u32 {
    let crc = crc32c::crc32c(&b[..96]);
    if version >= 2 {
        crc32c::crc32c_append(crc, &b[100..104])
    } else {
        crc
    }
}

impl ChunkHeader {
    /// The header's bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..8].copy_from_slice(&CHUNK_MAGIC);
        b[8..10].copy_from_slice(&HEADER_VERSION.to_le_bytes());
        b[10..12].copy_from_slice(&(HEADER_LEN as u16).to_le_bytes());
        b[12] = self.format.tag();
        b[13] = self.codec.tag();
        b[16..24].copy_from_slice(&self.context.to_le_bytes());
        b[24..28].copy_from_slice(&self.index.to_le_bytes());
        b[28..32].copy_from_slice(&self.token_start.to_le_bytes());
        b[32..36].copy_from_slice(&self.token_end.to_le_bytes());
        b[36..40].copy_from_slice(&self.tokens_crc.to_le_bytes());
        b[40..44].copy_from_slice(&self.density.to_le_bytes());
        b[44..48].copy_from_slice(&self.raw_len.to_le_bytes());
        b[48..52].copy_from_slice(&self.stored_len.to_le_bytes());
        b[52..56].copy_from_slice(&self.payload_crc.to_le_bytes());
        b[56..64].copy_from_slice(&self.generation.to_le_bytes());
        b[64..96].copy_from_slice(&self.fingerprint.0);
        b[100..104].copy_from_slice(&self.written.to_le_bytes());
        let crc = header_crc(&b, HEADER_VERSION);
        b[96..100].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Decodes and checks a header from the start of a chunk slot.
    pub fn decode(b: &[u8]) -> Result<Self, FormatError> {
        let what = "chunk header";
        if b.len() < HEADER_LEN {
            return Err(FormatError::Truncated {
                what,
                len: b.len(),
                need: HEADER_LEN,
            });
        }
        check_magic(what, b, &CHUNK_MAGIC)?;
        let version = u16_at(b, 8);
        if !(1..=HEADER_VERSION).contains(&version) {
            return Err(FormatError::BadVersion {
                what,
                found: version,
                max: HEADER_VERSION,
            });
        }
        let header_len = u16_at(b, 10) as usize;
        if header_len != HEADER_LEN {
            return Err(FormatError::Length {
                what,
                len: header_len,
                expected: HEADER_LEN,
            });
        }
        let stored = u32_at(b, 96);
        let computed = header_crc(b, version);
        if stored != computed {
            return Err(FormatError::Checksum {
                what,
                stored,
                computed,
            });
        }
        let mut fingerprint = [0u8; FINGERPRINT_LEN];
        fingerprint.copy_from_slice(&b[64..96]);
        Ok(ChunkHeader {
            format: KvFormat::from_tag(b[12])?,
            codec: Codec::from_tag(b[13])?,
            context: u64_at(b, 16),
            index: u32_at(b, 24),
            token_start: u32_at(b, 28),
            token_end: u32_at(b, 32),
            tokens_crc: u32_at(b, 36),
            density: f32::from_le_bytes(b[40..44].try_into().expect("4 bytes")),
            raw_len: u32_at(b, 44),
            stored_len: u32_at(b, 48),
            payload_crc: u32_at(b, 52),
            generation: u64_at(b, 56),
            fingerprint: Fingerprint(fingerprint),
            written: if version >= 2 { u32_at(b, 100) } else { 0 },
        })
    }

    /// Checks the payload that follows the header: its length and its crc.
    pub fn check_payload(&self, payload: &[u8]) -> Result<(), FormatError> {
        if payload.len() != self.stored_len as usize {
            return Err(FormatError::Length {
                what: "chunk payload",
                len: payload.len(),
                expected: self.stored_len as usize,
            });
        }
        let computed = crc32c::crc32c(payload);
        if computed != self.payload_crc {
            return Err(FormatError::Checksum {
                what: "chunk payload",
                stored: self.payload_crc,
                computed,
            });
        }
        Ok(())
    }
}

/// The crc32c of a run of token ids, as recorded in a chunk header.
pub fn tokens_crc(tokens: &[u32]) -> u32 {
    let mut crc = 0;
    for t in tokens {
        crc = crc32c::crc32c_append(crc, &t.to_le_bytes());
    }
    crc
}

/// A context's fixed metadata, written once when the context is created.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContextMeta {
    pub owner_uid: u32,
    pub app: String,
    pub fingerprint: Fingerprint,
    /// Tokens per chunk.
    pub chunk_tokens: u32,
    /// Seconds since the Unix epoch.
    pub created: u64,
}

impl ContextMeta {
    /// Layout: magic 8, version u16, app length u16, owner u32, chunk tokens u32, created u64,
    /// fingerprint 32, app bytes, crc u32 of everything before it.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(64 + self.app.len());
        b.extend_from_slice(&META_MAGIC);
        b.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        b.extend_from_slice(&(self.app.len() as u16).to_le_bytes());
        b.extend_from_slice(&self.owner_uid.to_le_bytes());
        b.extend_from_slice(&self.chunk_tokens.to_le_bytes());
        b.extend_from_slice(&self.created.to_le_bytes());
        b.extend_from_slice(&self.fingerprint.0);
        b.extend_from_slice(self.app.as_bytes());
        let crc = crc32c::crc32c(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        b
    }

    /// Decodes and checks a metadata file.
    pub fn decode(b: &[u8]) -> Result<Self, FormatError> {
        let what = "context metadata";
        const FIXED: usize = 60;
        if b.len() < FIXED + 4 {
            return Err(FormatError::Truncated {
                what,
                len: b.len(),
                need: FIXED + 4,
            });
        }
        check_magic(what, b, &META_MAGIC)?;
        check_trailing_crc(what, b)?;
        let version = u16_at(b, 8);
        if version != FORMAT_VERSION {
            return Err(FormatError::BadVersion {
                what,
                found: version,
                max: FORMAT_VERSION,
            });
        }
        let app_len = u16_at(b, 10) as usize;
        if b.len() != FIXED + app_len + 4 {
            return Err(FormatError::Length {
                what,
                len: b.len(),
                expected: FIXED + app_len + 4,
            });
        }
        let mut fingerprint = [0u8; FINGERPRINT_LEN];
        fingerprint.copy_from_slice(&b[28..60]);
        let app =
            std::str::from_utf8(&b[FIXED..FIXED + app_len]).map_err(|_| FormatError::AppName)?;
        Ok(ContextMeta {
            owner_uid: u32_at(b, 12),
            chunk_tokens: u32_at(b, 16),
            created: u64_at(b, 20),
            fingerprint: Fingerprint(fingerprint),
            app: app.to_owned(),
        })
    }
}

/// The magic of a context's `link` file.
pub const LINK_MAGIC: [u8; 8] = *b"KVFSLINK";

/// A context's borrowed prefix: its first `chunks` chunks are those of `base`, a shared-prefix
/// context (its `link` file; docs/kvfs.md, "Shared prefixes").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Link {
    pub base: u64,
    pub chunks: u32,
}

impl Link {
    /// Layout: magic 8, version u16, reserved u16, base u64, chunks u32, crc u32 of everything
    /// before it (28 bytes).
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(28);
        b.extend_from_slice(&LINK_MAGIC);
        b.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        b.extend_from_slice(&0u16.to_le_bytes());
        b.extend_from_slice(&self.base.to_le_bytes());
        b.extend_from_slice(&self.chunks.to_le_bytes());
        let crc = crc32c::crc32c(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        b
    }

    /// Decodes and checks a `link` file.
    pub fn decode(b: &[u8]) -> Result<Self, FormatError> {
        let what = "link file";
        if b.len() != 28 {
            return Err(FormatError::Length {
                what,
                len: b.len(),
                expected: 28,
            });
        }
        check_magic(what, b, &LINK_MAGIC)?;
        check_trailing_crc(what, b)?;
        let version = u16_at(b, 8);
        if version != FORMAT_VERSION {
            return Err(FormatError::BadVersion {
                what,
                found: version,
                max: FORMAT_VERSION,
            });
        }
        Ok(Link {
            base: u64_at(b, 12),
            chunks: u32_at(b, 20),
        })
    }
}

/// Encodes a tokens file: magic 8, version u16, reserved u16, count u32, the ids (u32 each),
/// crc u32 of everything before it.
pub fn encode_tokens(tokens: &[u32]) -> Vec<u8> {
    let mut b = Vec::with_capacity(20 + 4 * tokens.len());
    b.extend_from_slice(&TOKENS_MAGIC);
    b.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    b.extend_from_slice(&0u16.to_le_bytes());
    b.extend_from_slice(&(tokens.len() as u32).to_le_bytes());
    for t in tokens {
        b.extend_from_slice(&t.to_le_bytes());
    }
    let crc = crc32c::crc32c(&b);
    b.extend_from_slice(&crc.to_le_bytes());
    b
}

/// Decodes and checks a tokens file.
pub fn decode_tokens(b: &[u8]) -> Result<Vec<u32>, FormatError> {
    let what = "tokens file";
    if b.len() < 20 {
        return Err(FormatError::Truncated {
            what,
            len: b.len(),
            need: 20,
        });
    }
    check_magic(what, b, &TOKENS_MAGIC)?;
    check_trailing_crc(what, b)?;
    let version = u16_at(b, 8);
    if version != FORMAT_VERSION {
        return Err(FormatError::BadVersion {
            what,
            found: version,
            max: FORMAT_VERSION,
        });
    }
    let count = u32_at(b, 12) as usize;
    if b.len() != 20 + 4 * count {
        return Err(FormatError::Length {
            what,
            len: b.len(),
            expected: 20 + 4 * count,
        });
    }
    Ok(b[16..16 + 4 * count]
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

fn check_magic(what: &'static str, b: &[u8], magic: &[u8; 8]) -> Result<(), FormatError> {
    let mut found = [0u8; 8];
    found.copy_from_slice(&b[..8]);
    if &found != magic {
        return Err(FormatError::BadMagic { what, found });
    }
    Ok(())
}

fn check_trailing_crc(what: &'static str, b: &[u8]) -> Result<(), FormatError> {
    let (body, tail) = b.split_at(b.len() - 4);
    let stored = u32::from_le_bytes([tail[0], tail[1], tail[2], tail[3]]);
    let computed = crc32c::crc32c(body);
    if stored != computed {
        return Err(FormatError::Checksum {
            what,
            stored,
            computed,
        });
    }
    Ok(())
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_link_round_trips_and_a_flipped_bit_is_refused() {
        let l = Link {
            base: 42,
            chunks: 63,
        };
        let mut b = l.encode();
        assert_eq!(Link::decode(&b).unwrap(), l);
        b[14] ^= 1;
        assert!(matches!(
            Link::decode(&b),
            Err(FormatError::Checksum { .. })
        ));
        assert!(Link::decode(&b[..27]).is_err());
    }

    fn header() -> ChunkHeader {
        ChunkHeader {
            format: KvFormat::Int4,
            codec: Codec::Zstd,
            context: 7,
            index: 3,
            token_start: 48,
            token_end: 64,
            tokens_crc: tokens_crc(&[1, 2, 3]),
            density: 0.25,
            raw_len: 4096,
            stored_len: 1000,
            payload_crc: 0xdead_beef,
            generation: 42,
            fingerprint: Fingerprint([9; 32]),
            written: 1_764_000_000,
        }
    }

    #[test]
    fn header_round_trips() {
        let h = header();
        assert_eq!(ChunkHeader::decode(&h.encode()), Ok(h));
    }

    #[test]
    fn every_flipped_header_bit_is_detected() {
        let bytes = header().encode();
        // Every bit but the crc's own: bytes 0..96 and the written time at 100..104.
        for bit in (0..96 * 8).chain(100 * 8..104 * 8) {
            let mut b = bytes;
            b[bit / 8] ^= 1 << (bit % 8);
            assert!(ChunkHeader::decode(&b).is_err(), "bit {bit} not detected");
        }
    }

    /// A header written before version 2 (no written time, its crc over bytes 0..96 only) is
    /// still read, with the time unknown.
    #[test]
    fn a_version_1_header_reads_with_no_written_time() {
        let mut b = header().encode();
        b[8..10].copy_from_slice(&1u16.to_le_bytes());
        b[100..104].fill(0);
        let crc = crc32c::crc32c(&b[..96]);
        b[96..100].copy_from_slice(&crc.to_le_bytes());
        let old = ChunkHeader::decode(&b).unwrap();
        assert_eq!(old.written, 0);
        assert_eq!(
            ChunkHeader { written: 0, ..old },
            ChunkHeader {
                written: 0,
                ..header()
            }
        );
        // A version-2 header's crc covers its written time: one over bytes 0..96 alone fails.
        let mut b = header().encode();
        let crc = crc32c::crc32c(&b[..96]);
        b[96..100].copy_from_slice(&crc.to_le_bytes());
        assert!(matches!(
            ChunkHeader::decode(&b),
            Err(FormatError::Checksum { .. })
        ));
    }

    #[test]
    fn header_errors() {
        fn check(mut edit: impl FnMut(&mut Vec<u8>), expected: &str) {
            let mut b = header().encode().to_vec();
            edit(&mut b);
            let err = ChunkHeader::decode(&b).unwrap_err().to_string();
            assert!(
                err.contains(expected),
                "{err:?} does not contain {expected:?}"
            );
        }
        check(|b| b.truncate(50), "shorter than");
        check(|b| b[0] = b'X', "magic");
        check(|b| b[8] = 9, "version 9");
        check(|b| b[20] ^= 1, "checksum");
    }

    #[test]
    fn payload_check_detects_length_and_bits() {
        let payload = vec![5u8; 100];
        let mut h = header();
        h.stored_len = 100;
        h.payload_crc = crc32c::crc32c(&payload);
        assert_eq!(h.check_payload(&payload), Ok(()));
        assert!(matches!(
            h.check_payload(&payload[..99]),
            Err(FormatError::Length { .. })
        ));
        let mut flipped = payload.clone();
        flipped[17] ^= 0x10;
        assert!(matches!(
            h.check_payload(&flipped),
            Err(FormatError::Checksum { .. })
        ));
    }

    #[test]
    fn format_names_parse_back() {
        for &f in KvFormat::VARIANTS {
            assert_eq!(f.name().parse::<KvFormat>().unwrap(), f);
            assert_eq!(KvFormat::from_tag(f.tag()).unwrap(), f);
        }
        assert!("int3".parse::<KvFormat>().is_err());
        assert!(KvFormat::from_tag(7).is_err());
        let tags: Vec<u8> = KvFormat::VARIANTS.iter().map(|f| f.tag()).collect();
        assert_eq!(tags, [0, 1, 2, 3, 4, 5, 6]);
    }

    proptest! {
        #[test]
        fn tokens_round_trip(tokens in proptest::collection::vec(any::<u32>(), 0..300)) {
            prop_assert_eq!(decode_tokens(&encode_tokens(&tokens)), Ok(tokens));
        }

        #[test]
        fn tokens_detect_any_flip(tokens in proptest::collection::vec(any::<u32>(), 1..50), at in any::<usize>(), bit in 0u8..8) {
            let mut b = encode_tokens(&tokens);
            let at = at % b.len();
            b[at] ^= 1 << bit;
            prop_assert!(decode_tokens(&b).is_err());
        }

        #[test]
        fn meta_round_trips(owner in any::<u32>(), app in "[a-z.]{0,40}", fp in any::<[u8; 32]>(), ct in 1u32..1024, created in any::<u64>()) {
            let m = ContextMeta { owner_uid: owner, app, fingerprint: Fingerprint(fp), chunk_tokens: ct, created };
            prop_assert_eq!(ContextMeta::decode(&m.encode()), Ok(m));
        }
    }
}
