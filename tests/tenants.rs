//! Two tenants on one NATS JetStream and one Redis, each with a graph `orders`, a
//! workflow `report` and a schedule `tick` starting it every second, run by one `weir run`
//! and a worker per tenant. Neither sees nor changes the other's messages, state or admin
//! data, and each tenant's cron ticks reach its own workflow.
#![cfg(feature = "it")]

mod common;

use std::io::Write;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::services;
use serde_json::{json, Value};
use weir::transport::{Assignment, Broker, Outbound, Subscription};

const OPERATOR_TOKEN: &str = "operator-token-1";

struct Processes(Vec<Child>);

impl Drop for Processes {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn tenant_sections(tenant: &str) -> String {
    format!(
        r#"
[[graph]]
name = "orders"
tenant = "{tenant}"
criteria = "when_any"
strategy = "sequential"
function = "snapshot"
output = "orders.out"
snapshot_interval_ms = 0
[[graph.accumulator]]
name = "a"
topic = "orders.in"
format = "json"

[[workflow]]
name = "report"
tenant = "{tenant}"
[[workflow.task]]
id = "t"
handler = "builtin::echo"

[[schedule]]
id = "tick"
tenant = "{tenant}"
cron = "* * * * * *"
workflow = "report"
payload = {{ tenant = "{tenant}" }}
"#
    )
}

/// `weir` with `args`, its admin API on `admin_port`.
fn weir(config: &Path, log: &str, admin_port: u16, args: &[&str]) -> Child {
    let log = std::fs::File::create(std::env::temp_dir().join(log)).unwrap();
    Command::new(env!("CARGO_BIN_EXE_weir"))
        .args(args)
        .arg("--config")
        .arg(config)
        .env("WEIR__ADMIN__LISTEN", format!("127.0.0.1:{admin_port}"))
        .env("WEIR_LOG", "info")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("weir starts")
}

async fn get(admin: &str, path: &str, token: &str) -> (u16, Value) {
    let client =
        weir::admin::client::AdminClient::new(admin, Some(token.to_string()), None).unwrap();
    match client.get(path).await {
        Ok(value) => (200, value),
        Err(weir::admin::AdminError::Status { status, .. }) => (status, Value::Null),
        // Not listening yet.
        Err(weir::admin::AdminError::Connect { .. }) => (0, Value::Null),
        Err(e) => panic!("GET {path}: {e}"),
    }
}

/// A POST as `token`: the status, and the answer when it is 200.
async fn post(admin: &str, path: &str, token: &str) -> (u16, Value) {
    let client =
        weir::admin::client::AdminClient::new(admin, Some(token.to_string()), None).unwrap();
    match client.post(path, None).await {
        Ok(value) => (200, value),
        Err(weir::admin::AdminError::Status { status, .. }) => (status, Value::Null),
        Err(e) => panic!("POST {path}: {e}"),
    }
}

/// The values of the messages on `topic`, read until `count` arrived or `within` passed.
/// A message the reader is sent again (it never acknowledges) counts once.
async fn values_on(
    broker: &Arc<dyn Broker>,
    topic: &str,
    count: usize,
    within: Duration,
) -> Vec<Value> {
    let mut subscription = Subscription::new(topic, services::unique("reader"));
    subscription.assignment = Assignment::All;
    let mut source = broker.subscribe(&subscription).await.unwrap();
    let mut values = Vec::new();
    let mut positions = std::collections::HashSet::new();
    let deadline = Instant::now() + within;
    while values.len() < count {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, source.next()).await {
            Ok(Ok(m)) => {
                if positions.insert((m.position.partition, m.position.offset)) {
                    values.push(serde_json::from_slice(&m.payload).unwrap());
                }
            }
            Ok(Err(e)) => panic!("reading {topic}: {e}"),
            Err(_) => break,
        }
    }
    values
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_never_see_each_other() {
    let prefix = services::unique("tn");
    let _cleanup_prefix = services::cleanup(&prefix);
    let (acme, globex) = (format!("{prefix}acme"), format!("{prefix}globex"));
    let port = common::servers::spare_port();
    let admin = format!("http://127.0.0.1:{port}");
    let text = format!(
        r#"
[broker]
{broker}
[store]
kind = "redis"
url = "{redis}"
prefix = "{prefix}"
[admin]
listen = "127.0.0.1:{port}"
token = "{OPERATOR_TOKEN}"
[[admin.tokens]]
token = "{acme}-token"
tenant = "{acme}"
[[admin.tokens]]
token = "{globex}-token"
tenant = "{globex}"
{a}
{g}"#,
        broker = services::nats_table(),
        redis = services::redis_url(),
        a = tenant_sections(&acme),
        g = tenant_sections(&globex),
    );
    let mut config = tempfile::NamedTempFile::new().unwrap();
    config.write_all(text.as_bytes()).unwrap();
    let path = config.path();
    let mut processes = Processes(vec![weir(
        path,
        &format!("{prefix}-run.log"),
        port,
        &["run"],
    )]);
    for tenant in [&acme, &globex] {
        processes.0.push(weir(
            path,
            &format!("{prefix}-{tenant}-worker.log"),
            common::servers::spare_port(),
            &["worker", "--executor", "default", "--tenant", tenant],
        ));
    }
    let token = |tenant: &str| format!("{tenant}-token");

    // Each graph Live, seen by its own tenant under its plain name.
    let deadline = Instant::now() + Duration::from_secs(60);
    for tenant in [&acme, &globex] {
        loop {
            let (status, graph) = get(&admin, "/graphs/orders", &token(tenant)).await;
            if status == 200 && graph["state"] == "live" {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{tenant}'s graph never went live"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    // Messages: each tenant's event reaches its own output only.
    let broker: Arc<dyn Broker> = services::nats(true).await;
    for tenant in [&acme, &globex] {
        broker
            .sink()
            .publish(Outbound::new(
                format!("{tenant}.orders.in"),
                Bytes::from(json!({"from": tenant}).to_string()),
            ))
            .await
            .unwrap();
    }
    for tenant in [&acme, &globex] {
        let outputs = values_on(
            &broker,
            &format!("{tenant}.orders.out"),
            2,
            Duration::from_secs(10),
        )
        .await;
        assert_eq!(
            outputs.len(),
            1,
            "{tenant}: one output, its own: {outputs:?}"
        );
        assert_eq!(
            outputs[0]["inputs"]["a"]["from"],
            json!(tenant),
            "{outputs:?}"
        );
    }

    // State and admin data: each tenant sees its own graph, schedule and executions.
    for (me, other) in [(&acme, &globex), (&globex, &acme)] {
        let mine = token(me);
        let (_, graphs) = get(&admin, "/graphs", &mine).await;
        let names: Vec<&str> = graphs
            .as_array()
            .unwrap()
            .iter()
            .map(|g| g["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, [format!("{me}/orders")], "{me} lists only its graph");
        let (_, graph) = get(&admin, "/graphs/orders", &mine).await;
        assert_eq!(graph["sources"]["a"]["value"]["from"], json!(me), "{graph}");
        let (status, _) = get(&admin, &format!("/graphs/{other}%2Forders"), &mine).await;
        assert_eq!(status, 404, "{me} reaches {other}'s graph");
        let (status, _) = get(&admin, &format!("/schedules/{other}%2Ftick"), &mine).await;
        assert_eq!(status, 404, "{me} reaches {other}'s schedule");
        let (_, schedules) = get(&admin, "/schedules", &mine).await;
        let ids: Vec<&str> = schedules
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["id"].as_str().unwrap())
            .collect();
        assert_eq!(ids, [format!("{me}/tick")], "{me} lists only its schedule");
        // Nor can it change the other's: pausing either is answered as if absent.
        for path in [
            format!("/graphs/{other}%2Forders/pause"),
            format!("/schedules/{other}%2Ftick/pause"),
        ] {
            let (status, _) = post(&admin, &path, &mine).await;
            assert_eq!(status, 404, "{me} POSTs {path}");
        }
    }
    for tenant in [&acme, &globex] {
        let path = format!("/graphs/{tenant}%2Forders");
        let (_, graph) = get(&admin, &path, OPERATOR_TOKEN).await;
        assert_eq!(graph["paused"], false, "{tenant}'s graph paused: {graph}");
        let path = format!("/schedules/{tenant}%2Ftick");
        let (_, schedule) = get(&admin, &path, OPERATOR_TOKEN).await;
        assert_eq!(schedule["enabled"], true, "{tenant}'s schedule: {schedule}");
    }

    // Cron ticks start each tenant's own workflow, run by its own worker.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut finished = Vec::new();
    for tenant in [&acme, &globex] {
        let id = loop {
            let (_, schedule) = get(&admin, "/schedules/tick", &token(tenant)).await;
            let completed = schedule["executions"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|e| e["status"] == "completed")
                .and_then(|e| e["tick_id"].as_str().map(String::from));
            if let Some(id) = completed {
                break id;
            }
            assert!(
                Instant::now() < deadline,
                "no tick of {tenant} completed its workflow: {schedule}"
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        };
        let (status, execution) = get(
            &admin,
            &format!("/workflows/{}", weir::admin::client::segment(&id)),
            &token(tenant),
        )
        .await;
        assert_eq!(status, 200);
        assert_eq!(execution["workflow"], json!(format!("{tenant}/report")));
        assert_eq!(execution["status"], "completed", "{execution}");
        assert_eq!(execution["context"]["tenant"], json!(tenant));
        finished.push((tenant.clone(), id));
    }
    for (tenant, id) in &finished {
        let other = if tenant == &acme { &globex } else { &acme };
        let (status, _) = get(
            &admin,
            &format!("/workflows/{}", weir::admin::client::segment(id)),
            &token(other),
        )
        .await;
        assert_eq!(status, 404, "{other} reads {tenant}'s execution");
        let (status, _) = get(
            &admin,
            &format!("/workflows/{}", weir::admin::client::segment(id)),
            OPERATOR_TOKEN,
        )
        .await;
        assert_eq!(status, 200, "the operator reads every tenant's");
    }
    let (_, graphs) = get(&admin, "/graphs", OPERATOR_TOKEN).await;
    assert_eq!(
        graphs.as_array().unwrap().len(),
        2,
        "the operator sees both"
    );
}
