//! The HTTP API's keys: every request on a TCP listener carries `Authorization: Bearer KEY`, and
//! the key file maps each key to one uid (and the app name its contexts are made under). The
//! file holds only each key's SHA-256, never the key: `llms keys add` prints the key once.
//!
//! Its lines are `UID APP SHA256-HEX` (`#` starts a comment); it is written with mode 0600 by
//! write-then-rename, and read again by the daemon when its modification time changes, so a key
//! added or removed takes effect without a restart.

use std::collections::HashMap;
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use rand::TryRngCore;
use sha2::{Digest, Sha256};

/// What a key stands for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    pub uid: u32,
    /// The app name the key's contexts are made under.
    pub app: String,
}

/// What went wrong with the key file.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("cannot {what} the key file {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the key file {path}, line {line}: {why}")]
    Invalid {
        path: PathBuf,
        line: usize,
        why: String,
    },
    #[error("no randomness for a key: {0}")]
    Random(String),
}

/// The SHA-256 of a key, as stored.
fn digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<[u8; 32]> {
    if s.len() != 64 || !s.is_ascii() {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// Whether `app` is a valid app name (the protocol's rule).
fn valid_app(app: &str) -> bool {
    !app.is_empty()
        && app.len() <= protocol::MAX_APP
        && app
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

/// Parses a key file's text.
fn parse(path: &Path, text: &str) -> Result<HashMap<[u8; 32], Identity>, KeyError> {
    let mut keys = HashMap::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let bad = |why: &str| KeyError::Invalid {
            path: path.to_owned(),
            line: i + 1,
            why: why.to_owned(),
        };
        let words: Vec<&str> = line.split_whitespace().collect();
        let [uid, app, hash] = words[..] else {
            return Err(bad("want `UID APP SHA256-HEX`"));
        };
        let uid = uid.parse().map_err(|_| bad("the uid is not a number"))?;
        if !valid_app(app) {
            return Err(bad("the app name is not 1 to 64 of A-Z a-z 0-9 . _ -"));
        }
        let hash = unhex(hash).ok_or_else(|| bad("the key's hash is not 64 hex digits"))?;
        keys.insert(
            hash,
            Identity {
                uid,
                app: app.to_owned(),
            },
        );
    }
    Ok(keys)
}

/// The keys the daemon accepts, read from their file (again when it changes).
pub struct KeyStore {
    path: PathBuf,
    keys: HashMap<[u8; 32], Identity>,
    modified: Option<SystemTime>,
}

impl KeyStore {
    /// Reads the key file at `path`, which must exist (it may hold no key yet).
    pub fn open(path: &Path) -> Result<KeyStore, KeyError> {
        let mut store = KeyStore {
            path: path.to_owned(),
            keys: HashMap::new(),
            modified: None,
        };
        store.reload()?;
        Ok(store)
    }

    /// How many keys the file holds.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    fn reload(&mut self) -> Result<(), KeyError> {
        let io = |what| {
            let path = self.path.clone();
            move |source| KeyError::Io { what, path, source }
        };
        let md = std::fs::metadata(&self.path).map_err(io("read"))?;
        if md.permissions().mode() & 0o077 != 0 {
            tracing::warn!(path = %self.path.display(), "the key file is readable by others; chmod 600 it");
        }
        let text = std::fs::read_to_string(&self.path).map_err(io("read"))?;
        self.keys = parse(&self.path, &text)?;
        self.modified = md.modified().ok();
        Ok(())
    }

    /// Who `key` is, if the file (read again if it changed) holds it. A file that became
    /// unreadable or invalid keeps the keys last read, and says so in the log.
    pub fn lookup(&mut self, key: &str) -> Option<Identity> {
        let modified = std::fs::metadata(&self.path)
            .and_then(|m| m.modified())
            .ok();
        if modified != self.modified
            && let Err(e) = self.reload()
        {
            tracing::warn!(error = %e, "keeping the keys read before");
            self.modified = modified;
        }
        self.keys.get(&digest(key)).cloned()
    }
}

/// Makes a new key for `uid` (its contexts under `app`), adds its hash to the key file at
/// `path` (created with mode 0600 if missing, rewritten by write-then-rename) and returns the
/// key, which is stored nowhere else.
pub fn add_key(path: &Path, uid: u32, app: &str) -> Result<String, KeyError> {
    if !valid_app(app) {
        return Err(KeyError::Invalid {
            path: path.to_owned(),
            line: 0,
            why: format!("the app name {app:?} is not 1 to 64 of A-Z a-z 0-9 . _ -"),
        });
    }
    let io = |what| {
        move |source| KeyError::Io {
            what,
            path: path.to_owned(),
            source,
        }
    };
    let mut bytes = [0u8; 32];
    rand::rngs::OsRng
        .try_fill_bytes(&mut bytes)
        .map_err(|e| KeyError::Random(e.to_string()))?;
    let key = format!("llms-{}", hex(&bytes));
    let old = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            "# llms HTTP API keys: UID APP SHA256-OF-THE-KEY, one a line (llms keys add)\n".into()
        }
        Err(e) => return Err(io("read")(e)),
    };
    parse(path, &old)?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(io("create the folder of"))?;
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(io("write"))?;
    f.set_permissions(std::fs::Permissions::from_mode(0o600))
        .map_err(io("write"))?;
    let mut text = old;
    if !text.is_empty() && !text.ends_with('\n') {
        text.push('\n');
    }
    text.push_str(&format!("{uid} {app} {}\n", hex(&digest(&key))));
    f.write_all(text.as_bytes()).map_err(io("write"))?;
    f.sync_all().map_err(io("write"))?;
    std::fs::rename(&tmp, path).map_err(io("replace"))?;
    Ok(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_added_is_found_and_only_its_hash_is_stored() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("etc/keys");
        let a = add_key(&path, 1000, "http").unwrap();
        let b = add_key(&path, 1001, "notes").unwrap();
        assert_ne!(a, b);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(!text.contains(&a) && !text.contains(&b), "{text}");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let mut keys = KeyStore::open(&path).unwrap();
        assert_eq!(keys.len(), 2);
        let who = |uid, app: &str| {
            Some(Identity {
                uid,
                app: app.into(),
            })
        };
        assert_eq!(keys.lookup(&a), who(1000, "http"));
        assert_eq!(keys.lookup(&b), who(1001, "notes"));
        assert_eq!(keys.lookup("llms-0000"), None);
        assert_eq!(keys.lookup(""), None);
    }

    #[test]
    fn bad_lines_are_named() {
        let check = |text: &str, want: &str| {
            let e = parse(Path::new("k"), text).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        };
        check("1000 http\n", "line 1: want");
        check("# c\nx http aa\n", "line 2: the uid");
        check("1 bad/app aa\n", "app name");
        check("1 http abc\n", "64 hex");
        assert!(
            parse(Path::new("k"), "# only a comment\n\n")
                .unwrap()
                .is_empty()
        );
    }
}
