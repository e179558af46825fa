//! Keyed graphs' per-key state on the Redis store: per graph and partition a hash
//! `keyed:<graph>:<p>` (key → JSON cache snapshot) and a hash
//! `keyed:<graph>:<p>:positions` (source → last position applied), and
//! `keyed:<graph>:<p>:released` (`token:ms` of the last clean hand-over), and, for a
//! graph whose idle keys expire, a sorted set `keyed:<graph>:<p>:touched` (key scored by
//! its time, ms) with a hash `keyed:<graph>:<p>:fires` (`floor` and `high`, the
//! partition's fire numbers); per graph, `keyed:<graph>:paused` (`1`) while the graph is
//! paused.

use super::*;

impl RedisStore {
    fn keyed_key(&self, graph: &str, partition: i32) -> String {
        self.key(&["keyed", graph, &partition.to_string()])
    }

    fn keyed_positions_key(&self, graph: &str, partition: i32) -> String {
        self.key(&["keyed", graph, &partition.to_string(), "positions"])
    }

    fn keyed_touched_key(&self, graph: &str, partition: i32) -> String {
        self.key(&["keyed", graph, &partition.to_string(), "touched"])
    }

    fn keyed_fires_key(&self, graph: &str, partition: i32) -> String {
        self.key(&["keyed", graph, &partition.to_string(), "fires"])
    }

    fn keyed_paused_key(&self, graph: &str) -> String {
        self.key(&["keyed", graph, "paused"])
    }

    fn keyed_released_key(&self, graph: &str, partition: i32) -> String {
        self.key(&["keyed", graph, &partition.to_string(), "released"])
    }
}

#[async_trait]
impl KeyedStore for RedisStore {
    async fn load_keys(
        &self,
        graph: &str,
        partition: i32,
        keys: &[String],
    ) -> Result<Vec<Option<CacheSnapshot>>, StoreError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let hash = self.keyed_key(graph, partition);
        let mut c = self.connection.clone();
        let raw: Vec<Option<String>> = redis::cmd("HMGET")
            .arg(&hash)
            .arg(keys)
            .query_async(&mut c)
            .await
            .map_err(|e| store_error("HMGET", e))?;
        raw.into_iter()
            .zip(keys)
            .map(|(text, key)| {
                text.map(|text| {
                    serde_json::from_str(&text).map_err(|e| StoreError::Corrupt {
                        key: format!("{hash} {key}"),
                        source: e.into(),
                    })
                })
                .transpose()
            })
            .collect()
    }

    async fn load_positions(
        &self,
        graph: &str,
        partition: i32,
    ) -> Result<BTreeMap<String, i64>, StoreError> {
        let key = self.keyed_positions_key(graph, partition);
        let mut c = self.connection.clone();
        let raw: BTreeMap<String, String> = c
            .hgetall(&key)
            .await
            .map_err(|e| store_error("HGETALL", e))?;
        raw.into_iter()
            .map(|(source, text)| match text.parse::<i64>() {
                Ok(position) => Ok((source, position)),
                Err(e) => Err(StoreError::Corrupt {
                    key: format!("{key} {source}"),
                    source: e.into(),
                }),
            })
            .collect()
    }

    async fn load_released(
        &self,
        graph: &str,
        partition: i32,
    ) -> Result<Option<(u64, i64)>, StoreError> {
        let key = self.keyed_released_key(graph, partition);
        let mut c = self.connection.clone();
        let text: Option<String> = c.get(&key).await.map_err(|e| store_error("GET", e))?;
        text.map(|text| {
            text.split_once(':')
                .and_then(|(token, at)| Some((token.parse().ok()?, at.parse().ok()?)))
                .ok_or_else(|| StoreError::Corrupt {
                    key,
                    source: format!("{text:?} is not token:ms").into(),
                })
        })
        .transpose()
    }

    async fn idle_keys(
        &self,
        graph: &str,
        partition: i32,
        before_ms: i64,
        skip: usize,
        limit: usize,
    ) -> Result<Vec<String>, StoreError> {
        let mut c = self.connection.clone();
        redis::cmd("ZRANGEBYSCORE")
            .arg(self.keyed_touched_key(graph, partition))
            .arg("-inf")
            .arg(format!("({before_ms}"))
            .arg("LIMIT")
            .arg(skip)
            .arg(limit)
            .query_async(&mut c)
            .await
            .map_err(|e| store_error("ZRANGEBYSCORE", e))
    }

    async fn load_fire_numbers(
        &self,
        graph: &str,
        partition: i32,
    ) -> Result<FireNumbers, StoreError> {
        let key = self.keyed_fires_key(graph, partition);
        let mut c = self.connection.clone();
        let (floor, high): (Option<String>, Option<String>) = redis::cmd("HMGET")
            .arg(&key)
            .arg("floor")
            .arg("high")
            .query_async(&mut c)
            .await
            .map_err(|e| store_error("HMGET", e))?;
        let number = |field: &str, text: Option<String>| {
            text.map_or(Ok(0), |text| {
                text.parse()
                    .map_err(|e: std::num::ParseIntError| StoreError::Corrupt {
                        key: format!("{key} {field}"),
                        source: e.into(),
                    })
            })
        };
        Ok(FireNumbers {
            floor: number("floor", floor)?,
            high: number("high", high)?,
        })
    }

    async fn load_paused(&self, graph: &str) -> Result<bool, StoreError> {
        let mut c = self.connection.clone();
        let paused: bool = c
            .exists(self.keyed_paused_key(graph))
            .await
            .map_err(|e| store_error("EXISTS", e))?;
        Ok(paused)
    }

    async fn save_paused(&self, graph: &str, paused: bool) -> Result<(), StoreError> {
        let key = self.keyed_paused_key(graph);
        let mut c = self.connection.clone();
        if paused {
            c.set::<_, _, ()>(&key, 1)
                .await
                .map_err(|e| store_error("SET", e))
        } else {
            c.del::<_, ()>(&key)
                .await
                .map_err(|e| store_error("DEL", e))
        }
    }

    async fn save_keys(
        &self,
        graph: &str,
        partition: i32,
        changes: &mut KeyedChanges,
        fence: &Fence,
    ) -> Result<(), StoreError> {
        let hash = self.keyed_key(graph, partition);
        let mut writes = Vec::with_capacity(
            changes.keys.len() + changes.touched.len() + 2 * changes.expired.len() + 1,
        );
        for (key, _, snapshot) in &changes.keys {
            writes.push(Write::Hset(
                hash.clone(),
                key.to_string(),
                Self::encode(snapshot)?,
            ));
        }
        if changes.drop_times {
            writes.push(Write::Del(self.keyed_touched_key(graph, partition)));
        }
        for (field, number) in [("high", changes.fire_high), ("floor", changes.fire_floor)] {
            if let Some(number) = number {
                writes.push(Write::Hset(
                    self.keyed_fires_key(graph, partition),
                    field.to_string(),
                    number.to_string(),
                ));
            }
        }
        if !changes.touched.is_empty() || !changes.expired.is_empty() {
            let touched = self.keyed_touched_key(graph, partition);
            for (key, at_ms) in &changes.touched {
                writes.push(Write::Zmax(touched.clone(), *at_ms, key.to_string()));
            }
            for key in &changes.expired {
                writes.push(Write::Hdel(hash.clone(), key.to_string()));
                writes.push(Write::Zrem(touched.clone(), key.to_string()));
            }
        }
        // Only the partition's owner writes them, under its fence and in order, so
        // they only move forward.
        let positions = self.keyed_positions_key(graph, partition);
        for (source, position) in &changes.positions {
            writes.push(Write::Hset(
                positions.clone(),
                source.clone(),
                position.to_string(),
            ));
        }
        if let Some((token, at)) = changes.released {
            writes.push(Write::Set(
                self.keyed_released_key(graph, partition),
                format!("{token}:{at}"),
            ));
        }
        self.apply_writes("save keyed partition", writes, Some(fence))
            .await
    }
}
