//! Reading the project's Markdown docs in the tests that hold them to the code: a doc by name,
//! its fenced blocks, its tables' rows and the `` `literals` `` in a cell.

use std::path::Path;

/// The text of `docs/<name>` in the workspace.
///
/// # Panics
/// When the file cannot be read: the test that asked for it cannot run.
pub fn doc(name: &str) -> String {
    workspace_file(&format!("docs/{name}"))
}

/// The text of a file of the workspace, by its path from the workspace's root (a source the
/// docs are held to: `crates/simlock-daemon/src/http/mod.rs`).
///
/// # Panics
/// When the file cannot be read: the test that asked for it cannot run.
#[allow(clippy::panic, reason = "a test helper fails the test that asked")]
pub fn workspace_file(relative: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(relative);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every fenced block: (info string, body).
pub fn blocks(doc: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut lines = doc.lines();
    while let Some(line) = lines.next() {
        if let Some(info) = line.strip_prefix("```") {
            let body: Vec<&str> = lines
                .by_ref()
                .take_while(|l| !l.starts_with("```"))
                .collect();
            out.push((info.trim().to_owned(), body.join("\n")));
        }
    }
    out
}

/// The cells of a table row, trimmed (`None` for a line that is not a row).
pub fn cells(line: &str) -> Option<Vec<&str>> {
    let inner = line.trim().strip_prefix('|')?.strip_suffix('|')?;
    Some(inner.split('|').map(str::trim).collect())
}

/// The rows of the table whose header line is `header`, without the separator.
///
/// # Panics
/// When no table has that header.
pub fn table<'a>(doc: &'a str, header: &str) -> Vec<Vec<&'a str>> {
    let mut lines = doc.lines().skip_while(|l| l.trim() != header);
    assert!(lines.next().is_some(), "no table headed {header:?}");
    lines.skip(1).map_while(cells).collect()
}

/// The first `` `literal` `` in `text`.
pub fn first_code(text: &str) -> Option<&str> {
    let start = text.find('`')? + 1;
    let len = text[start..].find('`')?;
    Some(&text[start..start + len])
}

/// Every `` `literal` `` in `text`.
pub fn codes(text: &str) -> Vec<&str> {
    text.split('`').skip(1).step_by(2).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_blocks_and_literals_are_read_as_written() {
        let doc =
            "intro\n\n| a | b |\n|---|---|\n| `x` | y `z` w |\n\nafter\n```toml\nk = 1\n```\n";
        assert_eq!(table(doc, "| a | b |"), vec![vec!["`x`", "y `z` w"]]);
        assert_eq!(blocks(doc), vec![("toml".to_owned(), "k = 1".to_owned())]);
        assert_eq!(first_code("y `z` w"), Some("z"));
        assert_eq!(codes("`a` and `b`"), vec!["a", "b"]);
        assert_eq!(cells("not a row"), None);
        assert!(doc_exists());
    }

    fn doc_exists() -> bool {
        !doc("HTTP-API.md").is_empty()
    }
}
