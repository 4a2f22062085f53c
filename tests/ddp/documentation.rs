//! The documentation agrees with the code: ARCHITECTURE.md's API boundary lists exactly what
//! `lib.rs` exports, every user document is compiled as a doc-test, and the README stays short.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn repository() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ lies in the repository")
        .to_path_buf()
}

fn read(path: &str) -> String {
    let full = repository().join(path);
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{}: {e}", full.display()))
}

/// The names between backticks in `text`.
fn quoted(text: &str) -> BTreeSet<String> {
    text.split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect()
}

/// The names `lib.rs` puts at the crate root (`pub use`, also with braces), and its public
/// modules (`pub mod`, and a crate re-exported as a module: `pub use other_crate as name`).
fn exported(lib: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    let code: String = lib
        .lines()
        .filter(|line| !line.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n");
    let mut names = BTreeSet::new();
    let mut modules = BTreeSet::new();
    for statement in code.split(';') {
        let Some(path) = statement.trim().strip_prefix("pub use ") else {
            continue;
        };
        if let Some((krate, name)) = path.split_once(" as ")
            && !krate.contains("::")
        {
            modules.insert(name.trim().to_string());
            continue;
        }
        let listed = match path.split_once('{') {
            Some((_, inner)) => inner.trim_end_matches('}').to_string(),
            None => path.rsplit("::").next().unwrap_or(path).to_string(),
        };
        names.extend(
            listed
                .split(',')
                .map(|n| n.trim().to_string())
                .filter(|n| !n.is_empty()),
        );
    }
    modules.extend(
        code.lines()
            .filter_map(|line| line.trim().strip_prefix("pub mod "))
            .map(|m| m.trim_end_matches(';').to_string()),
    );
    (names, modules)
}

/// ARCHITECTURE.md's API boundary: the crate root's names and the public modules' lines.
fn documented(architecture: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    let section = architecture
        .split("## API boundary")
        .nth(1)
        .and_then(|rest| rest.split("\n## ").next())
        .expect("ARCHITECTURE.md has an `## API boundary` section");
    let root = section
        .split("The crate root")
        .nth(1)
        .and_then(|rest| rest.split("\n\n").next())
        .expect("the API boundary lists the crate root");
    let modules = section
        .lines()
        .filter_map(|line| line.strip_prefix("- `"))
        .filter_map(|line| line.split_once("`:").map(|(name, _)| name.to_string()))
        .collect();
    (quoted(root), modules)
}

#[test]
fn the_architecture_lists_exactly_what_lib_rs_exports() {
    let (names, modules) = exported(&read("burn-ddp/src/lib.rs"));
    let (listed_names, listed_modules) = documented(&read("ARCHITECTURE.md"));
    assert_eq!(
        names, listed_names,
        "the crate root (lib.rs) and ARCHITECTURE.md's API boundary differ"
    );
    assert_eq!(
        modules, listed_modules,
        "the public modules (lib.rs) and ARCHITECTURE.md's API boundary differ"
    );
    assert!(names.len() <= 16, "{} names at the crate root", names.len());
    // Eight of burn-ddp's own and `comm`, the communication crate re-exported whole.
    assert!(modules.len() <= 9, "{} public modules", modules.len());
}

#[test]
fn the_parsers_see_what_they_are_given() {
    let (names, modules) = exported(
        "// pub use commented::Out;\npub mod a;\nmod hidden;\npub use x::{B, C};\npub use y::D;\npub use other as z;\n",
    );
    assert_eq!(names, BTreeSet::from(["B", "C", "D"].map(String::from)));
    assert_eq!(modules, BTreeSet::from(["a", "z"].map(String::from)));
    let (names, modules) = documented(
        "## API boundary\n\nThe crate root: `E`, `F`.\n\n- `m`: the m.\n- `n`: `not_a_module`\n\n## Next\n- `o`: no.\n",
    );
    assert_eq!(names, BTreeSet::from(["E", "F"].map(String::from)));
    assert_eq!(modules, BTreeSet::from(["m", "n"].map(String::from)));
}

#[test]
fn every_user_document_is_compiled_as_a_doc_test() {
    let lib = read("burn-ddp/src/lib.rs");
    let mut documents: Vec<String> = std::fs::read_dir(repository().join("docs"))
        .expect("docs/ exists")
        .map(|entry| entry.expect("readable docs/").file_name())
        .map(|name| name.to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".md"))
        .map(|name| format!("docs/{name}"))
        .collect();
    documents.push("README.md".into());
    assert!(documents.len() > 1, "no documents found in docs/");
    for document in documents {
        let included = format!("include_str!(\"../../{document}\")");
        assert!(
            lib.contains(&included),
            "{document} is not compiled as a doc-test: add it to `mod documentation` in \
             burn-ddp/src/lib.rs"
        );
    }
}

#[test]
fn the_readme_is_read_in_five_minutes() {
    let bytes = read("README.md").len();
    assert!(
        bytes <= 12 * 1024,
        "README.md is {bytes} bytes, more than 12 KiB: move the detail into docs/"
    );
}
