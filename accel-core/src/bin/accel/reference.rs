//! docs/reference.md, generated from the code: every setting (the settings' table), every
//! other `ACCEL_*` variable (config/env.rs), the config files' keys, and every command and
//! flag of `accel` (its clap definitions). A test fails when the page and the code differ;
//! `ACCEL_BLESS=1 cargo test -p accel-core --bin accel reference` rewrites it.

use std::fmt::Write;

use accel_core::config::env::{Audience, VARIABLES};
use accel_core::config::{Literal, SETTINGS};
use clap::CommandFactory;

fn values(literal: Literal) -> String {
    match literal {
        Literal::Bool => "`true`, `false`".into(),
        Literal::Integer => "an integer".into(),
        Literal::Number => "a number".into(),
        Literal::Choice { names, list } => {
            let names: Vec<String> = names.iter().map(|n| format!("`{n}`")).collect();
            let several = if list { " (comma-separated)" } else { "" };
            format!("{}{several}", names.join(", "))
        }
        Literal::Text => "text".into(),
    }
}

/// The page.
pub fn markdown() -> String {
    let mut page = String::new();
    let mut say = |text: &str| page.push_str(text);
    say("# Reference\n\n");
    say("Generated from the code (`ACCEL_BLESS=1 cargo test -p accel-core --bin accel \
         reference`); a test fails when this page and the code differ. Guides: \
         [docs](README.md).\n\n");
    say("## Settings\n\n");
    say("Each setting is one row of `accel_choices::settings!`, and can be given — strongest \
         first — as an `#[accelerate(key = ..)]` key (where the attribute column says so), a \
         builder method (`Accelerator::builder().key(..)`), an `accel launch --key` flag, its \
         environment variable, or its key in a config file (`accel launch --config-file`, \
         `ACCEL_CONFIG_FILE`). A value is written the same way in a variable, a file and a \
         flag (`true`/`false` also as `1`/`0`, `yes`/`no`).\n\n");
    say("| key | values | default | variable | attribute | what it does |\n");
    say("|---|---|---|---|---|---|\n");
    for s in SETTINGS {
        let default = (s.default)();
        let default = if default.is_empty() { "none".to_owned() } else { format!("`{default}`") };
        let attribute = if s.attribute { "yes" } else { "no" };
        let text = s.text().replace('|', "\\|");
        let _ = writeln!(
            page,
            "| `{}` | {} | {default} | `{}` | {attribute} | {text} |",
            s.name,
            values(s.literal),
            s.env
        );
    }
    let mut say = |text: &str| page.push_str(text);
    say("\n## Other environment variables\n\n");
    for (audience, title) in [
        (Audience::User, "Set by users"),
        (Audience::Launcher, "Set by `accel launch` for the processes it starts"),
        (Audience::Diagnostics, "Diagnostics and benchmarks"),
        (Audience::Tests, "The test suite's"),
    ] {
        let _ = writeln!(page, "{title}:\n\n| variable | what it does |\n|---|---|");
        for v in VARIABLES.iter().filter(|v| v.audience == audience) {
            let doc = v.doc.lines().map(str::trim).collect::<Vec<_>>().join(" ");
            let _ = writeln!(page, "| `{}` | {} |", v.name, doc.trim());
        }
        page.push('\n');
    }
    let mut say = |text: &str| page.push_str(text);
    say("## Config files\n\n");
    say("`accel launch --config-file FILE` (and `ACCEL_CONFIG_FILE`, which every accelerator \
         reads) takes a YAML file of accel's keys and/or Accelerate's, or a DeepSpeed JSON \
         file. `accel config check FILE` says, key by key, what accel makes of a file: \
         applied, ignored (and why), a performance hint it does not follow, or refused.\n\n");
    let ours: Vec<String> =
        accel_core::config::launch_file_keys().iter().map(|k| format!("`{k}`")).collect();
    let _ = writeln!(page, "accel's keys: {}.\n", ours.join(", "));
    let theirs: Vec<String> =
        accel_core::config::accelerate_keys().iter().map(|k| format!("`{k}`")).collect();
    let _ = writeln!(
        page,
        "Accelerate's top-level keys read (with the keys of their sections): {}.\n",
        theirs.join(", ")
    );
    page.push_str(
        "DeepSpeed's JSON: every key gets a note in `accel config check` (its ZeRO stage, \
         precision, accumulation, clipping, loss scaling, offload, bucket sizes and batch \
         sizes are applied).\n\n",
    );
    page.push_str("## The `accel` command\n\n");
    let mut command = super::Cli::command();
    command.build();
    for sub in command.get_subcommands().filter(|c| !c.is_hide_set()) {
        let mut sub = sub.clone();
        let help = sub.render_long_help().to_string();
        let _ =
            writeln!(page, "### `accel {}`\n\n```text\n{}\n```\n", sub.get_name(), help.trim_end());
    }
    page
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    /// docs/reference.md is what the code says: a setting, a variable or a flag added without
    /// its line fails here.
    #[test]
    fn the_reference_page_is_generated_from_the_code() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/reference.md");
        let page = super::markdown();
        if std::env::var_os(accel_core::config::env::BLESS).is_some() {
            std::fs::write(&path, &page).unwrap();
        }
        let written = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            written == page,
            "docs/reference.md differs from the code: regenerate it with `ACCEL_BLESS=1 cargo \
             test -p accel-core --bin accel reference` and review the diff"
        );
    }
}
