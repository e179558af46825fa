//! The README's quick start is `examples/quickstart.rs`, which cargo builds with the
//! tests: the README shows it as it is, so what it shows compiles.

fn read(path: &str) -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn the_readme_quick_start_is_the_example() {
    let readme = read("README.md");
    let section = readme
        .split("## Quick start")
        .nth(1)
        .expect("the README has a quick start");
    let shown = section
        .split("```rust\n")
        .nth(1)
        .and_then(|block| block.split("\n```").next())
        .expect("the quick start shows Rust code");
    let example = read("examples/quickstart.rs");
    // The example's module doc says where it is shown; the README shows the code.
    let code: Vec<&str> = example
        .lines()
        .skip_while(|line| line.starts_with("//!"))
        .skip_while(|line| line.is_empty())
        .collect();
    assert_eq!(
        shown.trim_end(),
        code.join("\n").trim_end(),
        "the README's quick start differs from examples/quickstart.rs: copy the example"
    );
}
