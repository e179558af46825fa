use clap::Parser;

use weir::cli::{self, Cli, Command};
use weir::config::Config;
use weir::graph::FunctionRegistry;
use weir::worker::HandlerRegistry;
use weir::{demo, run, shutdown};

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    cli::init_tracing(cli.log_format, &cli.log);
    // On a runtime worker rather than the main thread, so the loops it drives wake the
    // tasks they spawn without a hop between threads for every message.
    let outcome = tokio::spawn(execute(cli)).await;
    let result = match outcome {
        Ok(result) => result,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    };
    if let Err(e) = &result {
        eprintln!("weir: {e}");
    }
    // Stopped by Ctrl-C or SIGTERM: the shell's convention, whether or not the command
    // finished its shutdown cleanly.
    if shutdown::signalled() {
        std::process::exit(weir::error::INTERRUPTED);
    }
    if let Err(e) = result {
        std::process::exit(e.exit_code());
    }
}

async fn execute(cli: Cli) -> Result<(), weir::error::Error> {
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
        }
        Command::Cron { command } => weir::cron::cli::run(command, &mut std::io::stdout()).await,
        Command::Worker {
            config,
            executor,
            concurrency,
            tenant,
        } => {
            weir::dispatch::cli::worker(
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
            weir::dispatch::cli::run(command, cancel, &mut std::io::stdout()).await
        }
        Command::Run { config } => match Config::load(&config) {
            Ok(config) => run::run(config, &FunctionRegistry::default(), cancel).await,
            Err(e) => Err(e.into()),
        },
        Command::Graph {
            command,
            admin,
            token,
            admin_ca,
        } => {
            weir::admin::cli::graph(
                command,
                &admin,
                token,
                admin_ca.as_deref(),
                &mut std::io::stdout(),
            )
            .await
        }
        Command::Tail(args) => weir::admin::cli::tail(&args, cancel, &mut std::io::stdout()).await,
        Command::Produce(args) => {
            let stdin = tokio::io::BufReader::new(tokio::io::stdin());
            weir::admin::cli::produce(&args, stdin, &mut std::io::stderr()).await
        }
    }
}
