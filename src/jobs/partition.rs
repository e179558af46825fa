//! The run loop of one owned partition of a job type: messages and timeouts applied to
//! jobs in memory, written to the store in batches with the partition's position, then
//! committed to the broker.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde_json::Value;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::store::{JobRecord, JobStore, PartitionChanges};
use super::{HandlerError, JobEvent, JobType, Step, Timer, LATEST_DUE_MS};
use crate::lease::Held;
use crate::metrics;
use crate::ownership::{PartitionError, PartitionWork, StoreRetry};
use crate::transport::{
    now_ms, publish_dead_letter, Broker, Message, Outbound, PartitionedTopic, Position, Sink,
    Source, TransportError,
};
use crate::wire;

/// Applied messages written to the store in one go, at most.
const MAX_BATCH: usize = 1024;
/// How long an applied message may wait for its batch to be written.
const LINGER: Duration = Duration::from_millis(5);

/// Runs the owned partitions of one job type.
pub(crate) struct JobPartitions {
    job_type: JobType,
    topic: PartitionedTopic,
    group: String,
    ownership_group: String,
    dead_letter_topic: String,
    broker: Arc<dyn Broker>,
    sink: Arc<dyn Sink>,
    store: Arc<dyn JobStore>,
}

impl JobPartitions {
    pub(crate) fn new(
        job_type: JobType,
        topic: PartitionedTopic,
        broker: Arc<dyn Broker>,
        store: Arc<dyn JobStore>,
    ) -> Self {
        Self {
            group: wire::job_group(&job_type.name),
            ownership_group: super::ownership_group(&job_type.name),
            dead_letter_topic: wire::dead_letter_topic(&topic.topic),
            sink: broker.sink(),
            job_type,
            topic,
            broker,
            store,
        }
    }
}

#[async_trait]
impl PartitionWork for JobPartitions {
    async fn run(
        &self,
        partition: i32,
        held: Held,
        release: CancellationToken,
        lost: CancellationToken,
    ) {
        let held = &held;
        let (releasing, losing) = (&release, &lost);
        crate::ownership::serve_partition(
            &self.ownership_group,
            partition,
            &release,
            &lost,
            |stopping, first| async move {
                let mut serving =
                    Serving::start(self, partition, held, first, &stopping, losing).await?;
                serving.serve(releasing, losing).await
            },
        )
        .await;
    }
}

/// One partition being served: its jobs in memory and what is not written yet.
struct Serving<'a> {
    jobs: &'a JobPartitions,
    partition: i32,
    held: &'a Held,
    /// Cancelled on release or loss: ends a publish retried while the broker is away.
    stopping: CancellationToken,
    /// Cancelled on loss only: ends a store call retried while the store is away, which a
    /// release lets finish, so that the hand-over writes what the partition applied.
    lost: CancellationToken,
    source: Box<dyn Source>,
    /// The last position applied (written or not).
    position: Option<i64>,
    /// Jobs of the partition loaded so far.
    cache: HashMap<String, JobRecord>,
    /// Ids known to have no job.
    absent: HashSet<String>,
    /// When each job in memory was last used, in events of this partition: the least
    /// recently used leave memory first.
    used: HashMap<String, u64>,
    events: u64,
    /// Metric handles, made once: the per-message path only touches atomics.
    counts: Counts,
    /// Pending timeouts: (due ms, id).
    timers: BTreeSet<(i64, String)>,
    batch: Batch,
}

/// A partition's metric handles.
struct Counts {
    jobs_owned: ::metrics::Gauge,
    applied: ::metrics::Counter,
    timeouts: ::metrics::Counter,
    dead_letters: ::metrics::Counter,
    store_writes: ::metrics::Counter,
}

impl Counts {
    fn new(job_type: &str, partition: i32) -> Self {
        let job_type = job_type.to_string();
        Self {
            jobs_owned: ::metrics::gauge!(metrics::JOBS_OWNED, "job_type" => job_type.clone(), "partition" => partition.to_string()),
            applied: ::metrics::counter!(metrics::JOB_MESSAGES_APPLIED_TOTAL, "job_type" => job_type.clone()),
            timeouts: ::metrics::counter!(metrics::JOB_TIMEOUTS_FIRED_TOTAL, "job_type" => job_type.clone()),
            dead_letters: ::metrics::counter!(metrics::DEAD_LETTERS_TOTAL, "job_type" => job_type.clone()),
            store_writes: ::metrics::counter!(metrics::JOB_STORE_WRITES_TOTAL, "job_type" => job_type),
        }
    }
}

/// Applied, not yet written.
#[derive(Default)]
struct Batch {
    /// Jobs changed: the id, and whether the job was removed.
    changed: HashMap<String, bool>,
    outputs: Vec<Outbound>,
    /// The broker position to commit once written.
    commit: Option<Position>,
    applied: u64,
    /// When the first change of the batch was made.
    since: Option<Instant>,
}

impl Batch {
    fn touch(&mut self, id: &str, removed: bool) {
        self.changed.insert(id.to_string(), removed);
        self.since.get_or_insert_with(Instant::now);
    }

    fn is_empty(&self) -> bool {
        self.changed.is_empty() && self.commit.is_none() && self.outputs.is_empty()
    }
}

impl<'a> Serving<'a> {
    /// Loads the partition's position and timeouts and opens its source right after the
    /// position.
    async fn start(
        jobs: &'a JobPartitions,
        partition: i32,
        held: &'a Held,
        first: bool,
        stopping: &CancellationToken,
        lost: &CancellationToken,
    ) -> Result<Serving<'a>, PartitionError> {
        let name = &jobs.job_type.name;
        let snapshot = jobs.store.load_partition(name, partition).await?;
        let subscription = jobs
            .topic
            .subscription(partition, &jobs.group, snapshot.position)
            .fenced(held.lease.token);
        let source = jobs.broker.subscribe(&subscription).await?;
        if first {
            // A clean hand-over by the previous owner: the one token before ours.
            if let Some((token, at_ms)) = snapshot.released {
                if token + 1 == held.lease.token {
                    let handover = Duration::from_millis((now_ms() - at_ms).max(0) as u64);
                    metrics::partition_resumed(&jobs.ownership_group, handover);
                }
            }
        }
        info!(job_type = %name, partition, position = ?snapshot.position, timeouts = snapshot.timeouts.len(), "partition resumed");
        Ok(Serving {
            jobs,
            partition,
            held,
            stopping: stopping.clone(),
            lost: lost.clone(),
            source,
            position: snapshot.position,
            cache: HashMap::new(),
            absent: HashSet::new(),
            used: HashMap::new(),
            events: 0,
            counts: Counts::new(name, partition),
            timers: snapshot
                .timeouts
                .into_iter()
                .map(|(id, due)| (due, id))
                .collect(),
            batch: Batch::default(),
        })
    }

    fn handle(&self, state: Value, event: &JobEvent) -> Result<Step, HandlerError> {
        super::run_handler(self.jobs.job_type.handler.as_ref(), state, event)
    }

    async fn serve(
        &mut self,
        release: &CancellationToken,
        lost: &CancellationToken,
    ) -> Result<(), PartitionError> {
        // Made once and polled again each turn: a new timer or token wait per message
        // would cost more than the message. The token waits are polled only once woken:
        // each poll of a waiting one takes its notifier's lock.
        let mut lost = crate::woken::woken(lost.cancelled());
        let mut release = crate::woken::woken(release.cancelled());
        let flush_timer = tokio::time::sleep(LINGER);
        let due_timer = tokio::time::sleep(LINGER);
        tokio::pin!(flush_timer, due_timer);
        let mut flush_armed = false;
        // The due time (ms) the due timer is set for.
        let mut due_armed: Option<i64> = None;
        loop {
            if let (Some(since), false) = (self.batch.since, flush_armed) {
                flush_timer.as_mut().reset(since + LINGER);
                flush_armed = true;
            }
            let next_due = self.timers.first().map(|(due, _)| *due);
            if next_due != due_armed {
                if let Some(due) = next_due {
                    let wait = Duration::from_millis((due - now_ms()).max(0) as u64);
                    due_timer.as_mut().reset(Instant::now() + wait);
                }
                due_armed = next_due;
            }
            tokio::select! {
                biased;
                _ = &mut lost => return Ok(()),
                _ = &mut release => {
                    self.flush(true).await?;
                    return Ok(());
                }
                _ = &mut flush_timer, if flush_armed => {
                    flush_armed = false;
                    self.flush(false).await?;
                }
                _ = &mut due_timer, if due_armed.is_some() => {
                    due_armed = None;
                    self.fire_due().await?;
                    if self.batch.applied as usize >= MAX_BATCH {
                        flush_armed = false;
                        self.flush(false).await?;
                    }
                }
                message = self.source.next() => {
                    self.apply(message?).await?;
                    if self.batch.applied as usize >= MAX_BATCH {
                        flush_armed = false;
                        self.flush(false).await?;
                    }
                }
            }
        }
    }

    /// The records of these jobs from the store. Mid-batch: a store away for a moment is
    /// waited for, as for the batch's write.
    async fn load_jobs(
        &mut self,
        ids: &[String],
    ) -> Result<Vec<Option<JobRecord>>, PartitionError> {
        let mut retry = StoreRetry::new(
            &self.jobs.ownership_group,
            self.partition,
            self.jobs.job_type.lease_ttl,
            &self.lost,
        );
        loop {
            self.held.check_deadline()?;
            match self
                .jobs
                .store
                .load_jobs(&self.jobs.job_type.name, ids)
                .await
            {
                Ok(loaded) => return Ok(loaded),
                Err(e) => retry.after(e).await?,
            }
        }
    }

    /// The job, loaded from the store the first time it is needed.
    async fn job(&mut self, id: &str) -> Result<Option<JobRecord>, PartitionError> {
        self.events += 1;
        match self.used.get_mut(id) {
            Some(used) => *used = self.events,
            None => {
                self.used.insert(id.to_string(), self.events);
            }
        }
        if let Some(record) = self.cache.get(id) {
            return Ok(Some(record.clone()));
        }
        if self.absent.contains(id) {
            return Ok(None);
        }
        let loaded = self
            .load_jobs(&[id.to_string()])
            .await?
            .into_iter()
            .next()
            .flatten();
        match &loaded {
            Some(record) => {
                self.cache.insert(id.to_string(), record.clone());
            }
            None => {
                self.absent.insert(id.to_string());
            }
        }
        self.report_jobs();
        Ok(loaded)
    }

    fn report_jobs(&self) {
        self.counts.jobs_owned.set(self.cache.len() as f64);
    }

    async fn apply(&mut self, message: Message) -> Result<(), PartitionError> {
        let offset = message.position.offset;
        self.batch.commit = Some(message.position);
        if self.position.is_some_and(|p| offset <= p) {
            return Ok(());
        }
        self.position = Some(offset);
        self.batch.since.get_or_insert_with(Instant::now);
        let Some(id) = message
            .key
            .as_ref()
            .and_then(|k| std::str::from_utf8(k).ok())
            .filter(|id| !id.is_empty())
            .map(str::to_string)
        else {
            return self
                .dead_letter(&message, "no job id: the message key must be the job id")
                .await;
        };
        let event = match message.header(wire::JOB_EVENT_HEADER) {
            None | Some("message") => match crate::codec::json::decode(&message.payload) {
                Ok(value) => JobEvent::Message(value),
                Err(e) => return self.dead_letter(&message, &format!("payload: {e}")).await,
            },
            Some("start") => JobEvent::Start,
            Some("stop") => JobEvent::Stop,
            Some(other) => {
                return self
                    .dead_letter(
                        &message,
                        &format!(
                            "{} {other:?} is none of start, stop, message",
                            wire::JOB_EVENT_HEADER
                        ),
                    )
                    .await
            }
        };
        if let Some(reason) = self.jobs.topic.misplaced(&id, self.partition) {
            return self.dead_letter(&message, &format!("job {reason}")).await;
        }
        let record = self.job(&id).await?;
        // On a broker's own partitions the producer's partitioner places the id: one
        // placing it otherwise than the job's first messages were (another client's
        // partitioner) would give the job two owners, each overwriting the other's state.
        if let Some(home) = record
            .as_ref()
            .map(|r| r.partition)
            .filter(|home| *home != self.partition)
        {
            let reason = format!(
                "job {} lives on partition {home}, and this message came on partition {}: \
                 its producer places job ids otherwise than the job's first messages' did \
                 (weir places an id on crc32(id) mod partitions, as librdkafka's default \
                 partitioner does)",
                crate::transport::quoted_key(&id),
                self.partition
            );
            return self.dead_letter(&message, &reason).await;
        }
        // A start replaces a job of the same id, and its timeout goes with it: the
        // old one leaves the timers once the start is applied.
        let replaced_due = match (&event, &record) {
            (JobEvent::Start, Some(replaced)) => replaced.timeout_at_ms,
            _ => None,
        };
        let applied = match (&event, record) {
            (JobEvent::Start, _) => {
                let state = if message.payload.is_empty() {
                    Value::Object(Default::default())
                } else {
                    match crate::codec::json::decode(&message.payload) {
                        Ok(state) => state,
                        Err(e) => {
                            return self
                                .dead_letter(&message, &format!("start state: {e}"))
                                .await
                        }
                    }
                };
                self.handle(state, &JobEvent::Start)
                    .map(|step| (step, None))
            }
            (JobEvent::Stop, None) => return Ok(()),
            (_, Some(record)) => {
                let pending = record.timeout_at_ms;
                self.handle(record.state, &event)
                    .map(|step| (step, pending))
            }
            // A message to a job never put starts it with an empty state first.
            (_, None) => self
                .handle(Value::Object(Default::default()), &JobEvent::Start)
                .and_then(|started| {
                    let timeout = deadline(started.timer, None);
                    self.handle(started.state, &event).map(|mut step| {
                        step.outputs.splice(0..0, started.outputs);
                        (step, timeout)
                    })
                }),
        };
        match applied {
            Ok((step, pending)) => {
                if let Some(due) = replaced_due {
                    self.timers.remove(&(due, id.clone()));
                }
                self.record_step(&id, step, pending, Some(offset), event == JobEvent::Stop);
                self.counts.applied.increment(1);
                Ok(())
            }
            Err(e) => {
                self.dead_letter(&message, &format!("handler refused it: {e}"))
                    .await
            }
        }
    }

    /// Keeps what a handler returned: the job's new record (or its removal), its timer
    /// and its outputs, for the next write.
    fn record_step(
        &mut self,
        id: &str,
        step: Step,
        pending: Option<i64>,
        position: Option<i64>,
        removed: bool,
    ) {
        if let Some(due) = pending {
            self.timers.remove(&(due, id.to_string()));
        }
        for output in step.outputs {
            if let Some(topic) = &self.jobs.job_type.output {
                let payload = serde_json::json!({
                    "type": self.jobs.job_type.name,
                    "id": id,
                    "output": output,
                });
                self.batch.outputs.push(
                    Outbound::new(topic.clone(), payload.to_string())
                        .key(id.to_string())
                        .header(wire::JOB_TYPE_HEADER, self.jobs.job_type.name.clone())
                        .header(wire::JOB_ID_HEADER, id.to_string()),
                );
            }
        }
        self.batch.applied += 1;
        if removed {
            self.cache.remove(id);
            self.absent.insert(id.to_string());
            self.batch.touch(id, true);
            self.report_jobs();
            return;
        }
        let timeout_at_ms = deadline(step.timer, pending);
        if let Some(due) = timeout_at_ms {
            self.timers.insert((due, id.to_string()));
        }
        let previous = self.cache.get(id).map(|r| r.position);
        let record = JobRecord {
            id: id.to_string(),
            state: step.state,
            timeout_at_ms,
            partition: self.partition,
            position: position.or(previous).unwrap_or(-1),
        };
        self.absent.remove(id);
        self.cache.insert(id.to_string(), record);
        self.batch.touch(id, false);
        self.report_jobs();
    }

    /// Fires the timeouts due by now, at most a batch of them: the loop goes on to
    /// write them and to look at its tokens before the next.
    async fn fire_due(&mut self) -> Result<(), PartitionError> {
        let now = now_ms();
        let due: Vec<(i64, String)> = self
            .timers
            .iter()
            .take_while(|(at, _)| *at <= now)
            .take(MAX_BATCH)
            .cloned()
            .collect();
        // Jobs not in memory yet, in one look-up.
        let unknown: Vec<String> = due
            .iter()
            .map(|(_, id)| id.clone())
            .filter(|id| !self.cache.contains_key(id) && !self.absent.contains(id))
            .collect();
        if !unknown.is_empty() {
            let loaded = self.load_jobs(&unknown).await?;
            for (id, record) in unknown.into_iter().zip(loaded) {
                match record {
                    Some(record) => self.cache.insert(id, record),
                    None => {
                        self.absent.insert(id);
                        None
                    }
                };
            }
            self.report_jobs();
        }
        for (at, id) in due {
            self.timers.remove(&(at, id.clone()));
            let Some(record) = self.cache.get(&id).cloned() else {
                continue;
            };
            // A timeout replaced or cleared since it was loaded is no longer due.
            if record.timeout_at_ms != Some(at) {
                continue;
            }
            match self.handle(record.state, &JobEvent::Timeout) {
                Ok(step) => {
                    self.record_step(&id, step, None, None, false);
                    self.counts.timeouts.increment(1);
                }
                Err(e) => {
                    warn!(job_type = %self.jobs.job_type.name, job = %id, error = %e, "handler refused a timeout; the job keeps its state without a timeout");
                    if let Some(record) = self.cache.get_mut(&id) {
                        record.timeout_at_ms = None;
                        self.batch.touch(&id, false);
                    }
                }
            }
        }
        Ok(())
    }

    /// Sends a message no job can take to the type's dead-letter topic, so it is kept
    /// and the partition goes on.
    async fn dead_letter(&mut self, message: &Message, reason: &str) -> Result<(), PartitionError> {
        // A node paused past its lease dead-letters nothing more, or the owner after it
        // would record the same message a second time.
        self.held.check_deadline()?;
        let mut outbound =
            Outbound::new(self.jobs.dead_letter_topic.clone(), message.payload.clone())
                .header(wire::ERROR_HEADER, reason)
                .header(wire::SOURCE_TOPIC_HEADER, message.topic.to_string())
                .header(wire::PARTITION_HEADER, self.partition.to_string())
                .header(wire::OFFSET_HEADER, message.position.offset.to_string());
        outbound.key = message.key.clone();
        publish_dead_letter(self.jobs.sink.as_ref(), outbound, &self.stopping).await?;
        warn!(job_type = %self.jobs.job_type.name, partition = self.partition, topic = %self.jobs.dead_letter_topic, %reason, "job message dead-lettered");
        self.counts.dead_letters.increment(1);
        Ok(())
    }

    async fn dead_letter_output(
        &mut self,
        output: &Outbound,
        error: &TransportError,
    ) -> Result<(), PartitionError> {
        // A node paused past its lease publishes nothing more, dead letters included.
        self.held.check_deadline()?;
        let letter = crate::transport::undeliverable(output, error);
        warn!(job_type = %self.jobs.job_type.name, partition = self.partition, topic = %letter.topic, %error, "job output cannot be published; dead-lettered");
        publish_dead_letter(self.jobs.sink.as_ref(), letter, &self.stopping).await?;
        Ok(())
    }

    /// Publishes the batch's outputs, writes its jobs with the partition's position (and,
    /// handing over, the release mark), then commits the position to the broker.
    async fn flush(&mut self, releasing: bool) -> Result<(), PartitionError> {
        if self.batch.is_empty() && !releasing {
            return Ok(());
        }
        // Checked before the outputs leave too: a node paused past its lease publishes
        // nothing more.
        self.held.check_deadline()?;
        let batch = std::mem::take(&mut self.batch);
        // Each output is kept until acknowledged: one the broker refuses for good (too
        // large, say) is recorded on the output's dead-letter topic instead, so the
        // partition goes on.
        let mut acks = Vec::with_capacity(batch.outputs.len());
        for output in batch.outputs {
            // Before each: handing the one before over may have waited (for room in the
            // client's queue, say) past the lease.
            self.held.check_deadline()?;
            match self.jobs.sink.enqueue(output.clone()).await {
                Ok(ack) => acks.push((ack, output)),
                Err(e) if !e.is_retryable() => self.dead_letter_output(&output, &e).await?,
                Err(e) => return Err(e.into()),
            }
        }
        for (ack, output) in acks {
            match ack.await {
                Ok(_) => {}
                Err(e) if !e.is_retryable() => self.dead_letter_output(&output, &e).await?,
                Err(e) => return Err(e.into()),
            }
        }
        let mut changes = PartitionChanges {
            position: self.position,
            released: releasing.then(|| (self.held.lease.token, now_ms())),
            ..Default::default()
        };
        for (id, removed) in batch.changed {
            match (removed, self.cache.get(&id)) {
                (false, Some(record)) => changes.put.push(record.clone()),
                _ => changes.removed.push(id),
            }
        }
        // The batch's outputs are out: a store away for a moment is waited for, not a
        // reason to serve the partition again from the store and publish them again.
        let (name, partition) = (&self.jobs.job_type.name, self.partition);
        let mut retry = StoreRetry::new(
            &self.jobs.ownership_group,
            partition,
            self.jobs.job_type.lease_ttl,
            &self.lost,
        );
        loop {
            let fence = self.held.write_fence()?;
            // Handing over: the next owner's wait counts from the write that lands.
            if let Some((_, at_ms)) = &mut changes.released {
                *at_ms = now_ms();
            }
            match self
                .jobs
                .store
                .save_partition(name, partition, &changes, &fence)
                .await
            {
                Ok(()) => break,
                Err(e) => retry.after(e).await?,
            }
        }
        self.counts.store_writes.increment(1);
        self.evict();
        if let Some(position) = batch.commit {
            // The store has the position: a failed commit only means a replay, skipped.
            if let Err(e) = self.source.commit(&[position]).await {
                warn!(job_type = %self.jobs.job_type.name, partition = self.partition, error = %e, "cannot commit the partition's position; a restart skips what it reads again");
            }
        }
        Ok(())
    }
}

impl Serving<'_> {
    /// Lets the least recently used jobs leave memory once there are more than the
    /// type's limit; their state is stored, and a message or timeout loads them again.
    fn evict(&mut self) {
        let limit = self.jobs.job_type.max_jobs_in_memory.max(1);
        if self.absent.len() > limit {
            self.absent.clear();
        }
        if self.cache.len() <= limit {
            if self.used.len() > 2 * limit {
                let cache = &self.cache;
                self.used.retain(|id, _| cache.contains_key(id));
            }
            return;
        }
        // Down to nine tenths, so eviction runs once per many new jobs, not per job.
        let keep = limit - limit / 10;
        let mut used: Vec<u64> = self
            .cache
            .keys()
            .map(|id| self.used.get(id).copied().unwrap_or(0))
            .collect();
        let cut = self.cache.len() - keep;
        used.select_nth_unstable(cut - 1);
        let threshold = used[cut - 1];
        let used = &self.used;
        self.cache
            .retain(|id, _| used.get(id).is_some_and(|&u| u > threshold));
        let cache = &self.cache;
        self.used.retain(|id, _| cache.contains_key(id));
        self.report_jobs();
    }
}

/// When the job's timeout falls due after a handler's `timer`, given the pending one.
/// A timeout later than [`LATEST_DUE_MS`] (`every_ms` from a message, say) never falls
/// due, rather than wrapping round into the past and firing at once, again and again.
fn deadline(timer: Timer, pending: Option<i64>) -> Option<i64> {
    match timer {
        Timer::Keep => pending,
        Timer::Clear => None,
        Timer::After(after) => i64::try_from(after.as_millis())
            .ok()
            .and_then(|after| now_ms().checked_add(after))
            .filter(|due| *due <= LATEST_DUE_MS),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_timeout_past_the_clocks_reach_never_falls_due() {
        let soon = deadline(Timer::After(Duration::from_millis(10)), None).unwrap();
        assert!(soon >= now_ms());
        assert_eq!(deadline(Timer::After(Duration::MAX), Some(5)), None);
        let most = Duration::from_millis(u64::MAX);
        assert_eq!(deadline(Timer::After(most), None), None);
        let past_the_latest = Duration::from_millis(LATEST_DUE_MS as u64);
        assert_eq!(deadline(Timer::After(past_the_latest), None), None);
        assert_eq!(deadline(Timer::Keep, Some(5)), Some(5));
    }
}
