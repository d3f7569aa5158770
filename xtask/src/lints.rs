//! The repository's lint tests, which `cargo test -p xtask` runs over the whole checkout: the
//! tour names every source file, `ACCEL_*` names live in the registry, accel-core's layers and
//! module imports, the README's length, and every relative link of the pages.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use crate::root;

/// Every `.rs` file under `dir`, recursively.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()) {
        if entry.is_dir() {
            out.extend(rust_files(&entry));
        } else if entry.extension().is_some_and(|e| e == "rs") {
            out.push(entry);
        }
    }
    out
}

/// docs/architecture.md, the tour, names every source file of the crates.
#[test]
fn the_tour_names_every_source_file() {
    let tour = std::fs::read_to_string(root().join("docs/architecture.md")).unwrap();
    let mut missing = Vec::new();
    for krate in ["accel-core", "accel-macros", "accel-models", "accel-choices", "xtask"] {
        for file in rust_files(&root().join(krate).join("src")) {
            let name = file.file_name().unwrap().to_string_lossy().into_owned();
            if !tour.contains(&name) {
                missing.push(file.strip_prefix(root()).unwrap().display().to_string());
            }
        }
    }
    assert!(missing.is_empty(), "docs/architecture.md does not name {missing:?}");
}

/// Code without comments and without what follows `#[cfg(test)]` (the tests).
fn code_of(text: &str) -> String {
    let text = text.split("#[cfg(test)]").next().unwrap_or_default();
    text.lines().map(|l| l.split("//").next().unwrap_or_default()).collect::<Vec<_>>().join("\n")
}

/// Every `ACCEL_*` variable is named once: a row of the settings' table
/// (accel-choices/src/settings.rs) or a constant of accel-core/src/config/env.rs, whose
/// docs the reference page lists. Elsewhere the code uses the constants (tests aside,
/// and `env!` of a build script's variable).
#[test]
fn every_accel_variable_is_named_in_the_registry() {
    let allowed = ["accel-core/src/config/env.rs", "accel-choices/src/settings.rs"];
    for crate_dir in ["accel-core/src", "accel-models/src", "accel-macros/src"] {
        for file in rust_files(&root().join(crate_dir)) {
            let test_module = file.file_name().is_some_and(|n| n == "tests.rs");
            if test_module || allowed.iter().any(|a| rel(&file) == *a) {
                continue;
            }
            let text = std::fs::read_to_string(&file).unwrap();
            let code = text.split("#[cfg(test)]").next().unwrap_or_default();
            for (n, line) in code.lines().enumerate() {
                let line = line.split("//").next().unwrap_or_default();
                let mut rest = line;
                while let Some(at) = rest.find("\"ACCEL_") {
                    let name: String = rest[at + 1..]
                        .chars()
                        .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                        .collect();
                    let closed = rest[at + 1 + name.len()..].starts_with('"');
                    let build_variable = rest[..at].ends_with("env!(");
                    assert!(
                        !closed || name.len() <= "ACCEL_".len() || build_variable,
                        "{}:{}: `{name}` spelled out; use its constant in config/env.rs (or \
                         its row of the settings' table)",
                        rel(&file),
                        n + 1
                    );
                    rest = &rest[at + 1..];
                }
            }
        }
    }
}

/// Configuration is its own layer: the accelerator and tracking read settings and files
/// through `config`, never through the launcher (`launch` starts processes, and is above
/// both).
#[test]
fn the_accelerator_and_tracking_import_nothing_of_the_launcher() {
    for module in ["accelerator", "tracking", "config"] {
        for file in rust_files(&root().join("accel-core/src").join(module)) {
            let code = code_of(&std::fs::read_to_string(&file).unwrap());
            assert!(
                !code.contains("crate::launch"),
                "{} imports the launcher; read settings through crate::config",
                rel(&file)
            );
        }
    }
}

/// The top-level modules of accel-core (files and folders of src/, lib.rs and bin/ aside)
/// import each other in no cycle: each `crate::module` path, and each `crate::Name`
/// re-exported at the root by lib.rs's `pub use module::..`, is an edge.
#[test]
fn accel_cores_modules_import_each_other_in_no_cycle() {
    let src = root().join("accel-core/src");
    let mut modules: std::collections::BTreeMap<String, Vec<PathBuf>> = Default::default();
    for entry in std::fs::read_dir(&src).unwrap().map(|e| e.unwrap().path()) {
        let name = entry.file_stem().unwrap().to_string_lossy().into_owned();
        if name == "lib" || name == "bin" {
            continue;
        }
        let files = if entry.is_dir() { rust_files(&entry) } else { vec![entry] };
        modules.entry(name).or_default().extend(files);
    }
    // What lib.rs re-exports at the root, by the module it comes from.
    let lib = code_of(&std::fs::read_to_string(src.join("lib.rs")).unwrap());
    let mut reexported: std::collections::HashMap<String, String> = Default::default();
    for statement in lib.split(';') {
        let Some(rest) = statement.trim().strip_prefix("pub use ") else { continue };
        let module = rest.split("::").next().unwrap_or_default().trim().to_owned();
        if !modules.contains_key(&module) {
            continue;
        }
        for word in rest.split(|c: char| !(c.is_alphanumeric() || c == '_')) {
            if word.chars().next().is_some_and(char::is_uppercase) {
                reexported.insert(word.to_owned(), module.clone());
            }
        }
    }
    let mut edges: std::collections::BTreeMap<String, HashSet<String>> = Default::default();
    for (module, files) in &modules {
        for file in files.iter().filter(|f| !f.ends_with("tests.rs")) {
            let code = code_of(&std::fs::read_to_string(file).unwrap());
            for (i, _) in code.match_indices("crate::") {
                for word in names_at(&code[i + 7..]) {
                    let target = if modules.contains_key(&word) {
                        Some(word)
                    } else {
                        reexported.get(&word).cloned()
                    };
                    if let Some(target) = target.filter(|t| t != module) {
                        edges.entry(module.clone()).or_default().insert(target);
                    }
                }
            }
        }
    }
    // A cycle: a module that reaches itself.
    for start in modules.keys() {
        let mut seen = HashSet::new();
        let mut stack: Vec<(String, Vec<String>)> = vec![(start.clone(), vec![start.clone()])];
        while let Some((at, path)) = stack.pop() {
            for next in edges.get(&at).into_iter().flatten() {
                if next == start {
                    panic!(
                        "accel-core's modules import each other in a cycle: {} -> {start}",
                        path.join(" -> ")
                    );
                }
                if seen.insert(next.clone()) {
                    let mut longer = path.clone();
                    longer.push(next.clone());
                    stack.push((next.clone(), longer));
                }
            }
        }
    }
    assert!(edges.len() > 10, "the modules were found: {edges:?}");
}

/// The names a path continues with at the start of `rest` (what follows `crate::` or
/// `super::`): `x` of `x::..`, or each first segment of a group, `x` and `y` of `{x, y::z}`.
fn names_at(rest: &str) -> Vec<String> {
    let word = |s: &str| -> String {
        s.trim_start().chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect()
    };
    let Some(group) = rest.strip_prefix('{') else { return vec![word(rest)] };
    // The group's items: split at its top-level commas, up to its closing brace.
    let (mut names, mut depth, mut start) = (Vec::new(), 0, 0);
    for (i, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => {
                names.push(word(&group[start..i]));
                break;
            }
            '}' => depth -= 1,
            ',' if depth == 0 => {
                names.push(word(&group[start..i]));
                start = i + 1;
            }
            _ => {}
        }
    }
    names.retain(|n| !n.is_empty());
    names
}

#[test]
fn grouped_imports_are_edges_too() {
    assert_eq!(names_at("ffi::Stream;"), ["ffi"]);
    assert_eq!(names_at("{check, ffi::{a, b}, raw};"), ["check", "ffi", "raw"]);
    assert_eq!(names_at("{\n    a,\n    b::C,\n};"), ["a", "b"]);
}

/// Within each folder of the crates' sources, the files (siblings under one `mod.rs`)
/// import each other in no cycle either: `super::x` from `y.rs` is an edge y → x.
#[test]
fn sibling_files_import_each_other_in_no_cycle() {
    let mut folders = Vec::new();
    for krate in ["accel-core", "accel-macros", "accel-models", "accel-choices"] {
        let mut stack = vec![root().join(krate).join("src")];
        while let Some(dir) = stack.pop() {
            let entries: Vec<PathBuf> =
                std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
            stack.extend(entries.iter().filter(|e| e.is_dir()).cloned());
            folders.push(entries);
        }
    }
    let (mut checked, mut cycles) = (0, Vec::new());
    for entries in folders {
        // A sibling is a file `x.rs` or a folder `x/`; what it names with `super::`.
        let name = |p: &Path| p.file_stem().unwrap().to_string_lossy().into_owned();
        let siblings: HashSet<String> = entries
            .iter()
            .filter(|e| e.is_dir() || e.extension().is_some_and(|x| x == "rs"))
            .map(|e| name(e))
            .filter(|n| !["mod", "lib", "main", "tests"].contains(&n.as_str()))
            .collect();
        let mut edges: std::collections::BTreeMap<String, HashSet<String>> = Default::default();
        for entry in &entries {
            let from = name(entry);
            if !siblings.contains(&from) {
                continue;
            }
            let files = if entry.is_dir() { rust_files(entry) } else { vec![entry.clone()] };
            // Inside a folder `x/`, its siblings are `super::super::`.
            let prefix = if entry.is_dir() { "super::super::" } else { "super::" };
            for file in files.iter().filter(|f| !f.ends_with("tests.rs")) {
                let code = code_of(&std::fs::read_to_string(file).unwrap());
                for (i, _) in code.match_indices(prefix) {
                    if i >= 7 && &code[i - 7..i] == "super::" {
                        continue;
                    }
                    for word in names_at(&code[i + prefix.len()..]) {
                        if siblings.contains(&word) && word != from {
                            edges.entry(from.clone()).or_default().insert(word);
                        }
                    }
                }
            }
        }
        for start in edges.keys() {
            let mut seen = HashSet::new();
            let mut stack = vec![(start.clone(), vec![start.clone()])];
            while let Some((at, path)) = stack.pop() {
                for next in edges.get(&at).into_iter().flatten() {
                    if next == start {
                        let folder = entries[0].parent().unwrap();
                        let folder = folder.strip_prefix(root()).unwrap_or(folder).display();
                        cycles.push(format!("{folder}: {} -> {start}", path.join(" -> ")));
                        continue;
                    }
                    if seen.insert(next.clone()) {
                        let mut longer = path.clone();
                        longer.push(next.clone());
                        stack.push((next.clone(), longer));
                    }
                }
            }
        }
        checked += edges.len();
    }
    assert!(checked > 20, "the files were found: {checked} with imports of siblings");
    assert!(cycles.is_empty(), "files that import each other in a cycle:\n{}", cycles.join("\n"));
}

/// The README is the front door (what accel is, the two commands, the one line, the
/// limits); the rest lives in docs/.
const README_MAX_LINES: usize = 400;

#[test]
fn the_readme_stays_a_front_door() {
    let text = std::fs::read_to_string(root().join("README.md")).expect("README.md");
    let lines = text.lines().count();
    assert!(
        lines <= README_MAX_LINES,
        "README.md has {lines} lines, more than {README_MAX_LINES}: move the detail into a \
         guide under docs/ and link to it"
    );
}

/// README.md and every docs/*.md.
fn pages() -> Vec<PathBuf> {
    let root = root();
    let mut pages = vec![root.join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .expect("docs/")
        .map(|e| e.expect("docs/ entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    pages.extend(docs);
    pages
}

/// `text` with fenced code blocks and code spans blanked out (newlines kept, so that
/// positions still give line numbers): `](` in code is not a link.
fn prose(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut fenced = false;
    for line in text.split_inclusive('\n') {
        let fence = line.trim_start().starts_with("```");
        if fence || fenced {
            out.extend(line.chars().map(|c| if c == '\n' { '\n' } else { ' ' }));
        } else {
            out.push_str(line);
        }
        fenced ^= fence;
    }
    // Code spans (CommonMark): a run of n backticks up to the next run of exactly n;
    // an unmatched run is literal.
    let chars: Vec<char> = out.chars().collect();
    let run_at = |i: usize| chars[i..].iter().take_while(|&&c| c == '`').count();
    let mut blank = vec![false; chars.len()];
    let mut i = 0;
    while i < chars.len() {
        if chars[i] != '`' {
            i += 1;
            continue;
        }
        let n = run_at(i);
        let mut j = i + n;
        let mut close = None;
        while j < chars.len() {
            if chars[j] == '`' {
                let m = run_at(j);
                if m == n {
                    close = Some(j + m);
                    break;
                }
                j += m;
            } else {
                j += 1;
            }
        }
        match close {
            Some(end) => {
                blank[i..end].iter_mut().for_each(|b| *b = true);
                i = end;
            }
            None => i += n,
        }
    }
    chars.iter().zip(&blank).map(|(&c, &b)| if b && c != '\n' { ' ' } else { c }).collect()
}

/// The link targets of `text` (`](target)`), with their line numbers.
fn links(text: &str) -> Vec<(usize, String)> {
    let prose = prose(text);
    let mut found = Vec::new();
    let mut from = 0;
    while let Some(at) = prose[from..].find("](") {
        let start = from + at + 2;
        let Some(close) = prose[start..].find(')') else { break };
        let target = prose[start..start + close].split_whitespace().next().unwrap_or("");
        let line = prose[..start].matches('\n').count() + 1;
        found.push((line, target.trim_matches(['<', '>']).to_owned()));
        from = start + close;
    }
    found
}

/// The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces
/// made hyphens.
fn anchors(text: &str) -> HashSet<String> {
    prose(text)
        .lines()
        .zip(text.lines())
        .filter(|(blanked, _)| blanked.starts_with('#'))
        .map(|(_, heading)| {
            heading
                .trim_start_matches('#')
                .trim()
                .to_lowercase()
                .chars()
                .filter_map(|c| match c {
                    ' ' => Some('-'),
                    c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
                    _ => None,
                })
                .collect()
        })
        .collect()
}

#[test]
fn every_relative_link_of_the_readme_and_the_guides_points_at_something_that_exists() {
    let mut broken = Vec::new();
    for page in pages() {
        let text = std::fs::read_to_string(&page).expect("a page");
        let dir = page.parent().expect("a folder");
        let name = page.strip_prefix(root()).unwrap_or(&page).display().to_string();
        for (line, target) in links(&text) {
            if target.contains("://") || target.starts_with("mailto:") || target.is_empty() {
                continue;
            }
            let (path, anchor) = match target.split_once('#') {
                Some((path, anchor)) => (path, Some(anchor)),
                None => (target.as_str(), None),
            };
            let file: PathBuf = if path.is_empty() { page.clone() } else { dir.join(path) };
            if !file.exists() {
                broken.push(format!("{name}:{line}: `{target}`: no {}", rel(&file)));
                continue;
            }
            let markdown = file.extension().is_some_and(|e| e == "md");
            if let (Some(anchor), true) = (anchor, markdown) {
                let heads = anchors(&std::fs::read_to_string(&file).expect("a page"));
                if !heads.contains(anchor) {
                    broken.push(format!(
                        "{name}:{line}: `{target}`: no heading with anchor #{anchor} in {}",
                        rel(&file)
                    ));
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

fn rel(path: &Path) -> String {
    let root = root();
    let normal: PathBuf = path.components().fold(PathBuf::new(), |mut acc, c| {
        match c {
            std::path::Component::ParentDir => {
                acc.pop();
            }
            other => acc.push(other),
        }
        acc
    });
    normal.strip_prefix(&root).unwrap_or(&normal).display().to_string()
}

#[test]
fn links_in_code_are_not_links_and_anchors_follow_github() {
    let text = "# Top: the `data` key\n[a](x.md) `[b](y.md)` ``[c](z.md)``\n\
                ```\n[d](w.md)\n```\n[e](v.md#top-the-data-key)\n";
    let found: Vec<String> = links(text).into_iter().map(|(_, t)| t).collect();
    assert_eq!(found, ["x.md", "v.md#top-the-data-key"]);
    assert!(anchors(text).contains("top-the-data-key"));
}
