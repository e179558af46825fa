//! The deployment files under `deploy/` against the code: the dashboard and the alert
//! rules query only metrics weir exports, every alert is complete, and the example
//! configuration is one `weir run` accepts. No services needed.

use std::path::{Path, PathBuf};

use serde_json::Value;
use weir::config::Config;
use weir::graph::FunctionRegistry;
use weir::metrics;

fn repo_file(relative: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(relative)
}

fn read(relative: &str) -> String {
    let path = repo_file(relative);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {relative}: {e}"))
}

/// The histograms among the exported metrics: Prometheus exposes each as
/// `<name>_bucket`, `<name>_sum` and `<name>_count`.
const HISTOGRAMS: &[&str] = &[
    metrics::FIRE_DURATION_SECONDS,
    metrics::TICK_LATENESS_SECONDS,
    metrics::TASK_DURATION_SECONDS,
    metrics::TASK_WAIT_SECONDS,
];

/// Every `weir_[a-z0-9_]+` identifier in a PromQL expression.
fn metric_identifiers(expr: &str) -> Vec<String> {
    let bytes = expr.as_bytes();
    let mut found = Vec::new();
    let mut at = 0;
    while let Some(offset) = expr[at..].find("weir_") {
        let start = at + offset;
        // A match inside a longer identifier (`xweir_...`) is not a metric name.
        let inside_word = start > 0
            && (bytes[start - 1].is_ascii_alphanumeric()
                || bytes[start - 1] == b'_'
                || bytes[start - 1] == b':');
        let end = start
            + expr[start..]
                .bytes()
                .take_while(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'_')
                .count();
        if !inside_word {
            found.push(expr[start..end].to_string());
        }
        at = end;
    }
    found
}

/// The exported metric a queried series belongs to: a histogram's `_bucket`, `_sum` and
/// `_count` series belong to the histogram.
fn base_metric(name: &str) -> &str {
    for suffix in ["_bucket", "_sum", "_count"] {
        if let Some(base) = name.strip_suffix(suffix) {
            if HISTOGRAMS.contains(&base) {
                return base;
            }
        }
    }
    name
}

/// Asserts every metric an expression queries is one weir exports.
fn assert_known_metrics(origin: &str, expr: &str) {
    for name in metric_identifiers(expr) {
        let base = base_metric(&name);
        assert!(
            metrics::ALL.contains(&base),
            "{origin}: {name} is not a metric weir exports (weir::metrics::ALL); in {expr}"
        );
    }
}

fn collect_exprs(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            for (key, item) in map {
                match (key.as_str(), item) {
                    ("expr", Value::String(expr)) => out.push(expr.clone()),
                    _ => collect_exprs(item, out),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|item| collect_exprs(item, out)),
        _ => {}
    }
}

fn dashboard() -> Value {
    let text = read("deploy/grafana/weir-dashboard.json");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("weir-dashboard.json: {e}"))
}

#[test]
fn histograms_are_exported_metrics() {
    for h in HISTOGRAMS {
        assert!(metrics::ALL.contains(h), "{h}");
    }
}

#[test]
fn metric_identifiers_are_found_whole() {
    assert_eq!(
        metric_identifiers(
            r#"histogram_quantile(0.99, sum by (le) (rate(weir_task_wait_seconds_bucket{executor="a"}[5m]))) / weir_worker_capacity"#
        ),
        ["weir_task_wait_seconds_bucket", "weir_worker_capacity"]
    );
    assert!(metric_identifiers("not_weir_a + xweir_b").is_empty());
    assert_eq!(
        base_metric("weir_fire_duration_seconds_bucket"),
        "weir_fire_duration_seconds"
    );
    // Only histograms have series suffixes; a counter named like one stays as it is.
    assert_eq!(
        base_metric("weir_events_total_count"),
        "weir_events_total_count"
    );
}

#[test]
fn dashboard_queries_only_exported_metrics() {
    let dashboard = dashboard();
    let panels = dashboard["panels"]
        .as_array()
        .expect("the dashboard has a panels list");
    assert!(!panels.is_empty(), "the dashboard has no panels");

    // Every panel showing data has a query (rows only group panels).
    for panel in panels {
        if panel["type"] == "row" {
            continue;
        }
        let mut exprs = Vec::new();
        collect_exprs(&panel["targets"], &mut exprs);
        assert!(
            exprs.iter().any(|e| !e.trim().is_empty()),
            "panel {} has no query",
            panel["title"]
        );
    }

    let mut exprs = Vec::new();
    collect_exprs(&dashboard, &mut exprs);
    // Template variables query label values of metrics too.
    for variable in dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
    {
        if let Some(query) = variable["query"]["query"].as_str() {
            exprs.push(query.to_string());
        }
    }
    assert!(exprs.len() >= 20, "only {} queries found", exprs.len());
    for expr in &exprs {
        assert_known_metrics("weir-dashboard.json", expr);
    }
}

/// One alerting rule as read from the rules file.
#[derive(Debug, Default)]
struct AlertRule {
    alert: String,
    expr: String,
    summary: String,
}

fn unquote(value: &str) -> String {
    let v = value.trim();
    let quoted = v.len() >= 2
        && ((v.starts_with('"') && v.ends_with('"')) || (v.starts_with('\'') && v.ends_with('\'')));
    if quoted { &v[1..v.len() - 1] } else { v }.to_string()
}

/// Reads the alerting rules of a Prometheus rules file by indentation: `- alert:` starts
/// a rule; `expr:` is a one-line value or a `|` / `>` block; `summary:` is read under
/// the rule's `annotations:`. Enough for the file weir ships, without a YAML parser.
fn alert_rules(text: &str) -> Vec<AlertRule> {
    let lines: Vec<&str> = text.lines().collect();
    let mut rules: Vec<AlertRule> = Vec::new();
    let mut annotations_indent: Option<usize> = None;
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        i += 1;
        let trimmed = line.trim_start();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        let mut indent = line.len() - trimmed.len();
        let entry = match trimmed.strip_prefix("- ") {
            Some(rest) => {
                indent += 2;
                rest
            }
            None => trimmed,
        };
        let Some((key, value)) = entry.split_once(':') else {
            continue;
        };
        let (key, value) = (key.trim(), value.trim());
        if annotations_indent.is_some_and(|a| indent <= a) {
            annotations_indent = None;
        }
        match key {
            "alert" => rules.push(AlertRule {
                alert: unquote(value),
                ..AlertRule::default()
            }),
            "expr" => {
                let expr = if value.starts_with('|') || value.starts_with('>') {
                    let mut block = Vec::new();
                    while i < lines.len() {
                        let next = lines[i];
                        let next_indent = next.len() - next.trim_start().len();
                        if !next.trim().is_empty() && next_indent <= indent {
                            break;
                        }
                        block.push(next.trim());
                        i += 1;
                    }
                    block.join("\n")
                } else {
                    unquote(value)
                };
                if let Some(rule) = rules.last_mut() {
                    rule.expr = expr;
                }
            }
            "annotations" => annotations_indent = Some(indent),
            "summary" if annotations_indent.is_some() => {
                if let Some(rule) = rules.last_mut() {
                    rule.summary = unquote(value);
                }
            }
            _ => {}
        }
    }
    rules
}

#[test]
fn alert_rules_are_complete_and_query_only_exported_metrics() {
    let text = read("deploy/prometheus/alerts.yml");
    let rules = alert_rules(&text);
    let declared = text
        .lines()
        .filter(|l| l.trim_start().starts_with("- alert:"))
        .count();
    assert_eq!(rules.len(), declared, "every rule was read: {rules:#?}");
    assert!(rules.len() >= 5, "{rules:#?}");
    for rule in &rules {
        assert!(!rule.alert.is_empty(), "a rule without a name: {rule:?}");
        assert!(!rule.expr.is_empty(), "{} has no expr", rule.alert);
        assert!(
            !rule.summary.is_empty(),
            "{} has no annotations.summary",
            rule.alert
        );
        assert_known_metrics(&format!("alerts.yml {}", rule.alert), &rule.expr);
    }
    // The conditions operators need paged on are all covered.
    let all_exprs: String = rules.iter().map(|r| r.expr.as_str()).collect();
    for metric in [
        metrics::REACTOR_STATE,
        metrics::LEASE_ACQUISITIONS_TOTAL,
        metrics::DEAD_LETTERS_TOTAL,
        "weir_cron_tick_lateness_seconds_bucket",
        metrics::WORKER_CAPACITY_IN_USE,
    ] {
        assert!(all_exprs.contains(metric), "no alert on {metric}");
    }
}

#[test]
fn alert_rules_reader_handles_block_exprs_and_nested_annotations() {
    let rules = alert_rules(
        "groups:\n  - name: g\n    rules:\n      - alert: A\n        expr: |\n          sum(weir_events_total)\n            > 1\n        labels:\n          summary: not this\n        annotations:\n          summary: \"the summary\"\n      - alert: B\n        expr: weir_queue_depth > 0\n",
    );
    assert_eq!(rules.len(), 2);
    assert_eq!(rules[0].expr, "sum(weir_events_total)\n> 1");
    assert_eq!(rules[0].summary, "the summary");
    assert_eq!(rules[1].expr, "weir_queue_depth > 0");
    assert!(rules[1].summary.is_empty());
}

/// The text of a TOML file without the named top-level tables.
fn without_tables(text: &str, tables: &[&str]) -> String {
    let mut skipping = false;
    let mut kept = String::new();
    for line in text.lines() {
        let header = line.trim();
        if header.starts_with('[') {
            let name = header.trim_matches(|c| c == '[' || c == ']');
            skipping = tables.contains(&name);
        }
        if !skipping {
            kept.push_str(line);
            kept.push('\n');
        }
    }
    kept
}

/// The `weir.toml` embedded in the Kubernetes ConfigMap (a `|` block under `data`).
fn configmap_weir_toml() -> String {
    let text = read("deploy/k8s/configmap.yaml");
    let mut lines = text.lines().skip_while(|l| l.trim() != "weir.toml: |");
    let header = lines
        .next()
        .expect("configmap.yaml has a weir.toml: | block");
    let header_indent = header.len() - header.trim_start().len();
    let mut toml = String::new();
    for line in lines {
        let indent = line.len() - line.trim_start().len();
        if !line.trim().is_empty() && indent <= header_indent {
            break;
        }
        toml.push_str(line.get(header_indent + 2..).unwrap_or("").trim_end());
        toml.push('\n');
    }
    toml
}

/// What the example configurations declare, beyond being accepted.
fn check_config(name: &str, text: &str) {
    // As deployed: the token comes from the environment (a Secret, compose's variable).
    let token = [(
        "WEIR__ADMIN__TOKEN".to_string(),
        "from-a-secret".to_string(),
    )];
    let config =
        Config::parse(text, Path::new(name), token).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert!(!config.graphs.is_empty(), "{name} declares no graph");
    config
        .graphs(&FunctionRegistry::default())
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    assert!(!config.schedules.is_empty(), "{name} declares no schedule");
    assert!(!config.workflows.is_empty(), "{name} declares no workflow");
    let router = config.router().unwrap_or_else(|e| panic!("{name}: {e}"));
    // The workers are started with --executor default: the workflow's tasks must go there.
    let workflow = config.workflows[0].workflow(0).unwrap();
    for task in &config.workflows[0].tasks {
        assert_eq!(
            router.topic(&workflow.namespace(&task.id)),
            "weir.tasks.default",
            "{name}: task {} is routed away from the default executor",
            task.id
        );
    }
}

/// Everything of the examples the current configuration knows: graphs, schedules,
/// workflows and routes (the listener tables left out).
#[test]
fn example_configs_declare_valid_graphs_schedules_workflows_and_routes() {
    for (name, text) in [
        ("deploy/compose/weir.toml", read("deploy/compose/weir.toml")),
        ("deploy/k8s/configmap.yaml", configmap_weir_toml()),
    ] {
        check_config(name, &without_tables(&text, &["metrics", "admin"]));
    }
}

#[test]
fn example_configs_parse_whole() {
    for (name, text) in [
        ("deploy/compose/weir.toml", read("deploy/compose/weir.toml")),
        ("deploy/k8s/configmap.yaml", configmap_weir_toml()),
    ] {
        check_config(name, &text);
    }
}

/// Nothing shipped serves an open admin API: the configs listen on every interface, so
/// without the token they are refused, and every deployment supplies the token from a
/// secret.
#[test]
fn shipped_deployments_never_open_the_admin_api() {
    for (name, text) in [
        ("deploy/compose/weir.toml", read("deploy/compose/weir.toml")),
        ("deploy/k8s/configmap.yaml", configmap_weir_toml()),
    ] {
        let refused = Config::parse(&text, Path::new(name), std::iter::empty())
            .err()
            .unwrap_or_else(|| panic!("{name} starts without an admin token"));
        assert!(
            refused.to_string().contains("admin.listen"),
            "{name}: {refused}"
        );
    }
    for pod in ["deploy/k8s/run.yaml", "deploy/k8s/worker.yaml"] {
        let text = read(pod);
        let token = text
            .find("name: WEIR__ADMIN__TOKEN")
            .unwrap_or_else(|| panic!("{pod} sets no admin token"));
        let source: String = text[token..].lines().take(5).collect();
        assert!(
            source.contains("secretKeyRef") && source.contains("weir-admin"),
            "{pod}: the token must come from the weir-admin Secret: {source}"
        );
    }
    let compose = read("deploy/compose/docker-compose.yml");
    assert!(
        compose.contains("WEIR__ADMIN__TOKEN: ${WEIR_ADMIN_TOKEN:?"),
        "compose must refuse to start without WEIR_ADMIN_TOKEN"
    );
}
