//! The documentation's own checks, over the README, the three strategy guides and the
//! book's chapters (`docs/src/`): every code fence names its language (rustdoc compiles
//! a fence without one as Rust), every chapter is compiled as a doctest from
//! `src/lib.rs`, and every relative link reaches a file, and a heading in it when the
//! link names one, from wherever the text is read (the repository or the book).

use std::collections::BTreeSet;
use std::fs;
use std::path::{Component, Path, PathBuf};

/// The strategy guides: they stay at the top of the repository, and the book has a
/// chapter of the same name that includes each.
const GUIDES: [&str; 3] = [
    "INFERENCE_STRATEGIES.md",
    "CONCURRENT_INFERENCE.md",
    "BATCHED_INFERENCE.md",
];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The book's chapter files, `SUMMARY.md` left out.
fn chapters() -> Vec<PathBuf> {
    let mut chapters: Vec<PathBuf> = fs::read_dir(root().join("docs/src"))
        .expect("docs/src")
        .map(|entry| entry.expect("docs/src entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .filter(|p| !p.ends_with("SUMMARY.md"))
        .collect();
    chapters.sort();
    chapters
}

/// Every Markdown file the checks cover.
fn documents() -> Vec<PathBuf> {
    let mut files = vec![root().join("README.md")];
    files.extend(GUIDES.iter().map(|g| root().join(g)));
    files.extend(chapters());
    files
}

/// A chapter whose every line is an mdBook include: its text is another file's.
fn only_includes(text: &str) -> bool {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .all(|l| l.trim().starts_with("{{#include "))
}

/// The lines of `text` outside code fences, with their line numbers (from 1), and an
/// error for each fence that opens without a language.
fn prose_lines(text: &str, file: &str, errors: &mut Vec<String>) -> Vec<(usize, String)> {
    let mut prose = Vec::new();
    let mut open: Option<String> = None;
    for (i, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        let marker: String = trimmed
            .chars()
            .take_while(|&c| c == '`' || c == '~')
            .collect();
        let first = marker.chars().next();
        let is_fence = marker.len() >= 3 && marker.chars().all(|c| Some(c) == first);
        match (&open, is_fence) {
            (None, true) => {
                if trimmed[marker.len()..].trim().is_empty() {
                    errors.push(format!(
                        "{file}:{}: a code fence without a language (rustdoc compiles it as Rust; \
                         write ```rust,no_run, ```sh, ```text, ...)",
                        i + 1
                    ));
                }
                open = Some(marker);
            }
            (Some(opened), true) if marker.starts_with(opened.as_str()) => {
                if trimmed[marker.len()..].trim().is_empty() {
                    open = None;
                }
            }
            (Some(_), _) => {}
            (None, false) => prose.push((i + 1, line.to_string())),
        }
    }
    if open.is_some() {
        errors.push(format!("{file}: a code fence is never closed"));
    }
    prose
}

/// `line` without its inline code spans.
fn without_code_spans(line: &str) -> String {
    let mut out = String::new();
    for (i, part) in line.split('`').enumerate() {
        if i % 2 == 0 {
            out.push_str(part);
        }
    }
    out
}

/// The targets of the inline links `[text](target)` on `line`.
fn link_targets(line: &str) -> Vec<String> {
    let line = without_code_spans(line);
    let mut targets = Vec::new();
    let mut rest = line.as_str();
    while let Some(at) = rest.find("](") {
        let after = &rest[at + 2..];
        let Some(end) = after.find(')') else { break };
        targets.push(after[..end].trim().to_string());
        rest = &after[end..];
    }
    targets
}

/// A heading's anchor as GitHub and mdBook write it: lowercase letters and digits, `-`
/// and `_` kept, whitespace as `-`, the rest dropped.
fn slug(heading: &str) -> String {
    heading
        .chars()
        .filter_map(|c| {
            if c.is_alphanumeric() || c == '-' || c == '_' {
                Some(c.to_lowercase().next().unwrap_or(c))
            } else if c.is_whitespace() {
                Some('-')
            } else {
                None
            }
        })
        .collect()
}

/// The anchors of `path`'s headings, with the files it includes (mdBook's
/// `{{#include PATH}}` or `{{#include PATH:anchor}}`, the whole file taken) expanded.
fn anchors(path: &Path) -> BTreeSet<String> {
    let text = read(path);
    let mut ignored = Vec::new();
    let mut found = BTreeSet::new();
    for (_, line) in prose_lines(&text, "", &mut ignored) {
        let trimmed = line.trim();
        if let Some(inner) = trimmed
            .strip_prefix("{{#include ")
            .and_then(|s| s.strip_suffix("}}"))
        {
            let file = inner.split(':').next().unwrap_or(inner).trim();
            found.extend(anchors(&path.parent().unwrap().join(file)));
        } else if trimmed.starts_with('#') {
            let heading = trimmed.trim_start_matches('#');
            if heading.starts_with(' ') {
                found.insert(slug(&without_code_spans(heading.trim()).replace('`', "")));
            }
        }
    }
    found
}

/// `path` with its `.` and `..` components resolved (no file system access).
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for component in path.components() {
        match component {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

#[test]
fn every_code_fence_names_its_language() {
    let mut errors = Vec::new();
    for path in documents() {
        prose_lines(&read(&path), &path.display().to_string(), &mut errors);
    }
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}

#[test]
fn every_chapter_is_in_the_summary_and_among_the_doctests() {
    let summary = read(&root().join("docs/src/SUMMARY.md"));
    let lib = read(&root().join("src/lib.rs"));
    let mut errors = Vec::new();
    for chapter in chapters() {
        let name = chapter.file_name().unwrap().to_str().unwrap();
        if !summary.contains(&format!("]({name})")) {
            errors.push(format!("docs/src/{name} is not in docs/src/SUMMARY.md"));
        }
        let text = read(&chapter);
        let tested = lib.contains(&format!("include_str!(\"../docs/src/{name}\")"));
        if only_includes(&text) {
            for line in text.lines().filter(|l| !l.trim().is_empty()) {
                let included = line.trim().trim_start_matches("{{#include ../../");
                let file = included.trim_end_matches("}}").split(':').next().unwrap();
                if !lib.contains(&format!("include_str!(\"../{file}\")")) {
                    errors.push(format!(
                        "docs/src/{name} includes {file}, which src/lib.rs does not compile as doctests"
                    ));
                }
            }
        } else if !tested {
            errors.push(format!(
                "docs/src/{name} is not compiled as doctests: add it to src/lib.rs's `book` module"
            ));
        }
    }
    for guide in GUIDES {
        if !root().join("docs/src").join(guide).exists() {
            errors.push(format!(
                "the book has no chapter docs/src/{guide} for the guide"
            ));
        }
    }
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}

#[test]
fn relative_links_reach_a_file_and_heading() {
    let root = root();
    let book_toml = read(&root.join("docs/book.toml"));
    let mut errors = Vec::new();
    for path in documents() {
        let file = path.strip_prefix(&root).unwrap().display().to_string();
        let in_book = file.starts_with("docs/src/");
        let is_guide = GUIDES.contains(&file.as_str());
        let text = read(&path);
        // The README's parts between mdBook anchors are included in the book too.
        let mut in_anchor = false;
        for (number, line) in prose_lines(&text, &file, &mut Vec::new()) {
            if line.contains("ANCHOR_END:") {
                in_anchor = false;
            } else if line.contains("ANCHOR:") {
                in_anchor = true;
            }
            for target in link_targets(&line) {
                if target.contains("://") || target.starts_with("mailto:") {
                    continue;
                }
                let at = format!("{file}:{number}: link `{target}`");
                let (target_path, fragment) = match target.split_once('#') {
                    Some((p, f)) => (p, Some(f)),
                    None => (target.as_str(), None),
                };
                if in_anchor {
                    errors.push(format!(
                        "{at}: this part of the README is included in the book, where a relative link \
                         resolves elsewhere"
                    ));
                    continue;
                }
                let resolved = if target_path.is_empty() {
                    path.clone()
                } else {
                    normalize(&path.parent().unwrap().join(target_path))
                };
                if !resolved.exists() {
                    errors.push(format!("{at}: no file {}", resolved.display()));
                    continue;
                }
                if in_book && !resolved.starts_with(root.join("docs/src")) {
                    errors.push(format!("{at}: the book can only link to its own chapters"));
                }
                if is_guide && !target_path.is_empty() && !GUIDES.contains(&target_path) {
                    // In the book a guide is read from docs/src/, so its link to a chapter
                    // lands on a redirect page there, which book.toml must declare.
                    let html = target_path.replace(".md", ".html");
                    if !book_toml.contains(&format!("\"/{html}\"")) {
                        errors.push(format!(
                            "{at}: a guide's link to the book needs `\"/{html}\"` in \
                             docs/book.toml's [output.html.redirect]"
                        ));
                    }
                }
                if let Some(fragment) = fragment
                    && resolved.extension().is_some_and(|e| e == "md")
                    && !anchors(&resolved).contains(fragment)
                {
                    errors.push(format!("{at}: no heading #{fragment} there"));
                }
            }
        }
    }
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}
