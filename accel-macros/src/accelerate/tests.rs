//! Expansion snapshots: every pass case in ui-tests/pass/ and every annotated example,
//! expanded and pretty-printed, must equal its copy in the `expanded/` folder beside it. Regenerate
//! after an intended change with `ACCEL_BLESS=1 cargo test -p accel-macros` and review
//! the diff.

use std::path::{Path, PathBuf};

use quote::ToTokens;

fn annotated_files() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = Vec::new();
    for dir in ["ui-tests/pass", "examples", "examples/by_feature"] {
        let Ok(entries) = std::fs::read_dir(root.join(dir)) else { continue };
        for entry in entries.flatten() {
            let path = entry.path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            if name.ends_with(".rs") {
                let text = std::fs::read_to_string(&path).unwrap();
                if text.contains("#[accelerate") || text.contains("::accelerate(") {
                    files.push(path);
                }
            }
        }
    }
    files.sort();
    files
}

/// The attribute's arguments if `attrs` holds `#[accelerate(..)]` (removed from `attrs`).
fn take_attribute(attrs: &mut Vec<syn::Attribute>) -> Option<proc_macro2::TokenStream> {
    let index = attrs
        .iter()
        .position(|a| a.path().segments.last().is_some_and(|s| s.ident == "accelerate"))?;
    Some(match attrs.remove(index).meta {
        syn::Meta::List(list) => list.tokens,
        _ => proc_macro2::TokenStream::new(),
    })
}

/// Expands every `#[accelerate(..)]` function of a file, methods included.
fn expand_file(text: &str) -> String {
    let mut file: syn::File = syn::parse_str(text).expect("the file parses");
    for item in &mut file.items {
        match item {
            syn::Item::Fn(f) => {
                if let Some(args) = take_attribute(&mut f.attrs) {
                    let expanded = super::expand(args, f.to_token_stream());
                    *item = syn::parse2(expanded).expect("the expansion parses as an item");
                }
            }
            syn::Item::Impl(block) => {
                for member in &mut block.items {
                    let syn::ImplItem::Fn(method) = member else { continue };
                    if let Some(args) = take_attribute(&mut method.attrs) {
                        let expanded = super::expand(args, method.to_token_stream());
                        *member = syn::parse2(expanded).expect("the expansion parses as a method");
                    }
                }
            }
            _ => {}
        }
    }
    prettyplease::unparse(&file)
}

#[test]
fn expansions_match_their_snapshots() {
    let bless = std::env::var_os("ACCEL_BLESS").is_some();
    let files = annotated_files();
    assert!(!files.is_empty(), "no annotated files found");
    let mut stale = Vec::new();
    for path in files {
        let expanded = expand_file(&std::fs::read_to_string(&path).unwrap());
        let snapshot = path.parent().unwrap().join("expanded").join(path.file_name().unwrap());
        if bless {
            std::fs::create_dir_all(snapshot.parent().unwrap()).unwrap();
            std::fs::write(&snapshot, &expanded).unwrap();
        } else if std::fs::read_to_string(&snapshot).ok().as_deref() != Some(expanded.as_str()) {
            stale.push(snapshot.display().to_string());
        }
    }
    assert!(
        stale.is_empty(),
        "expansions changed: {stale:?}\nreview with `ACCEL_BLESS=1 cargo test -p accel-macros` and `git diff`"
    );
}
