//! One supervised graph: its wiring, its incarnations (accumulators and reactor), the
//! restarts and respawns between them, its failure budget, and its lease.

use super::*;

/// Sources and sinks of one graph, resolved against the runtime once.
pub(super) struct GraphWiring {
    pub(super) sources: Vec<Option<Arc<dyn SourceFactory>>>,
    pub(super) dead_letter_topics: Vec<String>,
    pub(super) outputs: Arc<[(TopicName, Arc<dyn Sink>)]>,
}

impl GraphWiring {
    pub(super) fn resolve(decl: &GraphDeclaration, runtime: &Runtime) -> Self {
        let mut sources = Vec::new();
        let mut dead_letter_topics = Vec::new();
        for (index, spec) in decl.accumulators.iter().enumerate() {
            let (source, default_dlq): (Option<Arc<dyn SourceFactory>>, String) = match &spec.source
            {
                SourceSpec::None => (
                    None,
                    decl.qualify_topic(&crate::wire::accumulator_dead_letter_topic(
                        &decl.name, &spec.name,
                    )),
                ),
                SourceSpec::Topic { topic, start } => {
                    let topic = decl.qualify_topic(topic);
                    let mut subscription =
                        Subscription::new(topic.clone(), decl.source_group(index));
                    subscription.start = *start;
                    // One active instance per graph: read every partition directly.
                    subscription.assignment = Assignment::All;
                    let source = BrokerSource {
                        broker: runtime.broker.clone(),
                        subscription,
                    };
                    (
                        Some(Arc::new(source)),
                        crate::wire::dead_letter_topic(&topic),
                    )
                }
                SourceSpec::Custom(factory) => (
                    Some(factory.clone()),
                    decl.qualify_topic(&crate::wire::accumulator_dead_letter_topic(
                        &decl.name, &spec.name,
                    )),
                ),
            };
            sources.push(source);
            dead_letter_topics.push(match &spec.dead_letter {
                Some(t) => decl.qualify_topic(t),
                None => default_dlq,
            });
        }
        let outputs = decl
            .outputs
            .iter()
            .map(|o| {
                let sink = o.sink.clone().unwrap_or_else(|| runtime.broker.sink());
                (TopicName::from(decl.qualify_topic(&o.topic)), sink)
            })
            .collect();
        Self {
            sources,
            dead_letter_topics,
            outputs,
        }
    }
}

pub(super) struct SupervisedGraph {
    pub(super) decl: GraphDeclaration,
    pub(super) wiring: GraphWiring,
    pub(super) runtime: Runtime,
    pub(super) policy: SupervisionPolicy,
    pub(super) cancel: CancellationToken,
    pub(super) stats: Arc<GraphStats>,
    pub(super) commands: Arc<tokio::sync::Mutex<mpsc::Receiver<Command>>>,
    pub(super) sockets: Vec<SocketReceiver>,
    pub(super) health: Vec<Arc<watch::Sender<Health>>>,
    pub(super) status: watch::Sender<GraphStatus>,
    pub(super) state: watch::Sender<ReactorState>,
    pub(super) restart: Arc<Notify>,
    /// What the accumulators of the last incarnation shared, for the next to take over
    /// what outlasts an incarnation (the messages they panicked on).
    pub(super) last_shared: Mutex<Vec<Arc<SourceShared>>>,
}

/// How long an accumulator's source runs before an outage it meets counts as a new one,
/// its backoff starting over (as it does once the source delivered a message new to
/// it): a connection that breaks now and then is reopened after a second each time, not
/// after a backoff grown by all of them.
const NEW_OUTAGE_AFTER: std::time::Duration = std::time::Duration::from_secs(10);

/// Consecutive failures, with the healthy-time reset. Waits on unreachable
/// infrastructure are counted apart: they set the backoff, never the failure budget.
#[derive(Default)]
pub(super) struct FailureCount {
    pub(super) count: u32,
    pub(super) last: Option<Instant>,
    pub(super) outages: u32,
    pub(super) last_outage: Option<Instant>,
}

/// How one incarnation of the graph ended.
pub(super) enum Ended {
    Cancelled,
    /// The reactor stopped; `retryable` when waiting may help (store or broker away).
    ReactorFailed {
        error: String,
        retryable: bool,
    },
    Failed,
    LeaseLost,
    /// A restart command.
    Restart,
}

/// Why the graph stopped running on this node.
#[derive(PartialEq, Eq)]
pub(super) enum Outcome {
    Stop,
    Failed,
    Standby,
}

impl SupervisedGraph {
    pub(super) async fn supervise(self) {
        let name = self.decl.key();
        info!(graph = %name, accumulators = self.decl.accumulators.len(), "graph starting");
        let mut failures = FailureCount::default();
        loop {
            let lease = match self.policy.graph_lease_ttl {
                Some(ttl) => match self.acquire_lease(ttl).await {
                    Some(held) => Some((held, ttl)),
                    None => break,
                },
                None => None,
            };
            let lost = CancellationToken::new();
            let renewer = lease.clone().map(|(held, ttl)| {
                tokio::spawn(crate::lease::keep(
                    self.runtime.store.clone(),
                    held,
                    ttl,
                    crate::lease::AtDeadline::GiveUp,
                    lost.clone(),
                    self.cancel.clone(),
                ))
            });
            let held = lease.as_ref().map(|(held, _)| held.clone());
            let outcome = self.run_while_leased(&mut failures, &lost, held).await;
            if lease.is_some() {
                // Released below, or lost: either way no longer held.
                crate::metrics::lease_dropped(LeaseRole::Graph);
            }
            if let Some(renewer) = renewer {
                renewer.abort();
            }
            if let Some((held, _)) = &lease {
                if outcome != Outcome::Standby {
                    if let Err(e) = self.runtime.store.release_lease(&held.lease).await {
                        warn!(graph = %name, error = %e, "lease not released; it will expire");
                    }
                }
            }
            match outcome {
                Outcome::Stop => break,
                Outcome::Failed => {
                    // The metric first: whoever sees the new state sees it reported.
                    self.stats.state_changed(ReactorState::Failed);
                    self.state.send_replace(ReactorState::Failed);
                    tokio::select! {
                        _ = self.cancel.cancelled() => break,
                        _ = tokio::time::sleep(self.policy.failed_retry) => {
                            info!(graph = %name, "retrying the failed graph");
                        }
                        _ = self.restart.notified() => {
                            info!(graph = %name, "restarting the failed graph on request");
                            // The operator's call: its panics are looked at afresh.
                            self.forget_last_run();
                        }
                    }
                    failures = FailureCount::default();
                }
                Outcome::Standby => {
                    warn!(graph = %name, "graph lease lost; standing by");
                    // Another node runs it meanwhile: what this one learnt of its
                    // messages is stale by the time it runs it again.
                    self.forget_last_run();
                }
            }
        }
        self.status.send_replace(GraphStatus::Stopped);
        info!(graph = %name, "graph stopped");
    }

    /// Drops what the last incarnation's accumulators shared, so the next takes over
    /// nothing of it.
    fn forget_last_run(&self) {
        self.last_shared
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }

    /// Waits until this process holds the graph's lease; `None` if cancelled first.
    pub(super) async fn acquire_lease(
        &self,
        ttl: std::time::Duration,
    ) -> Option<crate::lease::Held> {
        self.status.send_replace(GraphStatus::Standby);
        let name = format!("graph:{}", self.decl.key());
        let retry = (ttl / 3).max(std::time::Duration::from_millis(50));
        loop {
            match crate::lease::acquire(
                self.runtime.store.as_ref(),
                &name,
                &self.runtime.node_id,
                ttl,
            )
            .await
            {
                Ok(Some(held)) => {
                    info!(graph = %self.decl.key(), token = held.lease.token, "graph lease acquired");
                    crate::metrics::lease_acquired(LeaseRole::Graph);
                    return Some(held);
                }
                Ok(None) => {}
                Err(e) => {
                    warn!(graph = %self.decl.key(), error = %e, "cannot reach the store for the graph lease")
                }
            }
            tokio::select! {
                _ = self.cancel.cancelled() => return None,
                _ = tokio::time::sleep(retry) => {}
                // Another node runs the graph: nothing here to restart, and a command kept
                // for later would tear down the incarnation this node starts on failover.
                _ = self.restart.notified() => {
                    info!(graph = %self.decl.key(), "restart ignored: another node runs the graph");
                }
            }
        }
    }

    /// Runs incarnations, restarting after failures, until stopped, failed or the lease
    /// is lost.
    pub(super) async fn run_while_leased(
        &self,
        failures: &mut FailureCount,
        lost: &CancellationToken,
        lease: Option<crate::lease::Held>,
    ) -> Outcome {
        loop {
            match self.incarnation(failures, lost, lease.clone()).await {
                Ended::Cancelled => return Outcome::Stop,
                Ended::Failed => return Outcome::Failed,
                Ended::LeaseLost => return Outcome::Standby,
                Ended::Restart => info!(graph = %self.decl.key(), "restarting on request"),
                Ended::ReactorFailed { error, retryable } => {
                    let Some(delay) = self
                        .failure(
                            failures,
                            "reactor",
                            RecoveryAction::GraphRespawned,
                            &error,
                            retryable,
                            None,
                        )
                        .await
                    else {
                        return Outcome::Failed;
                    };
                    self.status.send_replace(GraphStatus::Restarting {
                        failures: failures.count,
                    });
                    if retryable {
                        self.stats.state_changed(ReactorState::Degraded);
                        self.state.send_replace(ReactorState::Degraded);
                    }
                    tokio::select! {
                        _ = self.cancel.cancelled() => return Outcome::Stop,
                        _ = lost.cancelled() => return Outcome::Standby,
                        _ = self.restart.notified() => {}
                        _ = tokio::time::sleep(delay) => {}
                    }
                }
            }
        }
    }

    /// Counts a failure and records it. Returns the backoff before the restart, or `None`
    /// when the graph is now Failed. A `retryable` failure (store or broker unreachable)
    /// is waited out with backoff and never counts toward Failed; the backoff follows
    /// `own_outages`, the outages of a component that counts its own, or else the graph's.
    pub(super) async fn failure(
        &self,
        failures: &mut FailureCount,
        component: &str,
        action: RecoveryAction,
        error: &str,
        retryable: bool,
        own_outages: Option<u32>,
    ) -> Option<std::time::Duration> {
        let now = Instant::now();
        let reset = |last: Option<Instant>| {
            last.is_some_and(|last| now.duration_since(last) >= self.policy.healthy_reset)
        };
        if reset(failures.last) {
            failures.count = 0;
        }
        if reset(failures.last_outage) {
            failures.outages = 0;
        }
        if retryable {
            // An accumulator's outages set its own backoff alone: a source that breaks
            // now and then must not lengthen the reactor's after a store outage.
            if own_outages.is_none() {
                failures.outages += 1;
                failures.last_outage = Some(now);
            }
        } else {
            failures.count += 1;
            failures.last = Some(now);
        }
        let failed = !retryable && failures.count >= self.policy.max_failures;
        let action = if failed {
            RecoveryAction::GraphFailed
        } else {
            action
        };
        self.record(component, action, failures.count, error).await;
        if failed {
            error!(graph = %self.decl.key(), %component, failures = failures.count, %error, "graph failed");
            self.status.send_replace(GraphStatus::Failed {
                error: format!("{component}: {error}"),
            });
            return None;
        }
        let delay = if retryable {
            self.policy.backoff(own_outages.unwrap_or(failures.outages))
        } else {
            self.policy.backoff(failures.count)
        };
        warn!(graph = %self.decl.key(), %component, failures = failures.count, retryable, ?delay, %error, "restarting after failure");
        Some(delay)
    }

    /// Stores a recovery event and counts it in the metrics.
    async fn record(&self, component: &str, action: RecoveryAction, attempt: u32, error: &str) {
        let event = RecoveryEvent {
            graph: self.decl.key(),
            component: component.to_string(),
            action,
            attempt,
            error: error.to_string(),
            at_ms: now_ms(),
            node_id: self.runtime.node_id.clone(),
        };
        if let Err(e) = self.runtime.store.record_recovery(&event).await {
            warn!(graph = %event.graph, error = %e, "recovery event not recorded");
        }
        crate::metrics::recovery_recorded(&event.graph, action.as_str());
    }

    /// Nested in the graph's span, so an accumulator's logs carry `graph` and `source`.
    pub(super) fn source_span(&self, index: usize) -> tracing::Span {
        info_span!("accumulator", source = %self.decl.accumulators[index].name)
    }

    pub(super) fn accumulator_task(
        &self,
        index: usize,
        wiring: &Wiring,
        lease: &Option<crate::lease::Held>,
        cancel: &CancellationToken,
    ) -> AccumulatorTask {
        AccumulatorTask {
            graph: Arc::from(self.decl.key().as_str()),
            key: self.decl.key(),
            index,
            spec: self.decl.accumulators[index].clone(),
            source: self.wiring.sources[index].clone(),
            dead_letter_topic: self.wiring.dead_letter_topics[index].clone(),
            dead_letters: self.runtime.broker.sink(),
            store: self.runtime.store.clone(),
            socket: self.sockets[index].clone(),
            to_reactor: wiring.inputs.clone(),
            permits: wiring.permits[index].clone(),
            shared: wiring.shared[index].clone(),
            carried: wiring.carried[index].clone(),
            lease: lease.clone(),
            durable: wiring.durable[index].clone(),
            health: self.health[index].clone(),
            stats: self.stats.clone(),
            cancel: cancel.clone(),
            // Only a broker topic replays what a lagging checkpoint left out: a poll
            // numbers on from its checkpoint and pushes are never replayed, so their
            // checkpoints are written at once.
            checkpoint_interval: match self.decl.accumulators[index].source {
                SourceSpec::Topic { .. } => self.decl.reactor.checkpoint_interval,
                SourceSpec::None | SourceSpec::Custom(_) => std::time::Duration::ZERO,
            },
        }
    }

    pub(super) async fn incarnation(
        &self,
        failures: &mut FailureCount,
        lost: &CancellationToken,
        lease: Option<crate::lease::Held>,
    ) -> Ended {
        let cancel = self.cancel.child_token();
        let restored = Reactor::restore(
            &self.decl,
            self.wiring.outputs.clone(),
            self.runtime.store.clone(),
            self.stats.clone(),
            self.state.clone(),
            lease.clone(),
        )
        .await;
        let (reactor, wiring) = match restored {
            Ok(r) => r,
            Err(e) => {
                return Ended::ReactorFailed {
                    error: e.to_string(),
                    retryable: e.is_retryable(),
                }
            }
        };
        {
            let mut last = self.last_shared.lock().unwrap_or_else(|e| e.into_inner());
            for (shared, earlier) in wiring.shared.iter().zip(last.iter()) {
                shared.inherit_panics(earlier);
            }
            *last = wiring.shared.clone();
        }
        let commands = self.commands.clone();
        let reactor_cancel = cancel.clone();
        let mut reactor_task: JoinHandle<Result<(), ReactorError>> = tokio::spawn(
            async move {
                let mut commands = commands.lock_owned().await;
                reactor.run(&mut commands, reactor_cancel).await
            }
            .instrument(info_span!("reactor")),
        );
        let mut accumulators = JoinSet::new();
        let mut ids: HashMap<Id, usize> = HashMap::new();
        // Outages met by each accumulator since its source last ran a while: they set
        // its restart backoff, so one source breaking now and then does not cut short
        // another's backoff through a long outage.
        let mut source_outages = vec![0u32; self.decl.accumulators.len()];
        for index in 0..self.decl.accumulators.len() {
            let task = self.accumulator_task(index, &wiring, &lease, &cancel);
            let handle = accumulators.spawn(task.run().instrument(self.source_span(index)));
            ids.insert(handle.id(), index);
        }
        self.status.send_replace(GraphStatus::Running);

        let ended = loop {
            tokio::select! {
                biased;
                _ = self.cancel.cancelled() => break Ended::Cancelled,
                _ = lost.cancelled() => break Ended::LeaseLost,
                _ = self.restart.notified() => break Ended::Restart,
                result = &mut reactor_task => {
                    if self.cancel.is_cancelled() {
                        break Ended::Cancelled;
                    }
                    let (error, retryable) = match result {
                        Ok(Ok(())) => ("reactor exited".to_string(), false),
                        Ok(Err(e)) => (e.to_string(), e.is_retryable()),
                        Err(e) => (describe_join_error(e), false),
                    };
                    break Ended::ReactorFailed { error, retryable };
                }
                Some(result) = accumulators.join_next_with_id() => {
                    if self.cancel.is_cancelled() {
                        break Ended::Cancelled;
                    }
                    let (id, error, retryable, poisoned) = match result {
                        // Its reactor is gone: the reactor's end is what counts, once.
                        Ok((id, Ok(()))) if wiring.inputs.is_closed() => {
                            ids.remove(&id);
                            continue;
                        }
                        Ok((id, Ok(()))) => (id, "accumulator exited".to_string(), false, false),
                        Ok((id, Err(e))) => {
                            let poisoned = matches!(e, crate::accumulator::AccumulatorError::PanickedOnMessage { .. });
                            (id, e.to_string(), e.is_retryable(), poisoned)
                        }
                        Err(e) => (e.id(), describe_join_error(e), false, false),
                    };
                    let Some(index) = ids.remove(&id) else { continue };
                    let name = self.decl.accumulators[index].name.clone();
                    self.health[index].send_replace(Health::Disconnected);
                    self.stats.health_changed(index, Health::Disconnected);
                    let _ = wiring.inputs.send(ReactorInput::Health { source: index, health: Health::Disconnected }).await;
                    if retryable && !poisoned {
                        // Its source ran a while, or got somewhere, before it broke: a new
                        // outage, not the one it was restarted after.
                        let shared = &wiring.shared[index];
                        if shared.live_for() >= NEW_OUTAGE_AFTER || shared.delivered_new() {
                            source_outages[index] = 0;
                        }
                        source_outages[index] += 1;
                    }
                    // A panic on one message is that message's fault, not the graph's:
                    // the successor starts at once and dead-letters it if it panics
                    // on it again.
                    let delay = if poisoned {
                        warn!(graph = %self.decl.key(), component = %name, %error, "restarting the accumulator");
                        self.record(&name, RecoveryAction::AccumulatorRestarted, failures.count, &error).await;
                        std::time::Duration::ZERO
                    } else {
                        let own_outages = Some(source_outages[index]);
                        let Some(delay) = self
                            .failure(failures, &name, RecoveryAction::AccumulatorRestarted, &error, retryable, own_outages)
                            .await
                        else {
                            break Ended::Failed;
                        };
                        delay
                    };
                    let task = self.accumulator_task(index, &wiring, &lease, &cancel);
                    let handle = accumulators
                        .spawn(task.run_after(delay).instrument(self.source_span(index)));
                    ids.insert(handle.id(), index);
                }
            }
        };

        // Tear down this incarnation: stop accumulators first so their last boundaries
        // reach the reactor, then let the reactor finish its in-flight fires.
        cancel.cancel();
        let limit = self.policy.shutdown_timeout;
        let teardown_began = tokio::time::Instant::now();
        let drained = tokio::time::timeout(limit, async {
            while accumulators.join_next().await.is_some() {}
            if !reactor_task.is_finished() {
                let _ = (&mut reactor_task).await;
            }
        })
        .await;
        if drained.is_err() {
            warn!(graph = %self.decl.key(), "tasks did not stop in time; aborting them");
            accumulators.abort_all();
            reactor_task.abort();
            while accumulators.join_next().await.is_some() {}
            let _ = reactor_task.await;
        }
        // A source whose run a failure left waiting for its successor when the
        // incarnation ended (the graph failed, say) stores that run's checkpoint, as a
        // running accumulator does at a stop, within what is left of the stop limit.
        let waiting = (0..self.decl.accumulators.len())
            .filter(|&index| wiring.carried[index].is_waiting())
            .map(|index| self.accumulator_task(index, &wiring, &lease, &cancel));
        let stored = futures::future::join_all(
            waiting.map(|task| async move { task.store_carried().await }),
        );
        let left = limit.saturating_sub(teardown_began.elapsed());
        if tokio::time::timeout(left, stored).await.is_err() {
            warn!(graph = %self.decl.key(), "a source's last checkpoint was not stored in time; a restart re-reads from the one before");
        }
        ended
    }
}

pub(super) fn describe_join_error(e: JoinError) -> String {
    if e.is_panic() {
        let panic = e.into_panic();
        format!(
            "panicked: {}",
            crate::accumulator::panic_message(panic.as_ref())
        )
    } else {
        "cancelled".to_string()
    }
}
