use clap::Parser;

use weir::cli::{self, Cli, Command};
use weir::config::Config;
use weir::graph::FunctionRegistry;
use weir::{demo, run, shutdown};

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    cli::init_tracing(cli.log_format, &cli.log);
    let cancel = shutdown::on_signal();
    let result = match cli.command {
        Command::Demo { seconds, rate } => {
            let options = demo::DemoOptions {
                duration: Command::demo_duration(seconds),
                rate,
            };
            demo::run(options, cancel, &mut std::io::stdout())
                .await
                .map(|_| ())
        }
        Command::Cron { command } => weir::cron::cli::run(command, &mut std::io::stdout()).await,
        Command::Run { config } => match Config::load(&config) {
            Ok(config) => run::run(config, &FunctionRegistry::default(), cancel).await,
            Err(e) => Err(e.into()),
        },
    };
    if let Err(e) = result {
        eprintln!("weir: {e}");
        std::process::exit(e.exit_code());
    }
}
