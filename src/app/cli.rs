//! Command line: `weir demo` on the embedded default, `weir run` on real services.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};

#[derive(Debug, Parser)]
#[command(
    name = "weir",
    version,
    about = "A message-broker-native stream processor and scheduler"
)]
pub struct Cli {
    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Human, global = true, env = "WEIR_LOG_FORMAT")]
    pub log_format: LogFormat,
    /// Log filter, e.g. `info` or `weir=debug`.
    #[arg(long, default_value = "warn", global = true, env = "WEIR_LOG")]
    pub log: String,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Human,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the market-data example on the embedded default (no services needed).
    Demo {
        /// Stop after this many seconds (default: run until Ctrl-C).
        #[arg(long)]
        seconds: Option<u64>,
        /// Quotes generated per second.
        #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
        rate: u32,
        /// Serve GET /metrics on this IP:port.
        #[arg(long, env = "WEIR__METRICS__LISTEN")]
        metrics_listen: Option<SocketAddr>,
        /// Serve the admin API (and /metrics) on this IP:port.
        #[arg(long, env = "WEIR__ADMIN__LISTEN")]
        admin_listen: Option<SocketAddr>,
    },
    /// Cron schedules: preview fire times, manage schedules in the store.
    Cron {
        #[command(subcommand)]
        command: CronCommand,
    },
    /// Run the graphs a TOML file declares, on the broker and store it names.
    Run {
        /// The configuration file; every key can be overridden by WEIR__SECTION__KEY.
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Run workflow tasks: join the consumer group of one executor's topic.
    Worker {
        #[arg(long, short)]
        config: PathBuf,
        /// Executor key: consumes weir.tasks.<KEY>.
        #[arg(long)]
        executor: String,
        /// Tasks run at once, at most; when full the worker stops fetching.
        #[arg(long, default_value_t = weir::config::defaults::WORKER_CONCURRENCY, value_parser = parse_concurrency)]
        concurrency: usize,
        /// Run one tenant's tasks: consumes <TENANT>.weir.tasks.<KEY> and reports on the
        /// tenant's results topic.
        #[arg(long)]
        tenant: Option<String>,
    },
    /// Workflow executions: start one, show one.
    Workflow {
        #[command(subcommand)]
        command: WorkflowCommand,
    },
    /// Distributed jobs: put, message, look up, list and remove jobs of a declared type.
    Job {
        #[command(subcommand)]
        command: JobCommand,
    },
    /// Graphs of a running weir, through its admin API; prints JSON.
    Graph {
        #[command(subcommand)]
        command: GraphCommand,
        /// Base URL of the admin API.
        #[arg(long, global = true, env = "WEIR_ADMIN", default_value = weir::admin::client::DEFAULT_URL)]
        admin: String,
        /// Bearer token, if the admin API requires one.
        #[arg(long, global = true, env = "WEIR_ADMIN_TOKEN", hide_env_values = true)]
        token: Option<String>,
        /// PEM file of the CA that signed an https:// admin API's certificate, when the
        /// system does not trust it.
        #[arg(long, global = true, env = "WEIR_ADMIN_CA")]
        admin_ca: Option<PathBuf>,
    },
    /// Print each message of a topic on one line: weir's Avro records and JSON payloads
    /// as compact JSON, anything else as text.
    Tail(TailArgs),
    /// Publish each line of standard input to a topic as one message, in order, up to
    /// 1,024 awaiting acknowledgement at once; blank lines are skipped. Stops at a line
    /// the broker refuses.
    Produce(ProduceArgs),
}

/// More tasks at once than any machine runs; the limit keeps the worker's semaphore
/// within what it can count.
const MOST_CONCURRENCY: usize = 1_000_000;

fn parse_concurrency(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(n) if (1..=MOST_CONCURRENCY).contains(&n) => Ok(n),
        _ => Err(format!(
            "{text:?} is not a whole number from 1 to {MOST_CONCURRENCY}"
        )),
    }
}

/// The most fire times `weir cron preview` lists: each is a line of output.
const MOST_PREVIEWED: usize = 100_000;

fn parse_preview_count(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(n) if n <= MOST_PREVIEWED => Ok(n),
        _ => Err(format!(
            "{text:?} is not a whole number up to {MOST_PREVIEWED}"
        )),
    }
}

#[derive(Debug, Subcommand)]
pub enum WorkflowCommand {
    /// Start an execution of a declared workflow; prints its id.
    Run {
        #[arg(long, short)]
        config: PathBuf,
        /// Workflow name, as declared in [[workflow]].
        name: String,
        /// Initial context (a JSON object).
        #[arg(long)]
        context: Option<String>,
        /// Wait until it ends and print its final status as JSON (the id goes to stderr).
        #[arg(long)]
        wait: bool,
    },
    /// Print an execution's status as JSON.
    Status {
        #[arg(long, short)]
        config: PathBuf,
        id: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum JobCommand {
    /// Put a job: start it with a state (replacing one of the same id). Its owner applies
    /// it shortly after.
    Put {
        #[arg(long, short)]
        config: PathBuf,
        /// The job type, as declared in [[job]].
        job_type: String,
        id: String,
        /// Initial state, JSON (default `{}`).
        #[arg(long)]
        state: Option<String>,
    },
    /// Send a job a message.
    Send {
        #[arg(long, short)]
        config: PathBuf,
        job_type: String,
        id: String,
        /// The message, JSON.
        #[arg(long)]
        message: String,
    },
    /// Print a job as one JSON line: {"type", "id", "state", "owner", "status"}.
    Get {
        #[arg(long, short)]
        config: PathBuf,
        job_type: String,
        id: String,
    },
    /// Print the ids of a type's jobs, one per line.
    List {
        #[arg(long, short)]
        config: PathBuf,
        job_type: String,
    },
    /// Stop a job and remove it.
    Rm {
        #[arg(long, short)]
        config: PathBuf,
        job_type: String,
        id: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum GraphCommand {
    /// Every graph with its reactor state and status.
    List,
    /// One graph's reactor: cached values, dirty flags, source health, paused. With
    /// `--key`, one key of a keyed graph: its state as stored and the node owning it.
    State {
        name: String,
        #[arg(long)]
        key: Option<String>,
    },
    /// A keyed graph's partitions and the node owning each.
    Partitions {
        name: String,
    },
    /// Fire now with the current cache, whatever the criteria say.
    Fire {
        name: String,
    },
    /// Stop firing; boundaries keep accumulating.
    Pause {
        name: String,
    },
    Resume {
        name: String,
    },
    /// Start the graph afresh now; a Failed graph is tried again at once.
    Restart {
        name: String,
    },
}

#[derive(Debug, clap::Args)]
pub struct TailArgs {
    /// Topic or subject.
    pub topic: String,
    /// The configuration file naming the broker.
    #[arg(long, short)]
    pub config: PathBuf,
    /// Start at the oldest retained message instead of the next new one.
    #[arg(long)]
    pub from_beginning: bool,
    /// Stop after this many messages.
    #[arg(long)]
    pub count: Option<usize>,
}

#[derive(Debug, clap::Args)]
pub struct ProduceArgs {
    /// Topic or subject.
    pub topic: String,
    /// The configuration file naming the broker.
    #[arg(long, short)]
    pub config: PathBuf,
    /// Message key of every message.
    #[arg(long)]
    pub key: Option<String>,
}

#[derive(Debug, Subcommand)]
pub enum CronCommand {
    /// Print the next fire instants of an expression, in UTC (RFC 3339, `Z`).
    Preview {
        /// 5 fields (minute hour day-of-month month day-of-week), or 6 with seconds.
        #[arg(long)]
        expr: String,
        /// IANA time zone the expression is read in, e.g. America/New_York.
        #[arg(long)]
        tz: String,
        /// Start after this instant (RFC 3339; default: now).
        #[arg(long)]
        from: Option<String>,
        #[arg(long, default_value_t = 10, value_parser = parse_preview_count)]
        count: usize,
    },
    /// Register (or replace) a schedule in the configured store.
    Add(Box<CronAddArgs>),
    /// List the stored schedules with their next fire time.
    List {
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Show one schedule as JSON.
    Show {
        #[arg(long, short)]
        config: PathBuf,
        id: String,
    },
    /// Delete a schedule.
    Rm {
        #[arg(long, short)]
        config: PathBuf,
        id: String,
    },
    /// Stop firing a schedule until resumed.
    Pause {
        #[arg(long, short)]
        config: PathBuf,
        id: String,
    },
    /// Fire a paused schedule again, from the next time after now.
    Resume {
        #[arg(long, short)]
        config: PathBuf,
        id: String,
    },
    /// A schedule's executions, newest first, one JSON object per line.
    History {
        #[arg(long, short)]
        config: PathBuf,
        id: String,
        #[arg(long, default_value_t = 20)]
        limit: usize,
    },
}

#[derive(Debug, clap::Args)]
pub struct CronAddArgs {
    #[arg(long, short)]
    pub config: PathBuf,
    #[arg(long)]
    pub id: String,
    /// 5 fields, or 6 with seconds.
    #[arg(long)]
    pub cron: String,
    /// IANA time zone.
    #[arg(long, default_value = weir::config::defaults::TIMEZONE)]
    pub tz: String,
    /// Topic or subject for the ticks (default weir.cron.ticks).
    #[arg(long, conflicts_with = "workflow")]
    pub topic: Option<String>,
    /// Workflow to start per tick.
    #[arg(long)]
    pub workflow: Option<String>,
    /// JSON payload carried by each tick.
    #[arg(long)]
    pub payload: Option<String>,
    /// skip | latest | all
    #[arg(long, default_value = "skip")]
    pub catchup: String,
    /// Most missed times fired with `--catchup all`.
    #[arg(long, default_value_t = weir::config::defaults::CATCHUP_CAP,
          value_parser = clap::value_parser!(u32).range(1..=i64::from(weir::cron::MOST_CAUGHT_UP)))]
    pub catchup_cap: u32,
    /// allow | skip | buffer_one
    #[arg(long, default_value = "skip")]
    pub overlap: String,
    /// at_most_once | at_least_once
    #[arg(long, default_value = "at_most_once")]
    pub delivery: String,
    /// First instant the schedule may fire (RFC 3339).
    #[arg(long)]
    pub start: Option<String>,
    /// Last instant the schedule may fire (RFC 3339).
    #[arg(long)]
    pub end: Option<String>,
    /// Register it paused.
    #[arg(long)]
    pub paused: bool,
}

impl Command {
    pub fn demo_duration(seconds: Option<u64>) -> Option<Duration> {
        seconds.map(Duration::from_secs)
    }
}

/// Installs the tracing subscriber, writing to stderr so stdout stays for output.
pub fn init_tracing(format: LogFormat, filter: &str) {
    let filter = tracing_subscriber::EnvFilter::try_new(filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Human => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}
