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
    weir(&["run"], config)
}

/// `weir <args> --config <config>`, stopped and failed if it has not exited in a minute:
/// a command that should exit at once must not hang the suite instead.
fn weir(args: &[&str], config: &tempfile::NamedTempFile) -> std::process::Output {
    let stdout = tempfile::tempfile().unwrap();
    let stderr = tempfile::tempfile().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_weir"))
        .args(args)
        .arg("--config")
        .arg(config.path())
        .stdin(Stdio::null())
        .stdout(stdout.try_clone().unwrap())
        .stderr(stderr.try_clone().unwrap())
        .spawn()
        .expect("weir runs");
    let deadline = Instant::now() + Duration::from_secs(60);
    let read = |file: &std::fs::File| {
        use std::io::{Read, Seek};
        let mut file = file.try_clone().unwrap();
        let mut bytes = Vec::new();
        file.rewind().unwrap();
        file.read_to_end(&mut bytes).unwrap();
        bytes
    };
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "weir {args:?} still running after a minute: {}",
                String::from_utf8_lossy(&read(&stderr))
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    std::process::Output {
        status,
        stdout: read(&stdout),
        stderr: read(&stderr),
    }
}

/// A port nothing listens on.
fn closed_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A port that takes connections and never answers on them, as a hung server or a
/// firewall dropping replies does: the kernel completes each connection into the
/// listener's backlog and nothing reads it. Every wait on it must end by itself.
struct SilentPort(std::net::TcpListener);

impl SilentPort {
    fn new() -> Self {
        Self(std::net::TcpListener::bind("127.0.0.1:0").unwrap())
    }

    fn port(&self) -> u16 {
        self.0.local_addr().unwrap().port()
    }
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

/// Settings a client refuses stay refused however often weir tries: bad input, not an
/// outage, whether or not the server is up (here it is not).
#[test]
fn settings_the_broker_or_store_client_refuses_exit_2_naming_them() {
    let port = closed_port();
    let missing = "/nonexistent/weir-test";
    let cases = [
        (
            format!("[broker]\nkind = \"kafka\"\nbrokers = \"127.0.0.1:{port}\"\n[broker.options]\n\"no.such.property\" = \"x\"\n"),
            "no.such.property",
        ),
        (
            format!("[broker]\nkind = \"kafka\"\nbrokers = \"127.0.0.1:{port}\"\n[broker.options]\n\"session.timeout.ms\" = \"soon\"\n"),
            "session.timeout.ms",
        ),
        (
            format!("[broker]\nkind = \"nats\"\nurl = \"nats://127.0.0.1:{port}\"\ncredentials_file = \"{missing}.creds\"\n"),
            "credentials_file",
        ),
        (
            format!("[store]\nkind = \"redis\"\nurl = \"rediss://127.0.0.1:{port}\"\ntls_ca_file = \"{missing}.pem\"\n"),
            "tls_ca_file",
        ),
    ];
    for (settings, named) in cases {
        let out = weir_run(&config(&format!("{settings}{GRAPH}topic = \"g.in\"\n")));
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{settings}: {err}");
        assert!(err.contains(named), "names {named}: {err}");
    }
}

#[test]
fn redis_down_at_start_exits_1_even_with_schedules_to_register() {
    redis_unreachable_at_start_exits_1_naming_it(closed_port());
}

#[test]
fn redis_that_never_answers_at_start_exits_1_naming_it() {
    let silent = SilentPort::new();
    redis_unreachable_at_start_exits_1_naming_it(silent.port());
}

fn redis_unreachable_at_start_exits_1_naming_it(port: u16) {
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

/// `weir run` whose broker cannot be reached (refused, or never answering): exit 1, naming
/// the broker.
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

#[test]
fn a_kafka_broker_that_never_answers_exits_1_naming_it() {
    let silent = SilentPort::new();
    let port = silent.port();
    broker_down_at_start_exits_1_naming_it(
        &format!("kind = \"kafka\"\nbrokers = \"127.0.0.1:{port}\""),
        &format!("kafka 127.0.0.1:{port}"),
    );
}

#[test]
fn a_nats_server_that_never_answers_exits_1_naming_it() {
    let silent = SilentPort::new();
    let port = silent.port();
    broker_down_at_start_exits_1_naming_it(
        &format!("kind = \"nats\"\nurl = \"nats://127.0.0.1:{port}\""),
        &format!("nats nats://127.0.0.1:{port}"),
    );
}

/// Every command that needs a server, not only `weir run`, exits 1 naming the one it
/// cannot reach, within the helper's minute.
fn every_command_exits_1_naming_what_it_cannot_reach(broker: &str, named_broker: &str, redis: u16) {
    let file = config(&format!(
        r#"
[broker]
{broker}
[store]
kind = "redis"
url = "redis://127.0.0.1:{redis}"
[[job]]
type = "counter"
handler = "builtin::count"
[[workflow]]
name = "wf"
[[workflow.task]]
id = "a"
handler = "builtin::echo"
"#
    ));
    let named_store = format!("redis://127.0.0.1:{redis}");
    let commands: [(&[&str], &str); 17] = [
        (&["worker", "--executor", "default"], named_broker),
        (&["workflow", "run", "wf"], named_broker),
        (&["workflow", "status", "x"], &named_store),
        (&["job", "put", "counter", "c1"], named_broker),
        (
            &["job", "send", "counter", "c1", "--message", "{}"],
            named_broker,
        ),
        (&["job", "rm", "counter", "c1"], named_broker),
        (&["job", "get", "counter", "c1"], &named_store),
        (&["job", "list", "counter"], &named_store),
        (&["cron", "list"], &named_store),
        (
            &[
                "cron",
                "add",
                "--id",
                "nightly",
                "--cron",
                "0 2 * * *",
                "--topic",
                "t",
            ],
            &named_store,
        ),
        (&["cron", "pause", "nightly"], &named_store),
        (&["cron", "resume", "nightly"], &named_store),
        (&["cron", "show", "nightly"], &named_store),
        (&["cron", "rm", "nightly"], &named_store),
        (&["cron", "history", "nightly"], &named_store),
        (&["tail", "t1"], named_broker),
        (&["produce", "t1"], named_broker),
    ];
    // Side by side: against a server that never answers, each one waits out its timeout.
    std::thread::scope(|scope| {
        let runs: Vec<_> = commands
            .iter()
            .map(|(args, named)| scope.spawn(|| (*args, *named, weir(args, &file))))
            .collect();
        for run in runs {
            let (args, named, out) = run.join().unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(1), "weir {args:?}: {err}");
            assert!(err.contains(named), "weir {args:?} names {named}: {err}");
        }
    });
}

#[test]
fn every_command_on_kafka_exits_1_naming_what_it_cannot_reach() {
    let port = closed_port();
    every_command_exits_1_naming_what_it_cannot_reach(
        &format!("kind = \"kafka\"\nbrokers = \"127.0.0.1:{port}\""),
        &format!("kafka 127.0.0.1:{port}"),
        closed_port(),
    );
}

#[test]
fn every_command_on_nats_exits_1_naming_what_it_cannot_reach() {
    let port = closed_port();
    every_command_exits_1_naming_what_it_cannot_reach(
        &format!("kind = \"nats\"\nurl = \"nats://127.0.0.1:{port}\""),
        &format!("nats nats://127.0.0.1:{port}"),
        closed_port(),
    );
}

#[test]
fn every_command_on_kafka_exits_1_when_its_servers_never_answer() {
    let (broker, redis) = (SilentPort::new(), SilentPort::new());
    let port = broker.port();
    every_command_exits_1_naming_what_it_cannot_reach(
        &format!("kind = \"kafka\"\nbrokers = \"127.0.0.1:{port}\""),
        &format!("kafka 127.0.0.1:{port}"),
        redis.port(),
    );
}

#[test]
fn every_command_on_nats_exits_1_when_its_servers_never_answer() {
    let (broker, redis) = (SilentPort::new(), SilentPort::new());
    let port = broker.port();
    every_command_exits_1_naming_what_it_cannot_reach(
        &format!("kind = \"nats\"\nurl = \"nats://127.0.0.1:{port}\""),
        &format!("nats nats://127.0.0.1:{port}"),
        redis.port(),
    );
}

/// A state the job's handler refuses at its start is refused by the command line, before
/// any broker is reached, instead of being sent and dead-lettered by the job's owner.
#[test]
fn a_job_state_its_handler_refuses_exits_2_naming_the_handler() {
    let port = closed_port();
    let file = config(&format!(
        r#"
[broker]
kind = "kafka"
brokers = "127.0.0.1:{port}"
[[job]]
type = "counter"
handler = "builtin::count"
"#
    ));
    let out = weir(&["job", "put", "counter", "c1", "--state", "5"], &file);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("builtin::count"), "names the handler: {err}");
    assert!(err.contains("JSON object"), "says why: {err}");
    // Nested deeper than a node reads: refused too, whatever the handler.
    let deep = format!(
        "{}{}",
        "{\"a\":".repeat(101),
        "1".to_string() + &"}".repeat(101)
    );
    let out = weir(&["job", "put", "counter", "c1", "--state", &deep], &file);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("nested deeper than 100"), "says why: {err}");
    // A state it takes gets as far as the broker, which is down: 1, not 2.
    let out = weir(
        &[
            "job",
            "put",
            "counter",
            "c1",
            "--state",
            r#"{"every_ms": 1000}"#,
        ],
        &file,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
}

/// A starting context nested deeper than weir reads JSON could be stored with the
/// execution but never read back: refused with exit 2, saying why.
#[test]
fn a_workflow_context_nested_too_deep_exits_2() {
    let file = config(
        "[[workflow]]\nname = \"wf\"\n[[workflow.task]]\nid = \"a\"\nhandler = \"builtin::echo\"\n",
    );
    let deep = format!("{}1{}", "[".repeat(101), "]".repeat(101));
    let out = weir(&["workflow", "run", "wf", "--context", &deep], &file);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("nested deeper than 100"), "says why: {err}");
}

/// `weir job get` and `list` of a type the config does not declare (a typo) say so, as
/// put, send and rm do, instead of finding no job.
#[test]
fn a_job_type_not_declared_exits_2_naming_it() {
    let file = config("[[job]]\ntype = \"counter\"\nhandler = \"builtin::count\"\n");
    for args in [
        &["job", "list", "countr"][..],
        &["job", "get", "countr", "c1"][..],
    ] {
        let out = weir(args, &file);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains("\"countr\""), "names the type: {err}");
    }
    // The declared type lists its jobs: none yet, in the embedded store.
    let out = weir(&["job", "list", "counter"], &file);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert!(out.stdout.is_empty(), "{out:?}");
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
