//! The library's top-level modules depend on each other in one direction only: from the
//! modules that wire things together (`config`, `admin`, `testing`) down through the
//! domain (`supervisor`, `store`, `cron`, `dispatch`, `reactor`, `accumulator`) to the
//! leaves (`wire`, `codec`, `transport`, `store_error`). A module's unit tests may reach
//! higher (they build whole stacks), so `#[cfg(test)] mod tests` blocks are left out, as
//! are comments.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Top-level module → the top-level modules it names through `crate::`.
fn dependencies() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let modules: BTreeSet<String> = std::fs::read_dir(&src)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter_map(|p| {
            let name = p.file_stem()?.to_str()?.to_string();
            (p.is_dir() || p.extension().is_some_and(|e| e == "rs")).then_some(name)
        })
        .filter(|m| !["lib", "main", "app"].contains(&m.as_str()))
        .collect();
    let mut graph = BTreeMap::new();
    for module in &modules {
        let mut named = BTreeSet::new();
        for file in rust_files(&src, module) {
            let text = std::fs::read_to_string(&file).unwrap();
            for dependency in crate_paths(&code_only(&text)) {
                if modules.contains(&dependency) && &dependency != module {
                    named.insert(dependency);
                }
            }
        }
        graph.insert(module.clone(), named);
    }
    graph
}

fn rust_files(src: &Path, module: &str) -> Vec<std::path::PathBuf> {
    let file = src.join(format!("{module}.rs"));
    if file.exists() {
        return vec![file];
    }
    let mut files = Vec::new();
    let mut dirs = vec![src.join(module)];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    files
}

/// The text without comments and without the unit-test module.
fn code_only(text: &str) -> String {
    let text = match text.find("#[cfg(test)]\nmod tests") {
        Some(at) => &text[..at],
        None => text,
    };
    text.lines()
        .map(|line| match line.find("//") {
            Some(at) => &line[..at],
            None => line,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The first segment of every `crate::` path, including those inside `crate::{…}`.
fn crate_paths(code: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        rest = &rest[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // Items at the group's top level, nested groups skipped.
            let mut depth = 0;
            let mut item_start = true;
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => item_start = true,
                    c if item_start && !c.is_whitespace() => {
                        item_start = false;
                        found.push(first_segment(&group[i..]));
                    }
                    _ => {}
                }
            }
        } else {
            found.push(first_segment(rest));
        }
    }
    found
}

fn first_segment(path: &str) -> String {
    path.chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect()
}

/// A cycle through `start`, if there is one.
fn cycle_from(
    graph: &BTreeMap<String, BTreeSet<String>>,
    start: &str,
    path: &mut Vec<String>,
) -> Option<Vec<String>> {
    let here = path.last().cloned().unwrap_or_else(|| start.to_string());
    for next in graph.get(&here).into_iter().flatten() {
        if next == start {
            let mut cycle = path.clone();
            cycle.push(start.to_string());
            return Some(cycle);
        }
        if !path.contains(next) && next.as_str() > start {
            path.push(next.clone());
            if let Some(cycle) = cycle_from(graph, start, path) {
                return Some(cycle);
            }
            path.pop();
        }
    }
    None
}

#[test]
fn modules_form_a_dag() {
    let graph = dependencies();
    assert!(graph.contains_key("store") && graph.contains_key("accumulator"));
    for start in graph.keys() {
        let mut path = vec![start.clone()];
        if let Some(cycle) = cycle_from(&graph, start, &mut path) {
            panic!("import cycle: {}", cycle.join(" → "));
        }
    }
}

#[test]
fn the_finder_sees_a_cycle() {
    let mut graph = BTreeMap::new();
    graph.insert("a".to_string(), BTreeSet::from(["b".to_string()]));
    graph.insert("b".to_string(), BTreeSet::from(["c".to_string()]));
    graph.insert("c".to_string(), BTreeSet::from(["a".to_string()]));
    let mut path = vec!["a".to_string()];
    assert_eq!(
        cycle_from(&graph, "a", &mut path),
        Some(
            vec!["a", "b", "c", "a"]
                .into_iter()
                .map(String::from)
                .collect()
        )
    );
    assert_eq!(
        crate_paths("use crate::{store::{Store, Lease}, lease};\nlet x = crate::wire::X;"),
        ["store", "lease", "wire"]
    );
}

#[test]
fn the_library_does_not_use_clap() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    for module in dependencies().keys() {
        for file in rust_files(&src, module) {
            let text = std::fs::read_to_string(&file).unwrap();
            assert!(
                !code_only(&text).contains("clap::"),
                "{} uses clap: the command line belongs to src/app",
                file.display()
            );
        }
    }
}
