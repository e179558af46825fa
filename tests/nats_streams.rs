//! JetStream streams weir did not make: a subject an existing stream captures is read and
//! written through that stream; a stream is made only for a subject no stream captures,
//! never one overlapping another; wildcard subjects work as sources; subjects whose
//! sanitised names collide get streams of their own; clients racing to make a subject's
//! stream share the one made; header values with line breaks travel on one line; a
//! reader's consumer holds at most 100,000 messages unacknowledged.
#![cfg(feature = "it")]

mod common;

use std::time::Duration;

use async_nats::jetstream::{self, stream};
use bytes::Bytes;
use common::services::{nats, nats_url, unique};
use futures::TryStreamExt;
use weir::transport::{Broker, Outbound, Subscription};

/// The streams on the shared server, for a test to delete what it made.
struct Streams {
    js: jetstream::Context,
    made: Vec<String>,
}

impl Streams {
    async fn connect() -> Self {
        let client = async_nats::connect(nats_url())
            .await
            .expect("nats reachable");
        Self {
            js: jetstream::new(client),
            made: Vec::new(),
        }
    }

    async fn create(&mut self, name: &str, subjects: &[String]) {
        self.js
            .create_stream(stream::Config {
                name: name.to_string(),
                subjects: subjects.to_vec(),
                max_age: common::services::TEST_RETENTION,
                ..Default::default()
            })
            .await
            .expect("stream created");
        self.made.push(name.to_string());
    }

    /// Names of the streams whose subjects include `subject` exactly.
    async fn capturing(&self, subject: &str) -> Vec<String> {
        let mut names = Vec::new();
        let mut streams = self.js.streams();
        while let Some(info) = streams.try_next().await.unwrap() {
            if info.config.subjects.iter().any(|s| s == subject) {
                names.push(info.config.name);
            }
        }
        names
    }

    async fn messages_in(&self, name: &str) -> u64 {
        let mut stream = self.js.get_stream(name).await.unwrap();
        stream.info().await.unwrap().state.messages
    }

    async fn clean(&mut self, also: &[String]) {
        for name in self.made.iter().chain(also) {
            let _ = self.js.delete_stream(name).await;
        }
    }
}

async fn next_payload(source: &mut Box<dyn weir::transport::Source>) -> (String, Bytes) {
    let message = tokio::time::timeout(Duration::from_secs(20), source.next())
        .await
        .expect("a message within 20 s")
        .expect("a message");
    (message.topic.to_string(), message.payload)
}

#[tokio::test]
async fn a_subject_an_existing_stream_captures_goes_through_that_stream() {
    let prefix = unique("orders");
    let mut streams = Streams::connect().await;
    let existing = unique("ORDERS");
    streams.create(&existing, &[format!("{prefix}.>")]).await;
    let broker = nats(true).await;
    let subject = format!("{prefix}.new");

    let mut source = broker
        .subscribe(&Subscription::new(subject.clone(), unique("g")))
        .await
        .expect("subscribed through the existing stream");
    broker
        .sink()
        .publish(Outbound::new(subject.clone(), Bytes::from_static(b"1")))
        .await
        .expect("published through the existing stream");
    // A message on another subject of the same stream is not this consumer's.
    broker
        .sink()
        .publish(Outbound::new(
            format!("{prefix}.old"),
            Bytes::from_static(b"x"),
        ))
        .await
        .unwrap();
    broker
        .sink()
        .publish(Outbound::new(subject.clone(), Bytes::from_static(b"2")))
        .await
        .unwrap();
    assert_eq!(next_payload(&mut source).await.1, Bytes::from_static(b"1"));
    assert_eq!(next_payload(&mut source).await.1, Bytes::from_static(b"2"));
    assert_eq!(
        streams.messages_in(&existing).await,
        3,
        "all in the one stream"
    );
    assert!(
        streams.capturing(&subject).await.is_empty(),
        "weir made no stream of its own"
    );
    streams.clean(&[]).await;
}

#[tokio::test]
async fn a_wildcard_subject_is_a_source() {
    let prefix = unique("parts");
    let mut streams = Streams::connect().await;
    let broker = nats(true).await;
    let wildcard = format!("{prefix}.>");
    let mut source = broker
        .subscribe(&Subscription::new(wildcard.clone(), unique("g")))
        .await
        .expect("a wildcard source");
    for (suffix, payload) in [("eu.a", "1"), ("us.b", "2")] {
        broker
            .sink()
            .publish(Outbound::new(
                format!("{prefix}.{suffix}"),
                payload.to_string(),
            ))
            .await
            .expect("published into the wildcard's stream");
    }
    let got = [
        next_payload(&mut source).await.1,
        next_payload(&mut source).await.1,
    ];
    assert_eq!(got, [Bytes::from_static(b"1"), Bytes::from_static(b"2")]);
    let made = streams.capturing(&wildcard).await;
    assert_eq!(made.len(), 1, "one stream for the wildcard: {made:?}");
    streams.clean(&made).await;
}

#[tokio::test]
async fn no_stream_is_made_that_overlaps_another() {
    let prefix = unique("lines");
    let mut streams = Streams::connect().await;
    let partial = unique("LINES_A");
    streams.create(&partial, &[format!("{prefix}.a")]).await;
    let broker = nats(true).await;
    let refused = broker
        .subscribe(&Subscription::new(format!("{prefix}.*"), unique("g")))
        .await
        .err()
        .expect("a stream covering part of the subject is not widened behind its back");
    let message = refused.to_string();
    assert!(message.contains(&partial), "names the stream: {message}");
    assert!(!refused.is_retryable(), "{message}");
    streams.clean(&[]).await;
}

#[tokio::test]
async fn subjects_with_the_same_sanitised_name_get_streams_of_their_own() {
    let prefix = unique("clash");
    let mut streams = Streams::connect().await;
    let broker = nats(true).await;
    let dotted = format!("{prefix}.new");
    let underscored = format!("{prefix}_new");
    for subject in [&dotted, &underscored] {
        broker
            .sink()
            .publish(Outbound::new(subject.clone(), subject.clone()))
            .await
            .unwrap_or_else(|e| panic!("{subject}: {e}"));
    }
    let mut source = broker
        .subscribe(&Subscription::new(underscored.clone(), unique("g")))
        .await
        .unwrap();
    assert_eq!(
        next_payload(&mut source).await.1,
        Bytes::from(underscored.clone())
    );
    let dotted_streams = streams.capturing(&dotted).await;
    let underscored_streams = streams.capturing(&underscored).await;
    assert_eq!(dotted_streams.len(), 1);
    assert_eq!(underscored_streams.len(), 1);
    assert_ne!(dotted_streams, underscored_streams);
    streams
        .clean(&[dotted_streams, underscored_streams].concat())
        .await;
}

#[tokio::test]
async fn one_group_reads_two_subjects_of_one_stream() {
    let prefix = unique("pair");
    let mut streams = Streams::connect().await;
    let shared = unique("PAIR");
    streams.create(&shared, &[format!("{prefix}.>")]).await;
    let broker = nats(true).await;
    // Two sources of one graph: the same group, each the sole reader of its subject.
    let group = unique("g");
    let mut sources = Vec::new();
    for name in ["a", "b"] {
        let mut subscription = Subscription::new(format!("{prefix}.{name}"), group.clone());
        subscription.assignment = weir::transport::Assignment::All;
        sources.push(broker.subscribe(&subscription).await.unwrap());
    }
    for name in ["a", "b"] {
        broker
            .sink()
            .publish(Outbound::new(format!("{prefix}.{name}"), name.to_string()))
            .await
            .unwrap();
    }
    for (source, name) in sources.iter_mut().zip(["a", "b"]) {
        let (topic, payload) = next_payload(source).await;
        assert_eq!(topic, format!("{prefix}.{name}"));
        assert_eq!(payload, Bytes::from(name));
    }
    streams.clean(&[]).await;
}

#[tokio::test]
async fn a_header_value_with_line_breaks_is_published_on_one_line() {
    let mut streams = Streams::connect().await;
    let broker = nats(true).await;
    let subject = unique("headers");
    let mut source = broker
        .subscribe(&Subscription::new(subject.clone(), unique("g")))
        .await
        .unwrap();
    broker
        .sink()
        .publish(
            Outbound::new(subject.clone(), "{}")
                .header(weir::wire::ERROR_HEADER, "first line\nsecond line"),
        )
        .await
        .expect("published, not refused by the client");
    let message = tokio::time::timeout(Duration::from_secs(20), source.next())
        .await
        .expect("a message within 20 s")
        .unwrap();
    assert_eq!(
        message.header(weir::wire::ERROR_HEADER),
        Some("first line second line")
    );
    let made = streams.capturing(&subject).await;
    streams.clean(&made).await;
}

/// Clients that each find no stream for a new subject and race to make one all end up
/// on the one that won: the server refuses the others as overlapping it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_racing_to_make_a_subjects_stream_share_the_one_made() {
    const CLIENTS: usize = 16;
    let subject = format!("{}.race", unique("race"));
    let mut streams = Streams::connect().await;
    let mut brokers = Vec::new();
    for _ in 0..CLIENTS {
        brokers.push(nats(true).await);
    }
    let publishes = brokers.iter().enumerate().map(|(i, broker)| {
        let subject = subject.clone();
        async move {
            broker
                .sink()
                .publish(Outbound::new(subject, format!("{i}")))
                .await
        }
    });
    let published = futures::future::join_all(publishes).await;
    let made = streams.capturing(&subject).await;
    streams.clean(&made).await;
    for (i, outcome) in published.into_iter().enumerate() {
        outcome.unwrap_or_else(|e| panic!("client {i}: {e}"));
    }
    assert_eq!(made.len(), 1, "{made:?}");
}

/// A reader's consumer holds at most 100,000 messages unacknowledged: past that the
/// server delivers nothing more until some are acknowledged, so a reader whose
/// acknowledgements wait (on a store away, say) does not grow its memory with the
/// backlog.
#[tokio::test]
async fn a_readers_consumer_holds_at_most_100000_unacknowledged_messages() {
    let prefix = unique("capped");
    let mut streams = Streams::connect().await;
    let name = unique("CAPPED");
    streams.create(&name, &[format!("{prefix}.>")]).await;
    let broker = nats(true).await;
    let subject = format!("{prefix}.in");
    let mut sole = Subscription::new(subject.clone(), unique("g"));
    sole.assignment = weir::transport::Assignment::All;
    let _readers = [
        broker
            .subscribe(&Subscription::new(subject.clone(), unique("g")))
            .await
            .unwrap(),
        broker.subscribe(&sole).await.unwrap(),
    ];
    let stream = streams.js.get_stream(&name).await.unwrap();
    let consumers: Vec<_> = stream.consumers().try_collect().await.unwrap();
    assert_eq!(consumers.len(), 2, "{consumers:?}");
    for consumer in consumers {
        assert_eq!(consumer.config.filter_subject, subject);
        assert_eq!(consumer.config.max_ack_pending, 100_000, "{consumer:?}");
    }
    streams.clean(&[]).await;
}
