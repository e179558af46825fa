//! Schedules, their fire times and executions, and live nodes on the Redis store.

use super::*;

/// Execution records kept per schedule.
const EXECUTIONS_KEPT: isize = 1000;

/// An open-index member is `schedule@scheduled_ms`; the schedule id may itself hold
/// an `@`, the time never does.
fn open_member_prefix(schedule_id: &str) -> String {
    format!("{schedule_id}@")
}

/// Claims an execution (SET NX), adds it to its schedule's history and, while
/// unfinished, to the open index; an execution that falls out of the history is deleted
/// with its index entry, so records do not outlive the history that lists them.
/// Refused (-1) when a fence token is given and a newer one exists.
/// KEYS: record, history, open index, lease token counter. ARGV: record JSON, scheduled
/// ms, executions kept, record key prefix, index member prefix, index score ('' when
/// finished), fence token ('' for none).
static CLAIM_EXECUTION: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
if ARGV[7] ~= '' and tonumber(redis.call('GET', KEYS[4]) or '0') > tonumber(ARGV[7]) then
  return -1
end
if not redis.call('SET', KEYS[1], ARGV[1], 'NX') then
  return 0
end
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[2])
if ARGV[6] ~= '' then
  redis.call('ZADD', KEYS[3], ARGV[6], ARGV[5] .. ARGV[2])
end
local excess = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[3])
if excess > 0 then
  local dropped = redis.call('ZPOPMIN', KEYS[2], excess)
  for i = 1, #dropped, 2 do
    redis.call('DEL', ARGV[4] .. dropped[i])
    redis.call('ZREM', KEYS[3], ARGV[5] .. dropped[i])
  end
end
return 1
"#,
    )
});

/// A held-back entry as it is stored: `first_due_ms:retry_ms`.
fn held_back_entry(held: &HeldBack) -> String {
    format!("{}:{}", held.first_due_ms, held.retry_ms)
}

/// A held-back entry as [`held_back_entry`] writes it.
fn parse_held_back(text: &str) -> Option<HeldBack> {
    let (first_due, retry) = text.split_once(':')?;
    Some(HeldBack {
        first_due_ms: first_due.parse().ok()?,
        retry_ms: retry.parse().ok()?,
    })
}

impl RedisStore {
    fn execution_key(&self, schedule_id: &str, scheduled_ms: i64) -> String {
        self.key(&["exec", schedule_id, &scheduled_ms.to_string()])
    }

    /// Sorted set of unfinished executions, scored by [`Execution::open_since`].
    fn open_index(&self) -> String {
        self.key(&["exec", "open"])
    }

    /// Writing an execution record, with the open index kept in step with its status.
    fn execution_write(&self, execution: &Execution) -> Result<Write, StoreError> {
        let member = format!(
            "{}{}",
            open_member_prefix(&execution.schedule_id),
            execution.scheduled_ms
        );
        Ok(Write::Execution {
            key: self.execution_key(&execution.schedule_id, execution.scheduled_ms),
            record: Self::encode(execution)?,
            index: self.open_index(),
            member,
            open_since: execution.open_since(),
        })
    }

    /// Hash of what a shard's master held back: schedule id → `first_due_ms:retry_ms`.
    fn held_back_key(&self, shard: u32) -> String {
        self.key(&["sched", "held", &shard.to_string()])
    }

    fn changes_channel(&self) -> String {
        self.key(&["sched", "changed"])
    }
}

#[async_trait]
impl ScheduleStore for RedisStore {
    async fn put_schedule(&self, schedule: &Schedule) -> Result<(), StoreError> {
        let text = Self::encode(schedule)?;
        let mut c = self.connection.clone();
        redis::pipe()
            .atomic()
            .set(self.key(&["sched", &schedule.id]), text)
            .sadd(self.key(&["sched", "ids"]), &schedule.id)
            .publish(self.changes_channel(), &schedule.id)
            .query_async::<()>(&mut c)
            .await
            .map_err(|e| store_error("put schedule", e))
    }

    async fn get_schedule(&self, id: &str) -> Result<Option<Schedule>, StoreError> {
        self.get_json(self.key(&["sched", id])).await
    }

    async fn list_schedules(&self) -> Result<ScheduleList, StoreError> {
        let mut c = self.connection.clone();
        let mut ids: Vec<String> = c
            .smembers(self.key(&["sched", "ids"]))
            .await
            .map_err(|e| store_error("SMEMBERS", e))?;
        ids.sort();
        let mut list = ScheduleList::default();
        for chunk in ids.chunks(500) {
            let keys: Vec<String> = chunk.iter().map(|id| self.key(&["sched", id])).collect();
            let raw: Vec<Option<String>> = redis::cmd("MGET")
                .arg(&keys)
                .query_async(&mut c)
                .await
                .map_err(|e| store_error("MGET", e))?;
            for ((id, key), text) in chunk.iter().zip(keys).zip(raw) {
                // MGET answers nothing for a key of another type, as for one deleted
                // since the ids were read: told apart by its type, looked up for those
                // only.
                let Some(text) = text else {
                    let kind: String = redis::cmd("TYPE")
                        .arg(&key)
                        .query_async(&mut c)
                        .await
                        .map_err(|e| store_error("TYPE", e))?;
                    if kind != "none" {
                        list.unreadable.push(UnreadableSchedule {
                            id: id.clone(),
                            error: StoreError::Corrupt {
                                source: format!("the key holds a Redis {kind}, not a schedule")
                                    .into(),
                                key,
                            },
                        });
                    }
                    continue;
                };
                match serde_json::from_str::<Schedule>(&text) {
                    Ok(schedule) => list.schedules.push(schedule),
                    Err(e) => list.unreadable.push(UnreadableSchedule {
                        id: id.clone(),
                        error: StoreError::Corrupt {
                            key,
                            source: e.into(),
                        },
                    }),
                }
            }
        }
        Ok(list)
    }

    async fn delete_schedule(&self, id: &str, shard: u32) -> Result<bool, StoreError> {
        let mut c = self.connection.clone();
        let (deleted,): (i64,) = redis::pipe()
            .atomic()
            .del(self.key(&["sched", id]))
            .srem(self.key(&["sched", "ids"]), id)
            .ignore()
            .zrem(self.key(&["sched", "due", &shard.to_string()]), id)
            .ignore()
            .hdel(self.held_back_key(shard), id)
            .ignore()
            .publish(self.changes_channel(), id)
            .ignore()
            .query_async(&mut c)
            .await
            .map_err(|e| store_error("delete schedule", e))?;
        Ok(deleted > 0)
    }

    async fn set_next_fire(
        &self,
        shard: u32,
        id: &str,
        at_ms: Option<i64>,
    ) -> Result<(), StoreError> {
        let key = self.key(&["sched", "due", &shard.to_string()]);
        let mut c = self.connection.clone();
        match at_ms {
            Some(at) => c
                .zadd::<_, _, _, ()>(key, id, at)
                .await
                .map_err(|e| store_error("ZADD", e)),
            None => redis::pipe()
                .atomic()
                .zrem(key, id)
                .ignore()
                .hdel(self.held_back_key(shard), id)
                .ignore()
                .query_async::<()>(&mut c)
                .await
                .map_err(|e| store_error("ZREM", e)),
        }
    }

    async fn next_fire(&self, shard: u32, id: &str) -> Result<Option<i64>, StoreError> {
        let key = self.key(&["sched", "due", &shard.to_string()]);
        let mut c = self.connection.clone();
        c.zscore(key, id)
            .await
            .map_err(|e| store_error("ZSCORE", e))
    }

    async fn due_schedules(
        &self,
        shard: u32,
        until_ms: i64,
        limit: usize,
    ) -> Result<Vec<(String, i64)>, StoreError> {
        let mut c = self.connection.clone();
        c.zrangebyscore_limit_withscores(
            self.key(&["sched", "due", &shard.to_string()]),
            "-inf",
            until_ms,
            0,
            limit as isize,
        )
        .await
        .map_err(|e| store_error("ZRANGEBYSCORE", e))
    }

    async fn hold_back(&self, shard: u32, id: &str, held: HeldBack) -> Result<(), StoreError> {
        let mut c = self.connection.clone();
        c.hset::<_, _, _, ()>(self.held_back_key(shard), id, held_back_entry(&held))
            .await
            .map_err(|e| store_error("HSET", e))
    }

    async fn held_back(
        &self,
        shard: u32,
        ids: &[String],
    ) -> Result<Vec<Option<HeldBack>>, StoreError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let key = self.held_back_key(shard);
        let mut c = self.connection.clone();
        let raw: Vec<Option<String>> = redis::cmd("HMGET")
            .arg(&key)
            .arg(ids)
            .query_async(&mut c)
            .await
            .map_err(|e| store_error("HMGET", e))?;
        Ok(raw
            .into_iter()
            .zip(ids)
            .map(|(text, id)| {
                let text = text?;
                let held = parse_held_back(&text);
                if held.is_none() {
                    // Its next look writes it afresh; meanwhile the schedule fires from
                    // its next fire time, as it would have without it.
                    tracing::warn!(key = %key, schedule = %id, entry = %text, "held-back entry is not first_due_ms:retry_ms; ignored");
                }
                held
            })
            .collect())
    }

    async fn filed_schedules(
        &self,
        shard: u32,
        from: Option<&str>,
        count: usize,
    ) -> Result<(Vec<String>, Option<String>), StoreError> {
        // ZSCAN's cursor keeps its guarantee while the set changes, unlike a rank.
        let mut c = self.connection.clone();
        let (next, page): (String, Vec<String>) = redis::cmd("ZSCAN")
            .arg(self.key(&["sched", "due", &shard.to_string()]))
            .arg(from.unwrap_or("0"))
            .arg("COUNT")
            .arg(count)
            .query_async(&mut c)
            .await
            .map_err(|e| store_error("ZSCAN", e))?;
        // Member, score, member, score...
        let ids = page.into_iter().step_by(2).collect();
        Ok((ids, (next != "0").then_some(next)))
    }

    async fn earliest_fire(&self, shard: u32) -> Result<Option<i64>, StoreError> {
        let mut c = self.connection.clone();
        let first: Vec<(String, i64)> = c
            .zrange_withscores(self.key(&["sched", "due", &shard.to_string()]), 0, 0)
            .await
            .map_err(|e| store_error("ZRANGE", e))?;
        Ok(first.first().map(|(_, at)| *at))
    }

    async fn claim_execution(&self, execution: &Execution) -> Result<bool, StoreError> {
        let claims = self
            .claim_executions(std::slice::from_ref(execution), None)
            .await?;
        Ok(claims.first().copied().unwrap_or(false))
    }

    async fn claim_executions(
        &self,
        executions: &[Execution],
        fence: Option<&Fence>,
    ) -> Result<Vec<bool>, StoreError> {
        if executions.is_empty() {
            return Ok(Vec::new());
        }
        let fence_key = match fence {
            Some(f) => self.key(&["fence", &f.lease]),
            None => self.key(&["fence", "none"]),
        };
        let token = fence.map(|f| f.token.to_string()).unwrap_or_default();
        let open = self.open_index();
        let mut pipe = redis::pipe();
        // Loading the script first lets the pipeline invoke it by hash on any server.
        pipe.load_script(&CLAIM_EXECUTION).ignore();
        for e in executions {
            let ms = e.scheduled_ms.to_string();
            let mut claim = CLAIM_EXECUTION.key(self.execution_key(&e.schedule_id, e.scheduled_ms));
            claim
                .key(self.key(&["exec", "hist", &e.schedule_id]))
                .key(&open)
                .key(&fence_key)
                .arg(Self::encode(e)?)
                .arg(&ms)
                .arg(EXECUTIONS_KEPT)
                .arg(format!("{}:", self.key(&["exec", &e.schedule_id])))
                .arg(open_member_prefix(&e.schedule_id))
                .arg(e.open_since().map(|s| s.to_string()).unwrap_or_default())
                .arg(&token);
            pipe.invoke_script(&claim);
        }
        let mut c = self.connection.clone();
        let replies: Vec<i64> = pipe
            .query_async(&mut c)
            .await
            .map_err(|e| store_error("claim executions", e))?;
        if let (Some(fence), true) = (fence, replies.contains(&-1)) {
            return Err(StoreError::Fenced {
                lease: fence.lease.clone(),
                token: fence.token,
            });
        }
        Ok(replies.into_iter().map(|r| r == 1).collect())
    }

    async fn record_fires(
        &self,
        shard: u32,
        executions: &[Execution],
        next_fires: &[(String, Option<i64>)],
        held_back: &[(String, Option<HeldBack>)],
        fence: &Fence,
    ) -> Result<(), StoreError> {
        if executions.is_empty() && next_fires.is_empty() && held_back.is_empty() {
            return Ok(());
        }
        let due = self.key(&["sched", "due", &shard.to_string()]);
        let mut writes = Vec::with_capacity(executions.len() + next_fires.len());
        for e in executions {
            writes.push(self.execution_write(e)?);
        }
        let held_key = self.held_back_key(shard);
        for (id, at) in next_fires {
            match at {
                Some(at) => writes.push(Write::Zadd(due.clone(), *at, id.clone())),
                // No longer fired from this shard: what it held back of it goes too, as
                // `set_next_fire` does (an entry that did not parse included).
                None => {
                    writes.push(Write::Zrem(due.clone(), id.clone()));
                    writes.push(Write::Hdel(held_key.clone(), id.clone()));
                }
            }
        }
        for (id, held) in held_back {
            writes.push(match held {
                Some(held) => Write::Hset(held_key.clone(), id.clone(), held_back_entry(held)),
                None => Write::Hdel(held_key.clone(), id.clone()),
            });
        }
        self.apply_writes("record fires", writes, Some(fence)).await
    }

    async fn put_execution(
        &self,
        execution: &Execution,
        fence: Option<&Fence>,
    ) -> Result<(), StoreError> {
        let writes = vec![self.execution_write(execution)?];
        self.apply_writes("put execution", writes, fence).await
    }

    async fn open_executions(
        &self,
        changed_by_ms: i64,
        skip: usize,
        limit: usize,
    ) -> Result<Vec<(String, i64)>, StoreError> {
        let mut c = self.connection.clone();
        let members: Vec<String> = c
            .zrangebyscore_limit(
                self.open_index(),
                "-inf",
                changed_by_ms,
                skip as isize,
                limit as isize,
            )
            .await
            .map_err(|e| store_error("ZRANGEBYSCORE", e))?;
        Ok(members
            .iter()
            .filter_map(|m| {
                let (schedule, ms) = m.rsplit_once('@')?;
                Some((schedule.to_string(), ms.parse().ok()?))
            })
            .collect())
    }

    async fn get_execution(
        &self,
        schedule_id: &str,
        scheduled_ms: i64,
    ) -> Result<Option<Execution>, StoreError> {
        self.get_json(self.execution_key(schedule_id, scheduled_ms))
            .await
    }

    async fn executions(
        &self,
        schedule_id: &str,
        limit: usize,
    ) -> Result<ExecutionList, StoreError> {
        if limit == 0 {
            return Ok(ExecutionList::default());
        }
        let mut c = self.connection.clone();
        let times: Vec<i64> = c
            .zrevrange(
                self.key(&["exec", "hist", schedule_id]),
                0,
                limit as isize - 1,
            )
            .await
            .map_err(|e| store_error("ZREVRANGE", e))?;
        if times.is_empty() {
            return Ok(ExecutionList::default());
        }
        let keys: Vec<String> = times
            .iter()
            .map(|t| self.execution_key(schedule_id, *t))
            .collect();
        let raw: Vec<Option<String>> = redis::cmd("MGET")
            .arg(&keys)
            .query_async(&mut c)
            .await
            .map_err(|e| store_error("MGET", e))?;
        let mut list = ExecutionList::default();
        for ((key, scheduled_ms), text) in keys.into_iter().zip(times).zip(raw) {
            let Some(text) = text else { continue };
            match serde_json::from_str(&text) {
                Ok(execution) => list.executions.push(execution),
                Err(e) => list.unreadable.push(UnreadableExecution {
                    scheduled_ms,
                    error: StoreError::Corrupt {
                        key,
                        source: e.into(),
                    },
                }),
            }
        }
        Ok(list)
    }

    async fn register_node(
        &self,
        node: &str,
        priority: i64,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let mut c = self.connection.clone();
        redis::pipe()
            .cmd("SET")
            .arg(self.key(&["node", node]))
            .arg(priority)
            .arg("PX")
            .arg(ttl.as_millis().max(1) as u64)
            .sadd(self.key(&["nodes"]), node)
            .query_async::<()>(&mut c)
            .await
            .map_err(|e| store_error("register node", e))
    }

    async fn live_nodes(&self) -> Result<Vec<(String, i64)>, StoreError> {
        let mut c = self.connection.clone();
        let nodes: Vec<String> = c
            .smembers(self.key(&["nodes"]))
            .await
            .map_err(|e| store_error("SMEMBERS", e))?;
        if nodes.is_empty() {
            return Ok(Vec::new());
        }
        let keys: Vec<String> = nodes.iter().map(|n| self.key(&["node", n])).collect();
        let priorities: Vec<Option<i64>> = redis::cmd("MGET")
            .arg(&keys)
            .query_async(&mut c)
            .await
            .map_err(|e| store_error("MGET", e))?;
        let mut live = Vec::new();
        for (node, priority) in nodes.into_iter().zip(priorities) {
            match priority {
                Some(p) => live.push((node, p)),
                None => {
                    let _: Result<(), _> = c.srem(self.key(&["nodes"]), &node).await;
                }
            }
        }
        Ok(live)
    }

    async fn watch_schedules(&self) -> Result<ScheduleChanges, StoreError> {
        let mut pubsub = self
            .client
            .get_async_pubsub()
            .await
            .map_err(|e| store_error("SUBSCRIBE", e))?;
        pubsub
            .subscribe(self.changes_channel())
            .await
            .map_err(|e| store_error("SUBSCRIBE", e))?;
        let (tx, receiver) = tokio::sync::mpsc::channel(crate::cron::store::SCHEDULE_CHANGES_HELD);
        tokio::spawn(async move {
            use futures::StreamExt;
            let mut messages = pubsub.on_message();
            // Ends with the connection, with the reader, or at a message that names no
            // schedule: its reader then takes every schedule to have changed.
            while let Some(message) = messages.next().await {
                let Ok(id) = message.get_payload::<String>() else {
                    return;
                };
                if tx.send(id).await.is_err() {
                    return;
                }
            }
        });
        Ok(ScheduleChanges { receiver })
    }
}
