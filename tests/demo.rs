//! `weir demo` end to end, as a library call and as the binary.

use std::process::Command;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

fn summary_counts(line: &str) -> Vec<u64> {
    let rest = line.strip_prefix("summary: ").expect("summary line");
    rest.split(' ')
        .zip(["events", "boundaries", "fires", "outputs"])
        .map(|(field, name)| {
            let (key, value) = field.split_once('=').expect("key=value");
            assert_eq!(key, name);
            value.parse().expect("a count")
        })
        .collect()
}

#[tokio::test]
async fn demo_prints_outputs_then_a_consistent_summary() {
    let mut out = Vec::new();
    let options = weir::demo::DemoOptions {
        duration: Some(Duration::from_millis(800)),
        rate: 200,
        listen: Default::default(),
    };
    let stats = weir::demo::run(options, CancellationToken::new(), &mut out)
        .await
        .unwrap();
    let text = String::from_utf8(out).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let counts = summary_counts(lines.last().unwrap());
    assert_eq!(
        counts,
        vec![stats.events, stats.boundaries, stats.fires, stats.outputs]
    );
    assert!(stats.events > 50, "{stats:?}");
    // Trades are batched, so fewer boundaries than events; every fire publishes a signal.
    assert!(stats.boundaries < stats.events);
    assert!(stats.fires > 0 && stats.fires <= stats.boundaries);
    assert_eq!(stats.outputs, stats.fires);
    let printed = lines.iter().filter(|l| l.starts_with("fire=")).count() as u64;
    assert_eq!(printed, stats.outputs, "every output is printed");
}

#[test]
fn the_binary_runs_the_demo_and_exits_zero() {
    let output = Command::new(env!("CARGO_BIN_EXE_weir"))
        .args(["demo", "--seconds", "1"])
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let stdout = String::from_utf8(output.stdout).unwrap();
    let counts = summary_counts(stdout.lines().last().unwrap());
    assert!(counts.iter().all(|&c| c > 0), "{stdout}");
}

#[cfg(unix)]
#[test]
fn ctrl_c_stops_the_demo_with_a_summary() {
    let child = Command::new(env!("CARGO_BIN_EXE_weir"))
        .arg("demo")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(700));
    let status = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let output = child.wait_with_output().unwrap();
    assert_eq!(output.status.code(), Some(130), "{output:?}");
    let stdout = String::from_utf8(output.stdout).unwrap();
    summary_counts(stdout.lines().last().unwrap());
}

#[test]
fn help_lists_the_demo() {
    let output = Command::new(env!("CARGO_BIN_EXE_weir"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(output.status.success());
    assert!(String::from_utf8_lossy(&output.stdout).contains("demo"));
}
