//! Config parsing with environment overrides: the input is a TOML text, then (after a
//! NUL byte) `KEY=VALUE` lines read as `WEIR__…` variables.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let (toml, env) = text.split_once('\0').unwrap_or((text, ""));
    let env: Vec<(String, String)> = env
        .lines()
        .filter_map(|line| line.split_once('='))
        .map(|(k, v)| (format!("WEIR__{k}"), v.to_string()))
        .collect();
    if let Ok(config) = weir::config::Config::parse(toml, Path::new("fuzz.toml"), env) {
        // What validates converts: graphs, schedules, workflows and routes.
        let _ = config.graphs(&weir::graph::FunctionRegistry::default());
        let _ = config.declared_schedules();
        let _ = config.workflows();
        let _ = config.router();
    }
});
