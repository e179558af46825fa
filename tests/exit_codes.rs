//! `weir`'s exit status: 2 for bad input only, 1 for unreachable infrastructure, 130
//! after Ctrl-C or SIGTERM.

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn config(text: &str) -> tempfile::NamedTempFile {
    let mut file = tempfile::NamedTempFile::new().unwrap();
    file.write_all(text.as_bytes()).unwrap();
    file
}

fn weir_run(config: &tempfile::NamedTempFile) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_weir"))
        .args(["run", "--config"])
        .arg(config.path())
        .output()
        .expect("weir runs")
}

/// A port nothing listens on.
fn closed_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

const GRAPH: &str = r#"
[[graph]]
name = "g"
output = "g.out"
[[graph.accumulator]]
name = "a"
"#;

#[test]
fn a_config_that_cannot_work_exits_2_naming_the_key() {
    let file = config(&format!("[supervision]\ngraph_lease_ttl_ms = 10\n{GRAPH}"));
    let out = weir_run(&file);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("supervision.graph_lease_ttl_ms"), "{err}");
}

#[test]
fn redis_down_at_start_exits_1_even_with_schedules_to_register() {
    let port = closed_port();
    let file = config(&format!(
        r#"
[store]
kind = "redis"
url = "redis://127.0.0.1:{port}"
[[schedule]]
id = "nightly"
cron = "0 2 * * *"
topic = "nightly.ticks"
{GRAPH}"#
    ));
    let out = weir_run(&file);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains(&port.to_string()), "names the server: {err}");
}

/// `weir run` whose broker refuses connections: exit 1, naming the broker.
fn broker_down_at_start_exits_1_naming_it(broker: &str, named: &str) {
    let file = config(&format!("[broker]\n{broker}\n{GRAPH}topic = \"g.in\"\n"));
    let started = Instant::now();
    let out = weir_run(&file);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains(named), "names the broker: {err}");
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "gave up after {:?}",
        started.elapsed()
    );
}

#[test]
fn a_kafka_broker_down_at_start_exits_1_naming_it() {
    let port = closed_port();
    broker_down_at_start_exits_1_naming_it(
        &format!("kind = \"kafka\"\nbrokers = \"127.0.0.1:{port}\""),
        &format!("kafka 127.0.0.1:{port}"),
    );
}

#[test]
fn a_nats_server_down_at_start_exits_1_naming_it() {
    let port = closed_port();
    broker_down_at_start_exits_1_naming_it(
        &format!("kind = \"nats\"\nurl = \"nats://127.0.0.1:{port}\""),
        &format!("nats nats://127.0.0.1:{port}"),
    );
}

#[cfg(unix)]
#[test]
fn ctrl_c_exits_130() {
    let file = config(GRAPH);
    let mut child = Command::new(env!("CARGO_BIN_EXE_weir"))
        .args(["run", "--config"])
        .arg(file.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("weir runs");
    std::thread::sleep(Duration::from_millis(500));
    let status = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "weir did not stop");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(status.code(), Some(130));
}
