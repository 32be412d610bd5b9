//! What people inspecting the store see: the decoder and residency hooks, and the `info`, `text`,
//! `tokens` and `stats` files the mount shows.

use std::sync::atomic::{AtomicU64, Ordering};

use strum::VariantArray;

use super::{
    ContextId, Decoder, Residency, Store, StoreError, StoreState, StoredContext, TextView, utc,
};
use crate::format::{Fingerprint, KvFormat};

impl Store {
    /// Registers the function that turns token ids into a context's `text`, for the contexts of
    /// model `model`: a context of another model is never decoded by it (its `text` and `info`
    /// say so), since another model's ids mean other words.
    pub fn set_decoder(&self, model: Fingerprint, decoder: Decoder) {
        *self.decoder.write() = Some((model, decoder));
    }

    /// The model whose decoder is registered, if one is.
    pub fn decoder_model(&self) -> Option<Fingerprint> {
        self.decoder.read().as_ref().map(|(fp, _)| *fp)
    }

    /// Registers the function that says whether a chunk is resident in memory (shown in `info`
    /// and the chunk's `user.kvfs.resident`).
    pub fn set_residency(&self, residency: Residency) {
        *self.residency.write() = Some(residency);
    }

    /// Which chunks of `id` are resident, as the registered [`Residency`] says; `None` without
    /// one, or when it does not know.
    pub fn residency(&self, id: ContextId) -> Option<Vec<bool>> {
        let r = self.residency.read().clone()?;
        r(id)
    }

    /// Whether chunk `index` of `id` is resident ([`Store::residency`]).
    pub fn resident(&self, id: ContextId, index: u32) -> Option<bool> {
        self.residency(id)
            .map(|r| r.get(index as usize).copied().unwrap_or(false))
    }

    /// How context `id`'s `text` is shown.
    pub fn text_view(&self, id: ContextId) -> Result<TextView, StoreError> {
        let model = self.fingerprint(id)?;
        Ok(match self.decoder_model() {
            None => TextView::NoDecoder,
            Some(loaded) if loaded == model => TextView::Decoded,
            Some(loaded) => TextView::OtherModel { loaded },
        })
    }

    /// A context's human-readable `info`.
    pub fn render_info(&self, id: ContextId) -> Result<String, StoreError> {
        use std::fmt::Write;
        let info = self.context(id)?;
        let mut s = String::new();
        let m = &info.meta;
        let _ = writeln!(s, "context      {}", info.id);
        let _ = writeln!(s, "owner uid    {}", m.owner_uid);
        let _ = writeln!(s, "app          {}", m.app);
        let _ = writeln!(s, "model        {}", m.fingerprint);
        if self.is_shared(id)? {
            let n = self.referrers(id);
            let _ = writeln!(
                s,
                "shared       a shared prefix: {n} context(s) borrow its chunks"
            );
        }
        if let Some(l) = self.link(id)? {
            let _ = writeln!(
                s,
                "borrows      chunks 0..{} from shared prefix {}",
                l.chunks, l.base
            );
        }
        match self.text_view(id)? {
            TextView::Decoded => {
                let _ = writeln!(s, "text         decoded by this model's tokenizer");
            }
            TextView::NoDecoder => {
                let _ = writeln!(
                    s,
                    "text         not decoded: no tokenizer is loaded (the ids are in tokens)"
                );
            }
            TextView::OtherModel { loaded } => {
                let _ = writeln!(
                    s,
                    "note         the tokenizer loaded is model {loaded}'s, not this context's: \
                     text is not decoded (the ids are in tokens)"
                );
            }
        }
        let _ = writeln!(
            s,
            "created      {} ({} unix seconds)",
            utc(m.created),
            m.created
        );
        let _ = writeln!(s, "tokens       {}", info.tokens);
        let _ = writeln!(s, "chunk tokens {}", m.chunk_tokens);
        let t = Totals::of(std::slice::from_ref(&info));
        t.write(&mut s);
        let _ = writeln!(
            s,
            "\nindex  tokens         state        format  density  codec   raw      stored   resident  written"
        );
        let residency = self.residency(id);
        for c in &info.chunks {
            let span = format!("{}..{}", c.span.start, c.span.end);
            let resident = match &residency {
                Some(r) if r.get(c.index as usize) == Some(&true) => "yes",
                Some(_) => "no",
                None => "-",
            };
            match &c.state {
                StoreState::Stored(sc) => {
                    let _ = writeln!(
                        s,
                        "{:<6} {:<14} {:<12} {:<7} {:<8.4} {:<7} {:<8} {:<8} {:<9} {}",
                        c.index,
                        span,
                        "stored",
                        sc.format.name(),
                        sc.density,
                        sc.codec.name(),
                        sc.raw_len,
                        sc.stored_len,
                        resident,
                        sc.written.map_or_else(|| "-".to_owned(), utc)
                    );
                }
                other => {
                    let _ = writeln!(
                        s,
                        "{:<6} {:<14} {:<12} {:<7} {:<8} {:<7} {:<8} {:<8} {}",
                        c.index,
                        span,
                        other.name(),
                        "-",
                        "-",
                        "-",
                        "-",
                        "-",
                        resident
                    );
                }
            }
        }
        Ok(s)
    }

    /// A context's `text`: its tokens decoded by the decoder registered for its model; without
    /// one, or with another model's, a line that says why there is no text and where the ids are.
    pub fn render_text(&self, id: ContextId) -> Result<String, StoreError> {
        let tokens = self.tokens(id)?;
        let decoder = self.decoder.read().clone();
        let n = tokens.len();
        Ok(match (self.text_view(id)?, decoder) {
            (TextView::Decoded, Some((_, d))) => d(&tokens),
            (TextView::OtherModel { loaded }, _) => format!(
                "kvfs: context {id} was computed by model {}, but the tokenizer loaded is model \
                 {loaded}'s, so its {n} tokens are not decoded; their ids are in `tokens` beside \
                 this file\n",
                self.fingerprint(id)?
            ),
            _ => format!(
                "kvfs: no tokenizer is loaded, so the {n} tokens of context {id} are not decoded \
                 (mount the store with its model to read them); their ids are in `tokens` beside \
                 this file\n"
            ),
        })
    }

    /// A context's `tokens`: its token ids in decimal, separated by spaces, and a newline.
    pub fn render_tokens(&self, id: ContextId) -> Result<String, StoreError> {
        use std::fmt::Write;
        let tokens = self.tokens(id)?;
        let mut s = String::with_capacity(tokens.len() * 6 + 1);
        for (i, t) in tokens.iter().enumerate() {
            let _ = write!(s, "{}{t}", if i == 0 { "" } else { " " });
        }
        s.push('\n');
        Ok(s)
    }

    /// The store-wide `stats`.
    pub fn render_stats(&self) -> String {
        use std::fmt::Write;
        let infos: Vec<StoredContext> = self
            .list_contexts()
            .into_iter()
            .filter_map(|id| self.context(id).ok())
            .collect();
        let mut s = String::new();
        let _ = writeln!(s, "store        {}", self.root.display());
        let _ = writeln!(
            s,
            "direct io    {}",
            if self.direct { "O_DIRECT" } else { "fadvise" }
        );
        let _ = writeln!(s, "contexts     {}", infos.len());
        let _ = writeln!(
            s,
            "tokens       {}",
            infos.iter().map(|i| i.tokens).sum::<usize>()
        );
        Totals::of(&infos).write(&mut s);
        let c = &self.counters;
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let _ = writeln!(
            s,
            "quarantined  {}",
            self.quarantined.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            s,
            "reads        {} ({} bytes)",
            r(&c.chunk_reads),
            r(&c.chunk_read_bytes)
        );
        let _ = writeln!(
            s,
            "writes       {} ({} raw bytes, {} stored)",
            r(&c.chunk_writes),
            r(&c.chunk_write_raw_bytes),
            r(&c.chunk_write_stored_bytes)
        );
        let _ = writeln!(
            s,
            "corrupt      {} detected on read",
            r(&c.corrupt_detected)
        );
        s
    }
}

/// Chunk counts by state and format, and byte totals.
struct Totals {
    stored: usize,
    missing: usize,
    quarantined: usize,
    by_format: [usize; KvFormat::VARIANTS.len()],
    raw: u64,
    stored_bytes: u64,
    density_sum: f64,
}

impl Totals {
    fn of(infos: &[StoredContext]) -> Totals {
        let mut t = Totals {
            stored: 0,
            missing: 0,
            quarantined: 0,
            by_format: [0; KvFormat::VARIANTS.len()],
            raw: 0,
            stored_bytes: 0,
            density_sum: 0.0,
        };
        for c in infos.iter().flat_map(|i| &i.chunks) {
            match &c.state {
                StoreState::Stored(s) => {
                    t.stored += 1;
                    t.by_format[s.format.tag() as usize] += 1;
                    t.raw += s.raw_len as u64;
                    t.stored_bytes += s.stored_len as u64;
                    t.density_sum += s.density as f64;
                }
                StoreState::Missing => t.missing += 1,
                StoreState::Quarantined { .. } => t.quarantined += 1,
            }
        }
        t
    }

    fn write(&self, s: &mut String) {
        use std::fmt::Write;
        let _ = writeln!(
            s,
            "chunks       {} stored, {} missing, {} quarantined",
            self.stored, self.missing, self.quarantined
        );
        let formats: Vec<String> = KvFormat::VARIANTS
            .iter()
            .map(|f| format!("{} {}", f.name(), self.by_format[f.tag() as usize]))
            .collect();
        let _ = writeln!(s, "formats      {}", formats.join(", "));
        let ratio = if self.stored_bytes == 0 {
            1.0
        } else {
            self.raw as f64 / self.stored_bytes as f64
        };
        let _ = writeln!(
            s,
            "bytes        {} raw, {} stored (ratio {ratio:.3})",
            self.raw, self.stored_bytes
        );
        let mean = if self.stored == 0 {
            0.0
        } else {
            self.density_sum / self.stored as f64
        };
        let _ = writeln!(s, "density      {mean:.4} mean over stored chunks");
    }
}
