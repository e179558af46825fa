//! Schedules, their fire times and executions, and live nodes on the memory store.

use super::*;

#[async_trait]
impl ScheduleStore for MemoryStore {
    async fn put_schedule(&self, schedule: &Schedule) -> Result<(), StoreError> {
        self.state()?
            .schedules
            .insert(schedule.id.clone(), schedule.clone());
        self.notify_watchers(&schedule.id);
        Ok(())
    }

    async fn get_schedule(&self, id: &str) -> Result<Option<Schedule>, StoreError> {
        Ok(self.state()?.schedules.get(id).cloned())
    }

    async fn list_schedules(&self) -> Result<ScheduleList, StoreError> {
        Ok(ScheduleList {
            schedules: self.state()?.schedules.values().cloned().collect(),
            unreadable: Vec::new(),
        })
    }

    async fn delete_schedule(&self, id: &str, shard: u32) -> Result<bool, StoreError> {
        let existed = {
            let mut state = self.state()?;
            if let Some(fires) = state.due.get_mut(&shard) {
                fires.set(id, None);
            }
            state.held_back.remove(&(shard, id.to_string()));
            state.schedules.remove(id).is_some()
        };
        self.notify_watchers(id);
        Ok(existed)
    }

    async fn set_next_fire(
        &self,
        shard: u32,
        id: &str,
        at_ms: Option<i64>,
    ) -> Result<(), StoreError> {
        let mut state = self.state()?;
        state.due.entry(shard).or_default().set(id, at_ms);
        if at_ms.is_none() {
            state.held_back.remove(&(shard, id.to_string()));
        }
        Ok(())
    }

    async fn next_fire(&self, shard: u32, id: &str) -> Result<Option<i64>, StoreError> {
        Ok(self
            .state()?
            .due
            .get(&shard)
            .and_then(|fires| fires.by_id.get(id).copied()))
    }

    async fn due_schedules(
        &self,
        shard: u32,
        until_ms: i64,
        limit: usize,
    ) -> Result<Vec<(String, i64)>, StoreError> {
        let state = self.state()?;
        Ok(state
            .due
            .get(&shard)
            .map(|fires| {
                fires
                    .by_time
                    .iter()
                    .take_while(|(at, _)| *at <= until_ms)
                    .take(limit)
                    .map(|(at, id)| (id.clone(), *at))
                    .collect()
            })
            .unwrap_or_default())
    }

    async fn hold_back(&self, shard: u32, id: &str, held: HeldBack) -> Result<(), StoreError> {
        self.state()?
            .held_back
            .insert((shard, id.to_string()), held);
        Ok(())
    }

    async fn held_back(
        &self,
        shard: u32,
        ids: &[String],
    ) -> Result<Vec<Option<HeldBack>>, StoreError> {
        let state = self.state()?;
        Ok(ids
            .iter()
            .map(|id| state.held_back.get(&(shard, id.clone())).copied())
            .collect())
    }

    async fn filed_schedules(
        &self,
        shard: u32,
        from: Option<&str>,
        count: usize,
    ) -> Result<(Vec<String>, Option<String>), StoreError> {
        // The cursor is the last id listed: ids in their order stay put while others
        // come and go.
        use std::ops::Bound::{Excluded, Unbounded};
        let state = self.state()?;
        let Some(fires) = state.due.get(&shard) else {
            return Ok((Vec::new(), None));
        };
        let after = match from {
            Some(from) => fires.by_id.range::<str, _>((Excluded(from), Unbounded)),
            None => fires.by_id.range::<str, _>(..),
        };
        let mut page: Vec<String> = after
            .take(count.max(1) + 1)
            .map(|(id, _)| id.clone())
            .collect();
        let next = if page.len() > count.max(1) {
            page.pop();
            page.last().cloned()
        } else {
            None
        };
        Ok((page, next))
    }

    async fn earliest_fire(&self, shard: u32) -> Result<Option<i64>, StoreError> {
        Ok(self
            .state()?
            .due
            .get(&shard)
            .and_then(|fires| fires.by_time.first().map(|(at, _)| *at)))
    }

    async fn claim_execution(&self, execution: &Execution) -> Result<bool, StoreError> {
        let mut state = self.state()?;
        let list = state
            .executions
            .entry(execution.schedule_id.clone())
            .or_default();
        if list
            .iter()
            .any(|e| e.scheduled_ms == execution.scheduled_ms)
        {
            return Ok(false);
        }
        let dropped = if list.len() == EXECUTIONS_KEPT {
            list.pop_front()
        } else {
            None
        };
        list.push_back(execution.clone());
        if let Some(old) = dropped {
            state.open.remove(&(old.schedule_id, old.scheduled_ms));
        }
        State::track_open(&mut state.open, execution);
        Ok(true)
    }

    async fn claim_executions(
        &self,
        executions: &[Execution],
        fence: Option<&Fence>,
    ) -> Result<Vec<bool>, StoreError> {
        check_fence(&*self.state()?, fence)?;
        let mut claimed = Vec::with_capacity(executions.len());
        for e in executions {
            claimed.push(self.claim_execution(e).await?);
        }
        Ok(claimed)
    }

    async fn record_fires(
        &self,
        shard: u32,
        executions: &[Execution],
        next_fires: &[(String, Option<i64>)],
        held_back: &[(String, Option<HeldBack>)],
        fence: &Fence,
    ) -> Result<(), StoreError> {
        check_fence(&*self.state()?, Some(fence))?;
        for e in executions {
            self.put_execution(e, Some(fence)).await?;
        }
        for (id, at) in next_fires {
            self.set_next_fire(shard, id, *at).await?;
        }
        let mut state = self.state()?;
        for (id, held) in held_back {
            let key = (shard, id.clone());
            match held {
                Some(held) => state.held_back.insert(key, *held),
                None => state.held_back.remove(&key),
            };
        }
        Ok(())
    }

    async fn put_execution(
        &self,
        execution: &Execution,
        fence: Option<&Fence>,
    ) -> Result<(), StoreError> {
        let mut state = self.state()?;
        check_fence(&state, fence)?;
        let list = state
            .executions
            .entry(execution.schedule_id.clone())
            .or_default();
        match list
            .iter_mut()
            .find(|e| e.scheduled_ms == execution.scheduled_ms)
        {
            // A master's write leaves a finished execution as it ended, and creates none:
            // it updates what it claimed, and what history has dropped since stays gone.
            Some(e) if fence.is_some() && e.status.is_finished() => return Ok(()),
            None if fence.is_some() => return Ok(()),
            Some(e) => *e = execution.clone(),
            None => list.push_back(execution.clone()),
        }
        State::track_open(&mut state.open, execution);
        Ok(())
    }

    async fn open_executions(
        &self,
        changed_by_ms: i64,
        skip: usize,
        limit: usize,
    ) -> Result<Vec<(String, i64)>, StoreError> {
        let state = self.state()?;
        let mut open: Vec<(i64, &(String, i64))> = state
            .open
            .iter()
            .filter(|(_, since)| **since <= changed_by_ms)
            .map(|(key, since)| (*since, key))
            .collect();
        open.sort();
        Ok(open
            .into_iter()
            .skip(skip)
            .take(limit)
            .map(|(_, key)| key.clone())
            .collect())
    }

    async fn get_execution(
        &self,
        schedule_id: &str,
        scheduled_ms: i64,
    ) -> Result<Option<Execution>, StoreError> {
        Ok(self
            .state()?
            .executions
            .get(schedule_id)
            .and_then(|l| l.iter().find(|e| e.scheduled_ms == scheduled_ms).cloned()))
    }

    async fn executions(
        &self,
        schedule_id: &str,
        limit: usize,
    ) -> Result<ExecutionList, StoreError> {
        let state = self.state()?;
        let mut list: Vec<Execution> = state
            .executions
            .get(schedule_id)
            .map(|l| l.iter().cloned().collect())
            .unwrap_or_default();
        list.sort_by_key(|e| std::cmp::Reverse(e.scheduled_ms));
        list.truncate(limit);
        Ok(ExecutionList {
            executions: list,
            unreadable: Vec::new(),
        })
    }

    async fn register_node(
        &self,
        node: &str,
        priority: i64,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        self.state()?
            .nodes
            .insert(node.to_string(), (priority, Instant::now() + ttl));
        Ok(())
    }

    async fn live_nodes(&self) -> Result<Vec<(String, i64)>, StoreError> {
        let now = Instant::now();
        let mut state = self.state()?;
        state.nodes.retain(|_, (_, expires)| *expires > now);
        Ok(state
            .nodes
            .iter()
            .map(|(n, (p, _))| (n.clone(), *p))
            .collect())
    }

    async fn watch_schedules(&self) -> Result<ScheduleChanges, StoreError> {
        let (tx, receiver) = tokio::sync::mpsc::channel(crate::cron::store::SCHEDULE_CHANGES_HELD);
        self.watchers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(tx);
        Ok(ScheduleChanges { receiver })
    }
}
