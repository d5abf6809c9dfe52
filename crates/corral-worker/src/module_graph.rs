//! The worker's modules import each other without a cycle: this test reads the crate's
//! sources, takes every `crate::` path of each top-level module (a directory module counts as
//! one) and every `super::` path between the files of a directory module, and fails naming the
//! first cycle it finds. Test code (`#[cfg(test)]` items and files) is left out: a test may use
//! any module.
//!
//! The reading is deliberately narrow (comments and literals blanked, then tokens): a path it
//! cannot attribute to a module fails the test rather than being skipped, so the check cannot
//! pass by missing an import.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Modules (or files) and the ones each imports.
type Graph = BTreeMap<String, BTreeSet<String>>;

/// The source of a Rust file with comments, string and character literals blanked (each
/// becomes a space), so that paths and braces can be found by scanning.
fn blank_comments_and_literals(source: &str) -> String {
    let chars: Vec<char> = source.chars().collect();
    let at = |i: usize| chars.get(i).copied().unwrap_or('\0');
    let mut out = String::with_capacity(source.len());
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '/' && at(i + 1) == '/' {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
            out.push(' ');
        } else if c == '/' && at(i + 1) == '*' {
            let mut depth = 0;
            loop {
                assert!(i < chars.len(), "unterminated block comment");
                if chars[i] == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if chars[i] == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            out.push(' ');
        } else if c == 'r' && (at(i + 1) == '"' || at(i + 1) == '#') && raw_string_end(&chars, i + 1).is_some() {
            i = raw_string_end(&chars, i + 1).unwrap_or(chars.len());
            out.push(' ');
        } else if c == '"' {
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                i += if chars[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            out.push(' ');
        } else if c == '\'' && at(i + 1) == '\\' {
            // An escaped character: '\n', '\'', '\u{1F600}'.
            i += 3;
            while i < chars.len() && chars[i] != '\'' {
                i += 1;
            }
            i += 1;
            out.push(' ');
        } else if c == '\'' && at(i + 2) == '\'' {
            i += 3;
            out.push(' ');
        } else {
            // Anything else, a lifetime's quote included.
            out.push(c);
            i += 1;
        }
    }
    out
}

/// Where the raw string whose hashes or quote start at `start` ends (the index after it); None
/// when `start` does not open one (`r#ident` is a raw identifier).
fn raw_string_end(chars: &[char], start: usize) -> Option<usize> {
    let hashes = chars[start..].iter().take_while(|c| **c == '#').count();
    if chars.get(start + hashes) != Some(&'"') {
        return None;
    }
    let mut i = start + hashes + 1;
    while i < chars.len() {
        if chars[i] == '"' && chars[i + 1..].iter().take(hashes).filter(|c| **c == '#').count() == hashes {
            return Some(i + 1 + hashes);
        }
        i += 1;
    }
    panic!("unterminated raw string");
}

/// Identifiers, `::`, and every other character on its own.
fn tokens(code: &str) -> Vec<String> {
    let chars: Vec<char> = code.chars().collect();
    let mut tokens = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_whitespace() {
            i += 1;
        } else if c.is_alphanumeric() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            tokens.push(chars[start..i].iter().collect());
        } else if c == ':' && chars.get(i + 1) == Some(&':') {
            tokens.push("::".to_owned());
            i += 2;
        } else {
            tokens.push(c.to_string());
            i += 1;
        }
    }
    tokens
}

fn is_ident(token: &str) -> bool {
    token.chars().next().is_some_and(|c| c.is_alphabetic() || c == '_')
}

/// The tokens of a file without its test code: each `#[cfg(test)]` item (up to its `;`, or its
/// block) is dropped. Returns them with the modules declared as test-only files (`mod x;`).
fn without_tests(tokens: &[String]) -> (Vec<String>, BTreeSet<String>) {
    const CFG_TEST: [&str; 7] = ["#", "[", "cfg", "(", "test", ")", "]"];
    let mut kept = Vec::new();
    let mut test_files = BTreeSet::new();
    let mut i = 0;
    while i < tokens.len() {
        if tokens[i] == "cfg" {
            let conditions: Vec<&str> = tokens[i..].iter().take(4).map(String::as_str).collect();
            assert!(
                conditions == ["cfg", "(", "test", ")"] || !conditions.contains(&"test"),
                "only plain #[cfg(test)] is understood here: {conditions:?}"
            );
        }
        if tokens[i..].iter().take(CFG_TEST.len()).map(String::as_str).eq(CFG_TEST) {
            i += CFG_TEST.len();
            // More attributes of the same item.
            while tokens.get(i).map(String::as_str) == Some("#") {
                i = matching(tokens, i + 1) + 1;
            }
            if let [module, name, semicolon] = &tokens[i..(i + 3).min(tokens.len())] {
                if module == "mod" && semicolon == ";" {
                    test_files.insert(name.clone());
                }
            }
            while i < tokens.len() && tokens[i] != ";" && tokens[i] != "{" {
                i += 1;
            }
            if tokens.get(i).map(String::as_str) == Some("{") {
                i = matching(tokens, i);
            }
            i += 1;
        } else {
            kept.push(tokens[i].clone());
            i += 1;
        }
    }
    (kept, test_files)
}

/// The index of the bracket that closes the one at `open`.
fn matching(tokens: &[String], open: usize) -> usize {
    let (opening, closing) = match tokens[open].as_str() {
        "{" => ("{", "}"),
        "[" => ("[", "]"),
        "(" => ("(", ")"),
        other => panic!("not an opening bracket: {other}"),
    };
    let mut depth = 0;
    for (i, token) in tokens.iter().enumerate().skip(open) {
        if token == opening {
            depth += 1;
        } else if token == closing {
            depth -= 1;
            if depth == 0 {
                return i;
            }
        }
    }
    panic!("unbalanced {opening}");
}

/// The paths of a use tree (or of a path in code) starting at `start`: each with the name it
/// brings in (its alias, else its last segment). Stops where the path does.
fn use_tree(tokens: &[String], start: usize) -> Vec<(Vec<String>, String)> {
    let mut prefix = Vec::new();
    let mut i = start;
    loop {
        match tokens.get(i).map(String::as_str) {
            Some("{") => {
                let end = matching(tokens, i);
                let mut paths = Vec::new();
                let mut element = i + 1;
                while element < end {
                    for (path, name) in use_tree(tokens, element) {
                        paths.push(([prefix.clone(), path].concat(), name));
                    }
                    let mut depth = 0;
                    while element < end && !(depth == 0 && tokens[element] == ",") {
                        match tokens[element].as_str() {
                            "{" => depth += 1,
                            "}" => depth -= 1,
                            _ => {}
                        }
                        element += 1;
                    }
                    element += 1;
                }
                return paths;
            }
            Some("*") => return vec![(prefix, "*".to_owned())],
            Some(segment) if is_ident(segment) => {
                prefix.push(segment.to_owned());
                if tokens.get(i + 1).map(String::as_str) == Some("::") {
                    i += 2;
                    continue;
                }
                let name = match (tokens.get(i + 1).map(String::as_str), tokens.get(i + 2)) {
                    (Some("as"), Some(alias)) => alias.clone(),
                    _ => segment.to_owned(),
                };
                return vec![(prefix, name)];
            }
            _ => return Vec::new(),
        }
    }
}

/// Every path that starts with `root::` (`crate` or `super`) in `tokens`.
fn paths_from(tokens: &[String], root: &str) -> Vec<Vec<String>> {
    let mut paths = Vec::new();
    for i in 0..tokens.len().saturating_sub(2) {
        if tokens[i] == root && tokens[i + 1] == "::" {
            paths.extend(use_tree(tokens, i + 2).into_iter().map(|(path, _)| path));
        }
    }
    paths
}

/// A module file (`lib.rs` or a directory's `mod.rs`): the modules it declares, those declared
/// for tests only, what its `use` items re-export (name to module) and the items it defines.
struct Parent {
    modules: BTreeSet<String>,
    test_modules: BTreeSet<String>,
    reexports: BTreeMap<String, String>,
    defines: BTreeSet<String>,
}

fn parent(path: &Path) -> Parent {
    let source = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let (tokens, test_modules) = without_tests(&tokens(&blank_comments_and_literals(&source)));
    let mut modules = BTreeSet::new();
    let mut uses = Vec::new();
    let mut defines = BTreeSet::new();
    for (i, token) in tokens.iter().enumerate() {
        let next = tokens.get(i + 1).map(String::as_str).unwrap_or_default();
        match token.as_str() {
            "mod" if tokens.get(i + 2).map(String::as_str) == Some(";") => {
                modules.insert(next.to_owned());
            }
            "mod" => panic!("{}: inline module {next}: this check reads one module per file", path.display()),
            "use" => uses.extend(use_tree(&tokens, i + 1)),
            "struct" | "enum" | "trait" | "fn" | "const" | "static" | "type" if is_ident(next) => {
                defines.insert(next.to_owned());
            }
            _ => {}
        }
    }
    let mut reexports = BTreeMap::new();
    for (path, name) in uses {
        let mut segments = path.iter().skip_while(|s| *s == "self" || *s == "crate");
        if let Some(module) = segments.next().filter(|m| modules.contains(*m)) {
            reexports.insert(name, module.clone());
        }
    }
    Parent { modules, test_modules, reexports, defines }
}

/// The tokens of a file without its test code.
fn code_of(path: &Path) -> Vec<String> {
    let source = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    without_tests(&tokens(&blank_comments_and_literals(&source))).0
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// The files of a directory module other than `mod.rs` and its test files, by module name.
fn files_of(dir: &Path, declared: &Parent) -> BTreeMap<String, PathBuf> {
    let mut files = BTreeMap::new();
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.expect("directory entry").path();
        assert!(!path.is_dir(), "{}: nested module directories are not read by this check", path.display());
        let name = path.file_stem().and_then(|s| s.to_str()).expect("a file name").to_owned();
        if name == "mod" || declared.test_modules.contains(&name) {
            continue;
        }
        assert!(declared.modules.contains(&name), "{}: not declared in mod.rs", path.display());
        files.insert(name, path);
    }
    files
}

/// The modules of the crate and the modules each one's code imports through `crate::`.
fn crate_graph() -> Graph {
    let root = parent(&src().join("lib.rs"));
    let mut graph = Graph::new();
    for module in &root.modules {
        let (files, super_is_root): (Vec<PathBuf>, Vec<bool>) = if src().join(module).is_dir() {
            let dir = src().join(module);
            let declared = parent(&dir.join("mod.rs"));
            let mut files = vec![(dir.join("mod.rs"), true)];
            files.extend(files_of(&dir, &declared).into_values().map(|f| (f, false)));
            files.into_iter().unzip()
        } else {
            (vec![src().join(format!("{module}.rs"))], vec![false])
        };
        let mut imports = BTreeSet::new();
        for (file, super_is_root) in files.iter().zip(super_is_root) {
            let code = code_of(file);
            let mut paths = paths_from(&code, "crate");
            if super_is_root {
                paths.extend(paths_from(&code, "super"));
            } else if !src().join(module).is_dir() {
                assert!(paths_from(&code, "super").is_empty(), "{}: super:: outside tests", file.display());
            }
            for path in paths {
                let first = &path[0];
                let target = if root.modules.contains(first) {
                    first
                } else if let Some(module) = root.reexports.get(first) {
                    module
                } else {
                    panic!("{}: cannot tell which module crate::{} is in", file.display(), path.join("::"));
                };
                if target != module {
                    imports.insert(target.clone());
                }
            }
        }
        graph.insert(module.clone(), imports);
    }
    graph
}

/// The files of directory module `module` and the files each one imports (`super::`, or
/// `crate::<module>::`); what `mod.rs` itself defines is no file's.
fn directory_graph(module: &str) -> Graph {
    let dir = src().join(module);
    let declared = parent(&dir.join("mod.rs"));
    let files = files_of(&dir, &declared);
    let mut graph = Graph::new();
    for (name, file) in &files {
        let code = code_of(file);
        let mut paths = paths_from(&code, "super");
        let within = paths_from(&code, "crate").into_iter().filter(|p| p.first().map(String::as_str) == Some(module));
        paths.extend(within.map(|p| p[1..].to_vec()));
        let mut imports = BTreeSet::new();
        for path in paths {
            let Some(first) = path.first() else { continue };
            assert_ne!(first, "super", "{}: super::super:: is not read by this check", file.display());
            let target = if files.contains_key(first) {
                first
            } else if let Some(sibling) = declared.reexports.get(first) {
                sibling
            } else if declared.defines.contains(first) || first == "*" {
                continue;
            } else {
                panic!("{}: cannot tell which file super::{} is in", file.display(), path.join("::"));
            };
            if target != name {
                imports.insert(target.clone());
            }
        }
        graph.insert(name.clone(), imports);
    }
    graph
}

/// A cycle of `graph`, as the path that closes it, if there is one.
fn cycle(graph: &Graph) -> Option<Vec<String>> {
    fn visit(node: &str, graph: &Graph, path: &mut Vec<String>, done: &mut BTreeSet<String>) -> Option<Vec<String>> {
        if let Some(start) = path.iter().position(|n| n == node) {
            let mut cycle = path[start..].to_vec();
            cycle.push(node.to_owned());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_owned());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, graph, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        done.insert(node.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    graph.keys().find_map(|node| visit(node, graph, &mut Vec::new(), &mut done))
}

fn render(graph: &Graph) -> String {
    graph.iter().map(|(node, imports)| format!("  {node} -> {imports:?}\n")).collect()
}

#[test]
fn the_modules_of_the_worker_import_each_other_without_a_cycle() {
    let graph = crate_graph();
    // The reading found the imports it must find.
    for (module, import) in [("runtime", "reconcile"), ("runtime", "link"), ("link", "devices"), ("reconcile", "gang")]
    {
        assert!(graph[module].contains(import), "{module} imports {import}, but the graph says:\n{}", render(&graph));
    }
    if let Some(cycle) = cycle(&graph) {
        panic!("the worker's modules import each other in a cycle: {}\n{}", cycle.join(" -> "), render(&graph));
    }
}

#[test]
fn the_files_of_each_directory_module_import_each_other_without_a_cycle() {
    let root = parent(&src().join("lib.rs"));
    let directories: Vec<&String> = root.modules.iter().filter(|m| src().join(m).is_dir()).collect();
    assert!(directories.len() >= 4, "{directories:?}");
    for module in directories {
        let graph = directory_graph(module);
        if let Some(cycle) = cycle(&graph) {
            panic!("the files of {module}/ import each other in a cycle: {}\n{}", cycle.join(" -> "), render(&graph));
        }
    }
    let executor = directory_graph("executor");
    assert!(executor["process"].contains("job") && executor["job"].contains("output"), "{}", render(&executor));
}

#[test]
fn a_cycle_is_found_and_named() {
    let graph: Graph = [("a", vec!["b"]), ("b", vec!["c"]), ("c", vec!["a"]), ("d", vec!["a"])]
        .into_iter()
        .map(|(node, imports)| (node.to_owned(), imports.into_iter().map(str::to_owned).collect()))
        .collect();
    assert_eq!(cycle(&graph), Some(["a", "b", "c", "a"].map(str::to_owned).to_vec()));
    let mut acyclic = graph;
    acyclic.get_mut("c").expect("c").clear();
    assert_eq!(cycle(&acyclic), None);
}

#[test]
fn paths_are_read_from_code_only() {
    let source = r##"
        //! crate::documented is not an import
        use crate::{a::One, b::{self, Two as Deux}, c};
        use crate::d::*;
        fn f() -> &'static str {
            let _ = crate::e::call();
            let _ = '"'; let _ = '\'';
            "crate::in_a_string"; r#"crate::raw " string"#
        }
        /* crate::in_a /* nested */ comment */
        #[cfg(test)]
        mod tests { use crate::test_only; }
        #[cfg(test)]
        mod testing;
    "##;
    let (code, test_files) = without_tests(&tokens(&blank_comments_and_literals(source)));
    let firsts: Vec<String> = paths_from(&code, "crate").into_iter().map(|p| p[0].clone()).collect();
    assert_eq!(firsts, ["a", "b", "b", "c", "d", "e"]);
    assert_eq!(test_files, BTreeSet::from(["testing".to_owned()]));
    let names: Vec<String> = use_tree(&tokens("x::{y::Z as W, V}"), 0).into_iter().map(|(_, name)| name).collect();
    assert_eq!(names, ["W", "V"]);
}
