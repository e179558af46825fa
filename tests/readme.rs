//! The README's quick start is `examples/quickstart.rs`, which cargo builds with the
//! tests: the README shows it as it is, so what it shows compiles. And every default its
//! configuration blocks show as a commented-out line is the default.

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

/// Each whole configuration the README shows (a TOML block `weir run` takes as it is),
/// with the lines of it given as commented-out defaults (`# key = value   # what it
/// does`).
fn config_references() -> Vec<(String, Vec<String>)> {
    // Alternatives and examples rather than defaults (besides lines whose comment says
    // what the default is instead): another broker's URL, librdkafka options, another
    // accumulator kind, schedule bounds, a tenant, secrets, files and origins, a job
    // type's output.
    let examples = [
        "url",
        "options",
        "kind",
        "start",
        "end",
        "tenant",
        "token",
        "tls_cert_file",
        "tls_key_file",
        "allowed_origins",
        "output",
    ];
    let readme = read("README.md");
    readme
        .split("```toml\n")
        .skip(1)
        .filter_map(|block| block.split("\n```").next())
        .filter(|block| parse(block).is_ok())
        .map(|block| {
            let defaults = block
                .lines()
                .filter_map(|line| line.strip_prefix("# "))
                .filter(|line| {
                    let key = line.split('=').next().unwrap_or_default().trim();
                    let comment = line.split_once("  #").map(|(_, c)| c).unwrap_or_default();
                    line.contains(" = ")
                        && !key.starts_with('"')
                        && !examples.contains(&key)
                        && !comment.contains("default")
                })
                .map(|line| line.split("  #").next().unwrap_or(line).trim().to_string())
                .collect();
            (block.to_string(), defaults)
        })
        .collect()
}

/// Keys whose default is taken when the keyed graph or job type is made, not when the
/// file is read.
const APPLIED_WHEN_MADE: [&str; 3] = ["partitions", "max_keys_in_memory", "max_jobs_in_memory"];

/// What the keyed graphs and job types of `config` come to, defaults taken.
fn effective(config: &weir::config::Config) -> String {
    let graphs: Vec<String> = config
        .graphs(&weir::graph::FunctionRegistry::default())
        .unwrap()
        .iter()
        .map(|g| format!("{:?} {:?}", g.keyed, g.reactor))
        .collect();
    let jobs: Vec<String> = config
        .job_types(&weir::jobs::JobHandlers::default())
        .unwrap()
        .iter()
        .map(|j| {
            let (partitions, ttl, most) = (j.partitions, j.lease_ttl, j.max_jobs_in_memory);
            format!("{} {partitions} {:?} {ttl:?} {most}", j.name, j.output)
        })
        .collect();
    format!("{graphs:?} {jobs:?}")
}

fn parse(text: &str) -> Result<weir::config::Config, weir::config::ConfigError> {
    weir::config::Config::parse(text, std::path::Path::new("README.md"), Vec::new())
}

#[test]
fn the_defaults_the_readme_shows_are_the_defaults() {
    let references = config_references();
    let checked: usize = references.iter().map(|(_, d)| d.len()).sum();
    assert!(checked >= 15, "{references:?}");
    for (block, defaults) in &references {
        let shown = format!("{:?}", parse(block).unwrap());
        for default in defaults {
            let commented = format!("# {default}");
            let line = block
                .lines()
                .find(|line| line.starts_with(&commented))
                .expect("the line is in the block");
            let set = block.replacen(line, default, 1);
            let parsed = parse(&set).unwrap_or_else(|e| panic!("`{default}`: {e}"));
            let key = default.split(" = ").next().unwrap_or_default();
            let (left, right) = if APPLIED_WHEN_MADE.contains(&key) {
                (effective(&parsed), effective(&parse(block).unwrap()))
            } else {
                (format!("{parsed:?}"), shown.clone())
            };
            assert_eq!(
                left, right,
                "the README shows `{default}` as a default, and it is not"
            );
        }
    }
}
