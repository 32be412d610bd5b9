//! The house's layering rules, checked on the source tree: which crate may depend on which, no
//! import circle between the files of a crate, no source file too long, and a `//!` line atop
//! every file (docs/ARCHITECTURE.md states the rules; this test is what keeps them true).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The workspace root (this crate is `tests/`).
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// Every crate of the workspace: its name and folder, from the root manifest's members.
fn crates() -> Vec<(String, PathBuf)> {
    let manifest: toml::Table = std::fs::read_to_string(root().join("Cargo.toml"))
        .unwrap()
        .parse()
        .unwrap();
    manifest["workspace"]["members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let dir = root().join(m.as_str().unwrap());
            let own: toml::Table = std::fs::read_to_string(dir.join("Cargo.toml"))
                .unwrap()
                .parse()
                .unwrap();
            (own["package"]["name"].as_str().unwrap().to_owned(), dir)
        })
        .collect()
}

/// A crate's normal dependencies (not dev- or build-dependencies).
fn dependencies(dir: &Path) -> BTreeSet<String> {
    let own: toml::Table = std::fs::read_to_string(dir.join("Cargo.toml"))
        .unwrap()
        .parse()
        .unwrap();
    own.get("dependencies")
        .and_then(|d| d.as_table())
        .map(|t| t.keys().cloned().collect())
        .unwrap_or_default()
}

#[test]
fn each_crate_depends_only_on_what_its_layer_allows() {
    // What each crate may depend on, beyond crates outside the workspace (where a rule says
    // "only", the list is exhaustive).
    let only: BTreeMap<&str, &[&str]> = [
        // Pure decisions: std and thiserror, nothing else (DESIGN.md).
        ("policy", &["thiserror"][..]),
        // The shared ids: nothing at all.
        ("ids", &[][..]),
        // What an app links: serde and std only.
        ("protocol", &["serde", "serde_json", "thiserror"][..]),
    ]
    .into();
    // Workspace crates each crate must never depend on.
    let never: BTreeMap<&str, &[&str]> = [
        (
            "kvfs",
            &["uffd-pager", "model", "service", "daemon", "bench", "tools"][..],
        ),
        (
            "uffd-pager",
            &[
                "kvfs", "policy", "model", "service", "daemon", "bench", "tools",
            ][..],
        ),
        (
            "model",
            &[
                "uffd-pager",
                "service",
                "protocol",
                "daemon",
                "bench",
                "tools",
            ][..],
        ),
        (
            "guide",
            &[
                "model",
                "service",
                "protocol",
                "daemon",
                "kvfs",
                "uffd-pager",
                "policy",
                "bench",
                "tools",
            ][..],
        ),
        ("service", &["daemon", "bench", "tools"][..]),
        ("daemon", &["bench", "tools"][..]),
        ("bench", &["tools"][..]),
    ]
    .into();
    let mut checked = 0;
    for (name, dir) in crates() {
        let deps = dependencies(&dir);
        if let Some(allowed) = only.get(name.as_str()) {
            let extra: Vec<_> = deps
                .iter()
                .filter(|d| !allowed.contains(&d.as_str()))
                .collect();
            assert!(
                extra.is_empty(),
                "{name} may depend only on {allowed:?}, not {extra:?}"
            );
            checked += 1;
        }
        if let Some(banned) = never.get(name.as_str()) {
            let wrong: Vec<_> = deps
                .iter()
                .filter(|d| banned.contains(&d.as_str()))
                .collect();
            assert!(wrong.is_empty(), "{name} must not depend on {wrong:?}");
            checked += 1;
        }
    }
    assert_eq!(
        checked,
        only.len() + never.len(),
        "every rule found its crate"
    );
}

/// The `.rs` files under `dir`, recursively.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in entries {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(rust_files(&p));
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
    out.sort();
    out
}

/// A file's text up to its test module (`#[cfg(test)]` at the start of a line).
fn before_tests(text: &str) -> &str {
    text.find("\n#[cfg(test)]").map_or(text, |i| &text[..i])
}

/// A file's code up to its test module, comment lines left out (a doc link names an item
/// without depending on it).
fn code(text: &str) -> String {
    before_tests(text)
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The module path of a source file of a crate whose sources are in `src`: `lib.rs` is `[]`,
/// `kv/mod.rs` is `["kv"]`, `kv/cache.rs` is `["kv", "cache"]`.
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap();
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_str().unwrap().trim_end_matches(".rs").to_owned())
        .collect();
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
        parts.pop();
    }
    parts
}

/// Expand one `use` tree (`a::{b, c::d}`) into its paths.
fn expand(tree: &str) -> Vec<String> {
    let tree = tree.trim();
    let Some(open) = tree.find('{') else {
        return vec![tree.to_owned()];
    };
    let prefix = &tree[..open];
    let inner = &tree[open + 1..tree.rfind('}').unwrap_or(tree.len())];
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0, 0);
    for (i, ch) in inner.char_indices() {
        match ch {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&inner[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&inner[start..]);
    parts
        .into_iter()
        .filter(|p| !p.trim().is_empty())
        .flat_map(expand)
        .map(|p| format!("{prefix}{p}"))
        .collect()
}

/// Every `crate::...` path a file names: in `use crate::...;` trees and inline.
fn crate_paths(text: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("crate::") {
        let tail = &rest[i + "crate::".len()..];
        // `use crate::...;` (any visibility before `use`) takes the whole tree up to `;`.
        let preceded_by_use = rest[..i].trim_end().ends_with("use");
        let end = if preceded_by_use {
            tail.find(';').unwrap_or(tail.len())
        } else {
            tail.find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                .unwrap_or(tail.len())
        };
        for path in expand(&tail[..end]) {
            let segs: Vec<String> = path
                .split("::")
                .map(|s| s.split_whitespace().next().unwrap_or("").to_owned())
                .filter(|s| !s.is_empty() && s != "self" && s != "*")
                .collect();
            if !segs.is_empty() {
                out.push(segs);
            }
        }
        rest = &tail[end..];
    }
    out
}

/// Whether `text` defines an item named `name` (at any visibility).
fn defines(text: &str, name: &str) -> bool {
    [
        "struct",
        "enum",
        "fn",
        "trait",
        "type",
        "const",
        "static",
        "mod",
        "macro_rules!",
    ]
    .iter()
    .any(|kw| {
        text.match_indices(&format!("{kw} {name}")).any(|(i, m)| {
            let after = text[i + m.len()..].chars().next().unwrap_or(' ');
            !(after.is_alphanumeric() || after == '_')
        })
    })
}

/// The import graph of one crate's files: an edge from each file to every file whose item it
/// names through `crate::` (an item re-exported by a parent module is resolved to the child
/// that defines it), test modules left out.
fn import_graph(src: &Path) -> BTreeMap<Vec<String>, BTreeSet<Vec<String>>> {
    let files = rust_files(src);
    let modules: BTreeMap<Vec<String>, String> = files
        .iter()
        .map(|f| {
            let text = std::fs::read_to_string(f).unwrap();
            (module_of(src, f), code(&text))
        })
        .collect();
    let mut graph = BTreeMap::new();
    for (module, text) in &modules {
        let mut edges = BTreeSet::new();
        for path in crate_paths(text) {
            // The longest module prefix of the path.
            let mut at: Vec<String> = Vec::new();
            for seg in &path {
                let mut next = at.clone();
                next.push(seg.clone());
                if modules.contains_key(&next) {
                    at = next;
                } else {
                    // `seg` is an item of `at`: if `at` does not define it, a child does.
                    if !defines(&modules[&at], seg)
                        && let Some(child) = modules.keys().find(|m| {
                            m.len() == at.len() + 1
                                && m.starts_with(&at)
                                && defines(&modules[*m], seg)
                        })
                    {
                        at = child.clone();
                    }
                    break;
                }
            }
            if &at != module && !module.starts_with(&at) {
                edges.insert(at);
            }
        }
        graph.insert(module.clone(), edges);
    }
    graph
}

/// A cycle in `graph`, if there is one.
fn find_cycle(graph: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>) -> Option<Vec<Vec<String>>> {
    fn visit(
        node: &Vec<String>,
        graph: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
        state: &mut BTreeMap<Vec<String>, u8>,
        stack: &mut Vec<Vec<String>>,
    ) -> Option<Vec<Vec<String>>> {
        state.insert(node.clone(), 1);
        stack.push(node.clone());
        for next in graph.get(node).into_iter().flatten() {
            match state.get(next).copied().unwrap_or(0) {
                1 => {
                    let from = stack.iter().position(|n| n == next).unwrap();
                    let mut cycle = stack[from..].to_vec();
                    cycle.push(next.clone());
                    return Some(cycle);
                }
                0 => {
                    if let Some(c) = visit(next, graph, state, stack) {
                        return Some(c);
                    }
                }
                _ => {}
            }
        }
        stack.pop();
        state.insert(node.clone(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for node in graph.keys() {
        if state.get(node).copied().unwrap_or(0) == 0
            && let Some(c) = visit(node, graph, &mut state, &mut Vec::new())
        {
            return Some(c);
        }
    }
    None
}

#[test]
fn no_import_circle_between_the_files_of_a_crate() {
    let mut circles = Vec::new();
    for (name, dir) in crates() {
        let graph = import_graph(&dir.join("src"));
        if let Some(cycle) = find_cycle(&graph) {
            let names: Vec<String> = cycle
                .iter()
                .map(|m| {
                    if m.is_empty() {
                        "lib".to_owned()
                    } else {
                        m.join("/")
                    }
                })
                .collect();
            circles.push(format!("{name}: {}", names.join(" -> ")));
        }
    }
    assert!(
        circles.is_empty(),
        "import circles:\n{}",
        circles.join("\n")
    );
}

#[test]
fn the_import_graph_sees_a_circle_where_there_is_one() {
    // The checker itself, on a crate made up for it: `a` names an item `b` re-exports from its
    // child, which names `a` back.
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path();
    std::fs::create_dir(src.join("b")).unwrap();
    let write = |p: &str, t: &str| std::fs::write(src.join(p), t).unwrap();
    write("lib.rs", "//! x\nmod a;\nmod b;\n");
    write("a.rs", "//! x\nuse crate::{b::Thing, c};\npub fn f() {}\n");
    write("b/mod.rs", "//! x\nmod inner;\npub use inner::*;\n");
    write(
        "b/inner.rs",
        "//! x\npub struct Thing;\nfn g() { crate::a::f() }\n#[cfg(test)]\nmod tests { use crate::b; }\n",
    );
    let graph = import_graph(src);
    let cycle = find_cycle(&graph).expect("a -> b/inner -> a");
    assert!(cycle.contains(&vec!["a".to_owned()]), "{cycle:?}");
    assert!(
        cycle.contains(&vec!["b".to_owned(), "inner".to_owned()]),
        "{cycle:?}"
    );
    // Without the call back, no circle.
    write("b/inner.rs", "//! x\npub struct Thing;\n");
    assert_eq!(find_cycle(&import_graph(src)), None);
}

#[test]
fn every_source_file_says_what_it_is_for_and_stays_short() {
    // Lines before a file's test module; a file past this is split where its parts are.
    const MAX_LINES: usize = 1000;
    let mut long = Vec::new();
    let mut undocumented = Vec::new();
    for (_, dir) in crates() {
        for sub in ["src", "tests", "benches"] {
            for f in rust_files(&dir.join(sub)) {
                let text = std::fs::read_to_string(&f).unwrap();
                let rel = f.strip_prefix(root()).unwrap().display().to_string();
                if !text.starts_with("//!") {
                    undocumented.push(rel.clone());
                }
                let lines = before_tests(&text).lines().count();
                if sub == "src" && lines > MAX_LINES {
                    long.push(format!("{rel}: {lines} lines"));
                }
            }
        }
    }
    assert!(
        undocumented.is_empty(),
        "files without a //! line: {undocumented:?}"
    );
    assert!(
        long.is_empty(),
        "files over {MAX_LINES} lines before their tests:\n{}",
        long.join("\n")
    );
}

/// The longest a function may be (its `fn` line to its closing brace) without a reason.
const MAX_FN_LINES: usize = 100;

/// The functions of `text` longer than [`MAX_FN_LINES`] whose doc gives no reason (a `///`
/// line with `Kept whole:`): each one's name, first line (1-based) and length in lines.
///
/// A small lexer, enough for this tree: it skips comments, strings (raw ones too) and char
/// literals, so braces inside them do not count, and tells a body (`{`) from a declaration
/// without one (`;` outside the signature's brackets).
fn long_functions(text: &str) -> Vec<(String, usize, usize)> {
    let lines: Vec<&str> = text.lines().collect();
    let b = text.as_bytes();
    let is_ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    // Functions whose body is open: (name, fn line, brace depth inside the body).
    let mut open: Vec<(String, usize, usize)> = Vec::new();
    // A `fn name` seen, its body not begun: (name, line, bracket nesting at the `fn`).
    let mut pending: Option<(String, usize, usize)> = None;
    let (mut depth, mut nest, mut line) = (0usize, 0usize, 1usize);
    let mut found = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        let next = b.get(i + 1).copied().unwrap_or(0);
        if c == b'\n' {
            line += 1;
        } else if c == b'/' && next == b'/' {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
            continue;
        } else if c == b'/' && next == b'*' {
            let mut level = 0;
            while i < b.len() {
                if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
                    level += 1;
                    i += 1;
                } else if b[i] == b'*' && b.get(i + 1) == Some(&b'/') {
                    level -= 1;
                    i += 1;
                    if level == 0 {
                        i += 1;
                        break;
                    }
                } else if b[i] == b'\n' {
                    line += 1;
                }
                i += 1;
            }
            continue;
        } else if c == b'r'
            && (next == b'"' || next == b'#')
            && (i == 0 || !is_ident(b[i - 1]) || b[i - 1] == b'b')
        {
            // A raw string: r"..." or r#"..."#.
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&b'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) == Some(&b'"') {
                let close: Vec<u8> = std::iter::once(b'"')
                    .chain(std::iter::repeat_n(b'#', hashes))
                    .collect();
                j += 1;
                while j < b.len() && !b[j..].starts_with(&close) {
                    if b[j] == b'\n' {
                        line += 1;
                    }
                    j += 1;
                }
                i = j + close.len();
                continue;
            }
        } else if c == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' {
                    i += 1;
                }
                if b.get(i) == Some(&b'\n') {
                    line += 1;
                }
                i += 1;
            }
        } else if c == b'\'' {
            // A char literal ('x', '\n', '{'), not a lifetime ('a).
            if next == b'\\' {
                i += 3;
                while i < b.len() && b[i] != b'\'' {
                    i += 1;
                }
            } else if b.get(i + 2) == Some(&b'\'') {
                i += 2;
            } else if next >= 0x80 {
                // A multi-byte char: skip to its closing quote on this line.
                let mut j = i + 1;
                while j < b.len() && b[j] != b'\'' && b[j] != b'\n' {
                    j += 1;
                }
                if b.get(j) == Some(&b'\'') {
                    i = j;
                }
            }
        } else if c == b'(' || c == b'[' {
            nest += 1;
        } else if c == b')' || c == b']' {
            nest = nest.saturating_sub(1);
        } else if c == b';' {
            if pending.as_ref().is_some_and(|p| p.2 == nest) {
                pending = None;
            }
        } else if c == b'{' {
            depth += 1;
            if let Some((name, at, _)) = pending.take() {
                open.push((name, at, depth));
            }
        } else if c == b'}' {
            if open.last().is_some_and(|f| f.2 == depth) {
                let (name, at, _) = open.pop().unwrap();
                let len = line - at + 1;
                let reason = lines[..at - 1]
                    .iter()
                    .rev()
                    .map(|l| l.trim_start())
                    .take_while(|l| l.starts_with("///") || l.starts_with("#["))
                    .any(|l| l.contains("Kept whole:"));
                if len > MAX_FN_LINES && !reason {
                    found.push((name, at, len));
                }
            }
            depth = depth.saturating_sub(1);
        } else if c == b'f'
            && next == b'n'
            && (i == 0 || !is_ident(b[i - 1]))
            && b.get(i + 2).is_some_and(|c| c.is_ascii_whitespace())
        {
            let mut j = i + 2;
            while b.get(j).is_some_and(|c| c.is_ascii_whitespace()) {
                j += 1;
            }
            let start = j;
            while b.get(j).is_some_and(|&c| is_ident(c)) {
                j += 1;
            }
            if j > start {
                pending = Some((text[start..j].to_string(), line, nest));
            }
        }
        i += 1;
    }
    found
}

#[test]
fn every_function_is_short_or_says_why() {
    let mut long = Vec::new();
    for (_, dir) in crates() {
        for sub in ["src", "tests", "benches"] {
            for f in rust_files(&dir.join(sub)) {
                let text = std::fs::read_to_string(&f).unwrap();
                let text = if sub == "src" {
                    before_tests(&text)
                } else {
                    &text
                };
                let rel = f.strip_prefix(root()).unwrap().display().to_string();
                for (name, at, len) in long_functions(text) {
                    long.push(format!("{rel}:{at} {name}: {len} lines"));
                }
            }
        }
    }
    assert!(
        long.is_empty(),
        "functions over {MAX_FN_LINES} lines without `Kept whole:` and a reason in their doc:\n{}",
        long.join("\n")
    );
}

#[test]
fn the_function_lengths_are_measured_past_strings_comments_and_chars() {
    let body = |n: usize| "    let x = 1;\n".repeat(n);
    let long = format!(
        "/// Doc.\nfn long() {{\n    let s = \"}}\"; let c = '}}'; let r = r#\"}}\"#;\n    // }}\n{}}}\n",
        body(100)
    );
    assert_eq!(long_functions(&long), vec![("long".to_string(), 2, 104)]);
    let kept = format!(
        "/// Kept whole: a reason.\n#[inline]\nfn kept() {{\n{}}}\n",
        body(100)
    );
    assert!(long_functions(&kept).is_empty());
    let short = format!(
        "trait T {{ fn decl(a: [u8; 4]); }}\nfn short<'a>(x: &'a str) {{\n{}}}\n",
        body(98)
    );
    assert!(
        long_functions(&short).is_empty(),
        "{:?}",
        long_functions(&short)
    );
    let nested = format!(
        "fn outer() {{\n    fn inner() {{\n{}    }}\n}}\n",
        body(100)
    );
    let names: Vec<String> = long_functions(&nested).into_iter().map(|f| f.0).collect();
    assert_eq!(names, ["inner", "outer"]);
}
