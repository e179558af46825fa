//! The names weir puts on the wire, in one place: message headers, the topics and
//! subjects it derives, and the consumer groups it joins. Consumers outside weir rely on
//! them, so each is a contract; tenants qualify the topics (see [`crate::tenant`]).

/// The graph that published an output or a dead letter.
pub const GRAPH_HEADER: &str = "weir-graph";
/// The fire number of an output, per graph and lease.
pub const FIRE_HEADER: &str = "weir-fire";
/// `true` when an output was fired while a source was disconnected.
pub const DEGRADED_HEADER: &str = "weir-degraded";
/// The fencing token of the lease under which an output was published; it grows with
/// every takeover, so consumers can drop what a deposed instance still published.
pub const FENCING_HEADER: &str = "weir-fencing";
/// Why a message went to a dead-letter topic.
pub const ERROR_HEADER: &str = "weir-error";
/// Where a dead-lettered event came from: accumulator, source topic, partition, offset.
pub const ACCUMULATOR_HEADER: &str = "weir-accumulator";
pub const SOURCE_TOPIC_HEADER: &str = "weir-source-topic";
pub const PARTITION_HEADER: &str = "weir-partition";
pub const OFFSET_HEADER: &str = "weir-offset";
/// On a dead letter sent without the message it stands for (the letter with it was
/// larger than the broker takes): the size of the message's payload, in bytes.
pub const PAYLOAD_OMITTED_HEADER: &str = "weir-payload-omitted";
/// The id of a cron tick (`schedule@millis`), for consumers dropping repeats.
pub const TICK_ID_HEADER: &str = "weir-tick-id";
/// How often a task event was handed back by workers without its handler.
pub const DELIVERIES_HEADER: &str = "weir-deliveries";
/// The task namespace behind a message a task published.
pub const NAMESPACE_HEADER: &str = "weir-namespace";
/// The message key on brokers without keys of their own (NATS): a job id, a graph key.
pub const KEY_HEADER: &str = "weir-key";
/// What a message to a job is: `start`, `stop` or `message` (the default, when absent).
pub const JOB_EVENT_HEADER: &str = "weir-job-event";
/// The job type and id behind a job's output.
pub const JOB_TYPE_HEADER: &str = "weir-job-type";
pub const JOB_ID_HEADER: &str = "weir-job-id";

/// Every header name above.
pub const HEADERS: [&str; 17] = [
    GRAPH_HEADER,
    FIRE_HEADER,
    DEGRADED_HEADER,
    FENCING_HEADER,
    ERROR_HEADER,
    ACCUMULATOR_HEADER,
    SOURCE_TOPIC_HEADER,
    PARTITION_HEADER,
    OFFSET_HEADER,
    PAYLOAD_OMITTED_HEADER,
    TICK_ID_HEADER,
    DELIVERIES_HEADER,
    NAMESPACE_HEADER,
    KEY_HEADER,
    JOB_EVENT_HEADER,
    JOB_TYPE_HEADER,
    JOB_ID_HEADER,
];

/// A header name read off the wire: one of weir's borrowed, so reading weir's own
/// messages allocates nothing per header name; any other copied.
pub fn header_name(name: &str) -> std::borrow::Cow<'static, str> {
    match HEADERS.iter().find(|known| **known == name) {
        Some(known) => std::borrow::Cow::Borrowed(known),
        None => std::borrow::Cow::Owned(name.to_string()),
    }
}

/// Where what cannot be processed or published from `topic` goes: `<topic>.dlq`. A
/// wildcard subject (`orders.>`) is no subject to publish to, and one under it would be
/// read again, so its dead letters go to `weir.dlq.<subject>` with `*` as `any` and `>`
/// as `all` (`weir.dlq.orders.all`).
pub fn dead_letter_topic(topic: &str) -> String {
    if topic.split('.').any(|token| token == "*" || token == ">") {
        let named: Vec<&str> = topic
            .split('.')
            .map(|token| match token {
                "*" => "any",
                ">" => "all",
                literal => literal,
            })
            .collect();
        return format!("weir.dlq.{}", named.join("."));
    }
    format!("{topic}.dlq")
}

/// The topic of an accumulator's dead letters when it reads no topic (a push-only
/// source), before tenant qualification.
pub fn accumulator_dead_letter_topic(graph: &str, accumulator: &str) -> String {
    dead_letter_topic(&format!("{graph}.{accumulator}"))
}

/// Where cron ticks go when a schedule names neither topic nor workflow.
pub const TICK_TOPIC: &str = "weir.cron.ticks";
/// Where workers report task results.
pub const RESULTS_TOPIC: &str = "weir.results";

/// The topic or subject of an executor's task events.
pub fn executor_topic(executor: &str) -> String {
    format!("weir.tasks.{executor}")
}

/// The topic a schedule's ticks go to when its target is a workflow.
pub fn workflow_start_topic(workflow: &str) -> String {
    format!("weir.workflows.{workflow}.start")
}

/// The topic or subject of a job type's messages (`start`, `stop` and the jobs' own).
pub fn job_topic(job_type: &str) -> String {
    format!("weir.jobs.{job_type}")
}

/// The consumer group (durable) of a job type's partition owners.
pub fn job_group(job_type: &str) -> String {
    format!("weir-jobs-{job_type}")
}

/// The consumer group (durable) of an executor's workers.
pub fn worker_group(executor: &str) -> String {
    format!("weir-worker-{executor}")
}

/// The consumer group of the state managers on one topic: a group per topic, so joining
/// one never rebalances another.
pub fn state_manager_group(topic: &str) -> String {
    format!("weir-state-manager.{topic}")
}

/// The consumer group of the state managers applying one workflow's results: each
/// workflow reads the shared results topic in a group of its own, so its results reach
/// only nodes that declare it.
pub fn results_group(results_topic: &str, workflow: &str) -> String {
    state_manager_group(&format!("{results_topic}.{workflow}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weir_header_names_read_off_the_wire_are_borrowed_and_others_copied() {
        // Every `*_HEADER` constant of this file is in the list.
        let source = include_str!("wire.rs");
        let declared = source
            .lines()
            .filter(|l| l.starts_with("pub const ") && l.contains("_HEADER: &str"))
            .count();
        assert_eq!(declared, HEADERS.len());
        for name in HEADERS {
            assert!(matches!(header_name(name), std::borrow::Cow::Borrowed(n) if n == name));
        }
        let other = header_name("x-trace");
        assert!(matches!(other, std::borrow::Cow::Owned(_)));
        assert_eq!(other, "x-trace");
    }

    #[test]
    fn dead_letters_of_a_wildcard_source_go_to_a_publishable_subject_outside_it() {
        assert_eq!(dead_letter_topic("orders.new"), "orders.new.dlq");
        assert_eq!(dead_letter_topic("orders.>"), "weir.dlq.orders.all");
        assert_eq!(dead_letter_topic("orders.*.eu"), "weir.dlq.orders.any.eu");
        assert_eq!(dead_letter_topic("acme.orders_>x"), "acme.orders_>x.dlq");
    }
}
