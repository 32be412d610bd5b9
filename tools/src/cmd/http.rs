//! `llms serve --http` and `llms keys`: the OpenAI-compatible HTTP API's listeners, bound before
//! the model loads so a taken port fails the start at once, and its key file.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use daemon::http::keys::{KeyStore, add_key};
use daemon::http::{HttpConfig, Listen};

use crate::args::{env_dir, is_root};

/// The key file when none is given: `/etc/llms/http-keys` as root, else
/// `$XDG_CONFIG_HOME/llms/http-keys` (`~/.config/llms/http-keys`).
pub fn default_keys() -> anyhow::Result<PathBuf> {
    if is_root() {
        return Ok(PathBuf::from("/etc/llms/http-keys"));
    }
    let config = env_dir("XDG_CONFIG_HOME").or_else(|| env_dir("HOME").map(|h| h.join(".config")));
    match config {
        Some(d) => Ok(d.join("llms/http-keys")),
        None => {
            bail!("no place for the key file: set XDG_CONFIG_HOME or HOME, or pass --http-keys")
        }
    }
}

/// The HTTP API's listeners for `specs` (`unix:PATH` or `HOST:PORT`), bound, with the key file
/// `keys` (or the default one) read when one of them is TCP; `None` without any. Also returns
/// the Unix socket paths, to remove at exit.
pub fn bind(
    specs: &[String],
    keys: Option<&Path>,
    max_body: usize,
    max_connections: usize,
) -> anyhow::Result<Option<(HttpConfig, Vec<PathBuf>)>> {
    if specs.is_empty() {
        return Ok(None);
    }
    let mut listeners = Vec::new();
    let mut paths = Vec::new();
    let mut tcp = false;
    for spec in specs {
        if let Some(path) = spec.strip_prefix("unix:") {
            let path = PathBuf::from(path);
            if path.as_os_str().is_empty() {
                bail!("--http unix: needs a path, as in unix:/run/llms/http.sock");
            }
            crate::args::mkdir_for(&path)?;
            crate::args::clear_stale_socket(&path)?;
            let l = std::os::unix::net::UnixListener::bind(&path)
                .with_context(|| format!("cannot listen for HTTP on {}", path.display()))?;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666))
                .with_context(|| format!("cannot open {} to every user", path.display()))?;
            listeners.push(Listen::Unix(l));
            paths.push(path);
        } else {
            let addr: std::net::SocketAddr = spec.parse().with_context(|| {
                format!("--http {spec}: give unix:PATH or HOST:PORT, as in 127.0.0.1:8080")
            })?;
            if !addr.ip().is_loopback() {
                tracing::warn!(%addr, "the HTTP API listens beyond this machine, unencrypted: keys cross the network in clear text");
            }
            let l = std::net::TcpListener::bind(addr)
                .with_context(|| format!("cannot listen for HTTP on {addr}"))?;
            listeners.push(Listen::Tcp(l));
            tcp = true;
        }
    }
    let keys = if tcp {
        let keys = match keys {
            Some(k) => k.to_owned(),
            None => default_keys()?,
        };
        let keys = keys.as_path();
        let store = KeyStore::open(keys).with_context(|| {
            format!(
                "--http on TCP needs the key file {} (every request needs a key): make one with \
                 `llms keys add --uid UID --file {}`",
                keys.display(),
                keys.display()
            )
        })?;
        tracing::info!(keys = store.len(), file = %keys.display(), "HTTP API keys");
        Some(store)
    } else {
        None
    };
    let cfg = HttpConfig {
        max_body,
        max_connections,
        ..HttpConfig::new(listeners, keys)
    };
    Ok(Some((cfg, paths)))
}

/// `llms keys`.
#[derive(Subcommand, Debug)]
pub enum KeysCommand {
    /// Make a key for the HTTP API over TCP: its requests act as uid UID. Prints the key, once;
    /// the key file keeps only its SHA-256 (mode 0600), and a running daemon reads it again
    Add(AddArgs),
}

#[derive(Args, Debug)]
pub struct AddArgs {
    /// The uid whose contexts the key's requests use
    #[arg(long)]
    uid: u32,
    /// The app name the key's contexts are made under (its own queue lane and context limit)
    #[arg(long, default_value = "http")]
    app: String,
    /// The key file [default: /etc/llms/http-keys as root, else
    /// $XDG_CONFIG_HOME/llms/http-keys]
    #[arg(long, env = "LLMS_HTTP_KEYS", value_name = "FILE")]
    file: Option<PathBuf>,
}

pub fn run(cmd: KeysCommand) -> anyhow::Result<()> {
    match cmd {
        KeysCommand::Add(a) => {
            let file = match a.file {
                Some(f) => f,
                None => default_keys()?,
            };
            let key = add_key(&file, a.uid, &a.app).context("cannot add the key")?;
            eprintln!(
                "added a key for uid {} (app {}) to {}",
                a.uid,
                a.app,
                file.display()
            );
            println!("{key}");
            Ok(())
        }
    }
}
