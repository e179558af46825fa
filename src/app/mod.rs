//! The `weir` application: the command line over the weir library. Nothing in the
//! library imports it.
//!
//! - [`cli`]: the arguments (clap) and logging set-up.
//! - [`run`]: `weir run`, wiring the backends a config names into graphs, cron, the
//!   state manager and the admin API.
//! - [`cron`], [`workflow`], [`graph`], [`job`]: `weir cron`, `weir workflow` and
//!   `weir worker`, `weir graph`, `tail` and `produce`, and `weir job`.
//! - [`error`]: every command's error, and the exit status it maps to.

pub mod cli;
pub mod cron;
pub mod error;
pub mod graph;
pub mod job;
pub mod run;
pub mod workflow;

use weir::config::Config;
use weir::graph::FunctionRegistry;
use weir::worker::HandlerRegistry;
use weir::{demo, shutdown};

use cli::{Cli, Command};

/// How long an exiting process waits for its Kafka clients to close.
const CLIENT_CLOSE_LIMIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Runs a command line to its end; the exit status, when it is not 0.
pub async fn main(cli: Cli) -> Option<i32> {
    cli::init_tracing(cli.log_format, &cli.log);
    // On a runtime worker rather than the main thread, so the loops it drives wake the
    // tasks they spawn without a hop between threads for every message.
    let outcome = tokio::spawn(execute(cli)).await;
    let result = match outcome {
        Ok(result) => result,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    };
    // Consumers leave their groups on threads of their own; give them a bounded time, so
    // their partitions go to the other members at once rather than after the session
    // timeout, and a broker that never answers cannot keep the process alive.
    let unclosed = weir::transport::kafka::let_clients_close(CLIENT_CLOSE_LIMIT).await;
    if unclosed > 0 {
        tracing::warn!(
            unclosed,
            "kafka clients still closing after {CLIENT_CLOSE_LIMIT:?}; exiting without them"
        );
    }
    if let Err(e) = &result {
        eprintln!("weir: {e}");
        if let Some(hint) = e.hint() {
            eprintln!("weir: {hint}");
        }
    }
    // Stopped by Ctrl-C or SIGTERM: the shell's convention, whether or not the command
    // finished its shutdown cleanly.
    if shutdown::signalled() {
        return Some(error::INTERRUPTED);
    }
    result.err().map(|e| e.exit_code())
}

async fn execute(cli: Cli) -> Result<(), error::Error> {
    let cancel = shutdown::on_signal();
    match cli.command {
        Command::Demo {
            seconds,
            rate,
            metrics_listen,
            admin_listen,
        } => {
            let options = demo::DemoOptions {
                duration: Command::demo_duration(seconds),
                rate,
                listen: weir::admin::Listen {
                    metrics: metrics_listen,
                    admin: admin_listen,
                    ..Default::default()
                },
            };
            demo::run(options, cancel, &mut std::io::stdout())
                .await
                .map(|_| ())
                .map_err(error::Error::from)
        }
        Command::Cron { command } => cron::run(command, &mut std::io::stdout()).await,
        Command::Worker {
            config,
            executor,
            concurrency,
            tenant,
        } => {
            workflow::worker(
                &config,
                executor,
                concurrency,
                tenant,
                |runtime| HandlerRegistry::with_builtins(runtime.broker.sink()),
                cancel,
            )
            .await
        }
        Command::Workflow { command } => {
            workflow::run(command, cancel, &mut std::io::stdout()).await
        }
        Command::Run { config } => match Config::load(&config) {
            Ok(config) => {
                run::run(
                    config,
                    &FunctionRegistry::default(),
                    &weir::jobs::JobHandlers::default(),
                    cancel,
                )
                .await
            }
            Err(e) => Err(e.into()),
        },
        Command::Graph {
            command,
            admin,
            token,
            admin_ca,
        } => {
            graph::graph(
                command,
                &admin,
                token,
                admin_ca.as_deref(),
                &mut std::io::stdout(),
            )
            .await
        }
        Command::Job { command } => job::run(command, &mut std::io::stdout()).await,
        Command::Tail(args) => graph::tail(&args, cancel, &mut std::io::stdout()).await,
        Command::Produce(args) => {
            let stdin = tokio::io::BufReader::new(tokio::io::stdin());
            graph::produce(&args, stdin, &mut std::io::stderr()).await
        }
    }
}
