//! `weir graph …` (through a running weir's admin API), `weir tail` and `weir produce`
//! (straight to the configured broker).

use std::collections::VecDeque;
use std::io::Write;

use serde_json::Value;
use tokio::io::AsyncBufRead;
use tokio::io::AsyncBufReadExt;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::app::cli::{GraphCommand, ProduceArgs, TailArgs};
use crate::app::error::Error;
use weir::admin::client::{segment, AdminClient};
use weir::codec::records::decode_known;
use weir::config::{BrokerKind, Config};
use weir::transport::{
    Assignment, Broker, Outbound, PendingAck, Sink, StartFrom, Subscription, TransportError,
};

/// Runs one graph command and prints the API's JSON answer.
pub async fn graph(
    command: GraphCommand,
    admin: &str,
    token: Option<String>,
    ca: Option<&std::path::Path>,
    out: &mut impl Write,
) -> Result<(), Error> {
    let client = AdminClient::new(admin, token, ca)?;
    let path = |name: &str, action: &str| format!("/graphs/{}{action}", segment(name));
    let answer = match command {
        GraphCommand::List => client.get("/graphs").await?,
        GraphCommand::State { name, key: None } => client.get(&path(&name, "")).await?,
        GraphCommand::State {
            name,
            key: Some(key),
        } => {
            client
                .get(&path(&name, &format!("/keys/{}", segment(&key))))
                .await?
        }
        GraphCommand::Partitions { name } => client.get(&path(&name, "/partitions")).await?,
        GraphCommand::Fire { name } => client.post(&path(&name, "/fire"), None).await?,
        GraphCommand::Pause { name } => client.post(&path(&name, "/pause"), None).await?,
        GraphCommand::Resume { name } => client.post(&path(&name, "/resume"), None).await?,
        GraphCommand::Restart { name } => client.post(&path(&name, "/restart"), None).await?,
    };
    writeln!(
        out,
        "{}",
        serde_json::to_string_pretty(&answer).unwrap_or_default()
    )?;
    Ok(())
}

/// The broker of a config file; the in-process broker is refused, since another
/// process's memory broker cannot be reached.
async fn broker(
    config: &std::path::Path,
    command: &str,
) -> Result<std::sync::Arc<dyn Broker>, Error> {
    let config = Config::load(config)?;
    if config.broker.kind == BrokerKind::Memory {
        return Err(Error::Usage(format!(
            "weir {command} needs [broker] kind = \"kafka\" or \"nats\": the memory broker lives inside one process"
        )));
    }
    Ok(config.connect_broker().await?)
}

/// Prints each message of a topic on one line until cancelled (or `--count` messages).
/// Reads with a consumer name of its own and never commits.
pub async fn tail(
    args: &TailArgs,
    cancel: CancellationToken,
    out: &mut impl Write,
) -> Result<(), Error> {
    let broker = broker(&args.config, "tail").await?;
    tail_from(&*broker, args, cancel, out).await
}

/// [`tail`] on a broker already connected.
async fn tail_from(
    broker: &dyn Broker,
    args: &TailArgs,
    cancel: CancellationToken,
    out: &mut impl Write,
) -> Result<(), Error> {
    let mut subscription = Subscription::new(
        args.topic.clone(),
        format!("weir.tail.{}", std::process::id()),
    );
    subscription.assignment = Assignment::All;
    subscription.start = if args.from_beginning {
        StartFrom::Earliest
    } else {
        StartFrom::Latest
    };
    // Reopens in a row, each reader failing soon with nothing printed: a reader failing
    // again and again (the broker gone, not a connection that broke once) ends the
    // command. One that ran a while before failing starts the count again.
    let mut failed_in_a_row = 0;
    // The broker answered as it was connected to: a first open failing for a reason that
    // may pass (the connection dropped while the stream is looked up) is made again, as
    // a reopen is. Nothing was printed yet, so nothing is printed twice; reading from the
    // latest message, what comes before an open succeeds is not shown, as with any open.
    let Some(mut source) = reopen(broker, &subscription, &cancel, &mut failed_in_a_row).await?
    else {
        return Ok(());
    };
    let mut printed = 0;
    let mut opened_at = tokio::time::Instant::now();
    let mut last_printed = std::collections::BTreeMap::new();
    while args.count.is_none_or(|n| printed < n) {
        let message = tokio::select! {
            _ = cancel.cancelled() => break,
            message = source.next() => message,
        };
        let message = match message {
            Ok(message) => message,
            // A reader that fails for a reason that may pass (a JetStream reader finding
            // deliveries lost with a broken connection) is opened again right after the
            // last message printed of each partition, so nothing printed is printed
            // twice. A partition nothing was printed from is read again from where the
            // command started: its beginning, or, reading from the latest message, the
            // latest again, which may skip what came meanwhile; so a reader from the
            // latest message that printed nothing at all ends the command instead.
            Err(e) if e.is_retryable() && (printed > 0 || args.from_beginning) => {
                if opened_at.elapsed() >= TAIL_RAN_A_WHILE {
                    failed_in_a_row = 0;
                }
                failed_in_a_row += 1;
                if failed_in_a_row > TAIL_REOPENS {
                    return Err(e.into());
                }
                warn!(topic = %args.topic, error = %e, "reading again after the last message printed");
                subscription.resume_after = last_printed.values().copied().collect();
                match reopen(broker, &subscription, &cancel, &mut failed_in_a_row).await? {
                    Some(reopened) => source = reopened,
                    None => break,
                }
                opened_at = tokio::time::Instant::now();
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        failed_in_a_row = 0;
        last_printed.insert(message.position.partition, message.position);
        writeln!(out, "{}", render(&message.payload))?;
        out.flush()?;
        printed += 1;
    }
    Ok(())
}

/// Times in a row `weir tail` opens its reader again, each failing soon.
const TAIL_REOPENS: u32 = 10;
/// How long a reader runs before its failure no longer counts as one in a row.
const TAIL_RAN_A_WHILE: std::time::Duration = std::time::Duration::from_secs(10);

/// Opens the tail's reader again after a pause that grows with each failure in a row,
/// itself tried again while it fails for a reason that may pass, up to [`TAIL_REOPENS`].
/// None once cancelled.
async fn reopen(
    broker: &dyn Broker,
    subscription: &Subscription,
    cancel: &CancellationToken,
    failed_in_a_row: &mut u32,
) -> Result<Option<Box<dyn weir::transport::Source>>, Error> {
    loop {
        let pause = std::time::Duration::from_millis(50 * u64::from(*failed_in_a_row));
        tokio::select! {
            _ = cancel.cancelled() => return Ok(None),
            _ = tokio::time::sleep(pause) => {}
        }
        let subscribed = tokio::select! {
            _ = cancel.cancelled() => return Ok(None),
            subscribed = broker.subscribe(subscription) => subscribed,
        };
        match subscribed {
            Ok(source) => return Ok(Some(source)),
            Err(e) if e.is_retryable() && *failed_in_a_row < TAIL_REOPENS => {
                warn!(topic = %subscription.topic, error = %e, "opening the reader again");
                *failed_in_a_row += 1;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// One line for a payload: weir's Avro records and JSON as compact JSON, anything else
/// as text with its line breaks escaped.
pub fn render(payload: &[u8]) -> String {
    match decode_known(payload) {
        Some(Ok((_, value))) => value.to_string(),
        Some(Err(e)) => format!("(undecodable weir record: {e})"),
        None => match serde_json::from_slice::<Value>(payload) {
            Ok(value) => value.to_string(),
            Err(_) => String::from_utf8_lossy(payload)
                .replace('\r', "\\r")
                .replace('\n', "\\n"),
        },
    }
}

/// Lines handed to the broker client before the oldest of them is awaited: enough to
/// keep the client's batches full, and few enough that a failure leaves a short tail.
const PRODUCE_WINDOW: usize = 1024;

/// Publishes each non-blank line of `input` as one message, in order (the broker client
/// sends what it is handed in order), with up to [`PRODUCE_WINDOW`] awaiting the broker's
/// acknowledgement at once; then reports the count on `report`. After a line is refused,
/// nothing more is read, and the report says which lines the broker took: those before
/// it, and how many of those already handed over after it.
pub async fn produce(
    args: &ProduceArgs,
    input: impl AsyncBufRead + Unpin,
    report: &mut impl Write,
) -> Result<(), Error> {
    let broker = broker(&args.config, "produce").await?;
    produce_to(broker.sink().as_ref(), args, input, report).await
}

/// [`produce`] through `sink`.
async fn produce_to(
    sink: &dyn Sink,
    args: &ProduceArgs,
    input: impl AsyncBufRead + Unpin,
    report: &mut impl Write,
) -> Result<(), Error> {
    let mut lines = input.lines();
    let mut pending: VecDeque<(u64, PendingAck)> = VecDeque::with_capacity(PRODUCE_WINDOW);
    let mut progress = Progress::default();
    let mut number: u64 = 0;
    // A line that could not be read or handed over: every line before it is settled
    // first.
    let mut stopped: Option<Unpublished> = None;
    loop {
        if pending.len() >= PRODUCE_WINDOW {
            if let Some((line, ack)) = pending.pop_front() {
                progress.settled(line, ack.await);
                if progress.failed.is_some() {
                    break;
                }
            }
        }
        let line = match lines.next_line().await {
            Ok(Some(line)) => line,
            Ok(None) => break,
            Err(e) => {
                stopped = Some(Unpublished {
                    line: number + 1,
                    fate: "which could not be read",
                    error: e.into(),
                });
                break;
            }
        };
        number += 1;
        if line.trim().is_empty() {
            continue;
        }
        let mut message = Outbound::new(args.topic.clone(), line.into_bytes());
        if let Some(key) = &args.key {
            message = message.key(key.clone().into_bytes());
        }
        match sink.enqueue(message).await {
            Ok(ack) => pending.push_back((number, ack)),
            Err(e) => {
                // Refused before it was sent, or not taken by the client at all: either
                // way the message never left this process.
                let fate = if e.is_retryable() {
                    "which could not be handed to the broker"
                } else {
                    "which the broker refused"
                };
                stopped = Some(Unpublished {
                    line: number,
                    fate,
                    error: Error::NotSent(e),
                });
                break;
            }
        }
    }
    for (line, ack) in pending {
        progress.settled(line, ack.await);
    }
    if let (Some(stop), None) = (stopped, &progress.failed) {
        progress.failed = Some(stop);
    }
    match progress.failed {
        None => {
            writeln!(
                report,
                "{} messages published to {}",
                progress.published, args.topic
            )?;
            Ok(())
        }
        Some(Unpublished { line, fate, error }) => {
            writeln!(
                report,
                "{} messages published to {} before line {line}, {fate}; of the lines \
                 handed over after it, {} were published and {} were not confirmed",
                progress.published,
                args.topic,
                progress.published_after,
                progress.unconfirmed_after
            )?;
            Err(error)
        }
    }
}

/// The first line not known to be published: its number, what became of it, and why.
struct Unpublished {
    line: u64,
    fate: &'static str,
    error: Error,
}

/// What the broker made of the lines so far, in line order.
#[derive(Default)]
struct Progress {
    /// Lines published before the first that was not.
    published: u64,
    /// The first line not known to be published.
    failed: Option<Unpublished>,
    published_after: u64,
    unconfirmed_after: u64,
}

impl Progress {
    fn settled<T>(&mut self, line: u64, outcome: Result<T, TransportError>) {
        match (&self.failed, outcome) {
            (None, Ok(_)) => self.published += 1,
            (None, Err(e)) => {
                // An acknowledgement that did not come (a timeout, a connection lost)
                // leaves the message's fate open: the broker may have stored it.
                let fate = if e.is_retryable() {
                    "which the broker did not confirm (it may have stored it all the same)"
                } else {
                    "which the broker refused"
                };
                self.failed = Some(Unpublished {
                    line,
                    fate,
                    error: e.into(),
                });
            }
            (Some(_), Ok(_)) => self.published_after += 1,
            (Some(_), Err(_)) => self.unconfirmed_after += 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use weir::codec::avro::encode;
    use weir::codec::CronTick;
    use weir::transport::Position;

    /// Takes messages until the `fails_at`th. From there on each is lost in flight
    /// (taken, its acknowledgement failing) with `in_flight_loss`, else not taken.
    struct FailingAt {
        fails_at: usize,
        taken: std::sync::atomic::AtomicUsize,
        in_flight_loss: bool,
    }

    fn lost(topic: &str) -> TransportError {
        TransportError::Publish {
            topic: topic.into(),
            source: "connection lost".into(),
            retryable: true,
        }
    }

    #[async_trait::async_trait]
    impl Sink for FailingAt {
        async fn publish(&self, message: Outbound) -> Result<Position, TransportError> {
            self.enqueue(message).await?.await
        }

        async fn enqueue(&self, message: Outbound) -> Result<PendingAck, TransportError> {
            let n = 1 + self.taken.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let acknowledged = if n < self.fails_at {
                Ok(Position {
                    partition: 0,
                    offset: n as i64,
                })
            } else if self.in_flight_loss {
                Err(lost(&message.topic))
            } else {
                return Err(lost(&message.topic));
            };
            Ok(PendingAck::given(acknowledged))
        }
    }

    async fn produce_failing_at_line_3(in_flight_loss: bool) -> (String, Error) {
        let sink = FailingAt {
            fails_at: 3,
            taken: Default::default(),
            in_flight_loss,
        };
        let args = ProduceArgs {
            topic: "t".into(),
            config: Default::default(),
            key: None,
        };
        let mut report = Vec::new();
        let failed = produce_to(&sink, &args, &b"a\nb\nc\nd\n"[..], &mut report)
            .await
            .expect_err("line 3 is not published");
        (String::from_utf8(report).unwrap(), failed)
    }

    #[tokio::test]
    async fn a_line_the_client_did_not_take_is_reported_as_never_sent() {
        let (report, failed) = produce_failing_at_line_3(false).await;
        assert!(
            report.starts_with(
                "2 messages published to t before line 3, which could not be handed to the broker"
            ),
            "{report}"
        );
        assert_eq!(failed.exit_code(), 1);
        assert_eq!(failed.hint(), None, "it never left: {failed}");
    }

    #[tokio::test]
    async fn a_line_sent_but_not_confirmed_may_have_been_stored() {
        let (report, failed) = produce_failing_at_line_3(true).await;
        assert!(
            report.starts_with(
                "2 messages published to t before line 3, which the broker did not confirm"
            ),
            "{report}"
        );
        assert_eq!(failed.exit_code(), 1);
        assert!(failed.hint().is_some(), "{failed}");
    }

    /// The memory broker, but its first `failures` subscribes fail: as a connection
    /// dropped mid-call does, for a reason that may pass, or, not `retryable`, as a
    /// reader the broker refuses does.
    struct FirstSubscribesFail {
        inner: weir::transport::memory::MemoryBroker,
        failures: usize,
        calls: std::sync::atomic::AtomicUsize,
        /// Whether a retry may help, as a dropped connection, or cannot, as a topic
        /// the broker does not allow.
        retryable: bool,
    }

    #[async_trait::async_trait]
    impl Broker for FirstSubscribesFail {
        fn kind(&self) -> &'static str {
            self.inner.kind()
        }

        async fn subscribe(
            &self,
            subscription: &Subscription,
        ) -> Result<Box<dyn weir::transport::Source>, TransportError> {
            let call = self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            if call < self.failures {
                return Err(TransportError::Consume {
                    topic: subscription.topic.clone(),
                    source: "connection closed while listing streams".into(),
                    retryable: self.retryable,
                });
            }
            self.inner.subscribe(subscription).await
        }

        fn sink(&self) -> std::sync::Arc<dyn Sink> {
            self.inner.sink()
        }

        async fn partitioned(
            &self,
            topic: &str,
            partitions: u32,
        ) -> Result<weir::transport::PartitionedTopic, TransportError> {
            self.inner.partitioned(topic, partitions).await
        }

        async fn ping(&self) -> Result<(), TransportError> {
            self.inner.ping().await
        }
    }

    async fn tail_through_first_opens_failing(
        failures: usize,
        retryable: bool,
    ) -> (Result<(), Error>, String, usize) {
        let memory = weir::transport::memory::MemoryBroker::new(1);
        for id in 0..3 {
            let event = Outbound::new("t", serde_json::json!({ "id": id }).to_string());
            memory.sink().publish(event).await.unwrap();
        }
        let broker = FirstSubscribesFail {
            inner: memory,
            failures,
            calls: Default::default(),
            retryable,
        };
        let args = TailArgs {
            topic: "t".into(),
            config: Default::default(),
            from_beginning: true,
            count: Some(3),
        };
        let mut out = Vec::new();
        let tailed = tail_from(&broker, &args, CancellationToken::new(), &mut out).await;
        let opens = broker.calls.load(std::sync::atomic::Ordering::SeqCst);
        (tailed, String::from_utf8(out).unwrap(), opens)
    }

    #[tokio::test(start_paused = true)]
    async fn a_first_open_failing_for_now_is_made_again() {
        let (tailed, out, opens) = tail_through_first_opens_failing(2, true).await;
        tailed.expect("the third open reads");
        assert_eq!(opens, 3);
        assert_eq!(out, "{\"id\":0}\n{\"id\":1}\n{\"id\":2}\n");
    }

    #[tokio::test(start_paused = true)]
    async fn a_first_open_failing_again_and_again_ends_the_command() {
        let (tailed, out, opens) = tail_through_first_opens_failing(usize::MAX, true).await;
        let failed = tailed.expect_err("the broker never lets it read");
        assert_eq!(failed.exit_code(), 1, "{failed}");
        assert!(failed.to_string().contains("listing streams"), "{failed}");
        assert_eq!(out, "");
        assert_eq!(opens, 1 + TAIL_REOPENS as usize);
    }

    #[tokio::test(start_paused = true)]
    async fn a_first_open_no_retry_can_help_ends_the_command_at_once() {
        let (tailed, out, opens) = tail_through_first_opens_failing(usize::MAX, false).await;
        tailed.expect_err("the broker refuses the reader");
        assert_eq!(out, "");
        assert_eq!(opens, 1, "not tried again");
    }

    #[test]
    fn payloads_render_as_one_line_each() {
        assert_eq!(render(br#"{ "a": [1, 2] }"#), r#"{"a":[1,2]}"#);
        assert_eq!(render(b"plain\ntext"), "plain\\ntext");
        let tick = CronTick {
            schedule_id: "nightly".into(),
            tick_id: "nightly@1".into(),
            scheduled_time_ms: 1,
            emitted_time_ms: 2,
            fencing_token: 3,
            delivery: "at_most_once".into(),
            attempt: 1,
            payload: "{}".into(),
            node_id: "n1".into(),
            tenant: None,
        };
        let line = render(&encode(&tick).unwrap());
        let value: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(value["tick_id"], "nightly@1");
        assert_eq!(value["tenant"], serde_json::Value::Null);
    }
}
