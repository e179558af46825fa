//! `weir run` processes sharing one config file, as the nodes of a cluster: node `i` runs
//! with node id `n<i>` and logs to `<tmp>/<prefix>-n<i>.log` (appended across restarts).
//! Every node still running is killed when the set is dropped, a failed test included.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Nodes {
    prefix: String,
    config: PathBuf,
    children: Vec<Option<Child>>,
}

impl Nodes {
    pub fn new(prefix: &str, config: &Path, count: usize) -> Self {
        Self {
            prefix: prefix.to_string(),
            config: config.to_path_buf(),
            children: (0..count).map(|_| None).collect(),
        }
    }

    /// Starts node `node`, with `env` added to its environment.
    pub fn start_with(&mut self, node: usize, env: &[(&str, String)]) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(std::env::temp_dir().join(format!("{}-n{node}.log", self.prefix)))
            .unwrap();
        let mut command = Command::new(env!("CARGO_BIN_EXE_weir"));
        command
            .args(["run", "--config"])
            .arg(&self.config)
            .env("WEIR__NODE__ID", format!("n{node}"))
            .env("WEIR_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log);
        for (name, value) in env {
            command.env(name, value);
        }
        self.children[node] = Some(command.spawn().expect("weir starts"));
    }

    pub fn start(&mut self, node: usize) {
        self.start_with(node, &[]);
    }

    /// Sends a signal (`STOP`, `CONT`, …) to a running node.
    pub fn signal(&self, node: usize, name: &str) {
        let child = self.children[node].as_ref().expect("the node runs");
        super::servers::signal(child, name);
    }

    /// SIGKILL: the node vanishes holding whatever it held.
    pub fn kill(&mut self, node: usize) {
        if let Some(mut child) = self.children[node].take() {
            child.kill().unwrap();
            child.wait().unwrap();
        }
    }

    /// SIGTERM, and waits for the node to hand its partitions over and exit.
    pub fn terminate(&mut self, node: usize) {
        let Some(mut child) = self.children[node].take() else {
            return;
        };
        super::servers::signal(&child, "TERM");
        let deadline = Instant::now() + Duration::from_secs(40);
        while child.try_wait().unwrap().is_none() {
            assert!(Instant::now() < deadline, "n{node} did not stop on SIGTERM");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Nodes {
    fn drop(&mut self) {
        for node in 0..self.children.len() {
            self.kill(node);
        }
    }
}

/// The warnings and errors in the logs of the nodes started under `prefix`, each line
/// led by its node, for a failing test to show.
pub fn warnings(prefix: &str) -> Vec<String> {
    let mut lines = Vec::new();
    for node in 0.. {
        let path = std::env::temp_dir().join(format!("{prefix}-n{node}.log"));
        let Ok(log) = std::fs::read_to_string(&path) else {
            break;
        };
        lines.extend(
            log.lines()
                .filter(|line| line.contains("WARN") || line.contains("ERROR"))
                .map(|line| format!("n{node}: {line}")),
        );
    }
    lines
}

/// Runs `weir run` on `config` as a node refused at start would be: waits up to 30 s for
/// it to exit (killing it and failing the test if it does not), and returns its exit
/// code and what it wrote to stderr.
pub fn run_refused(config: &Path) -> (Option<i32>, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_weir"))
        .args(["run", "--config"])
        .arg(config)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("weir runs");
    let deadline = Instant::now() + Duration::from_secs(30);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("weir run was not refused at start within 30 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}
