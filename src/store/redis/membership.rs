//! Group membership on the Redis store: `members:<group>`, a sorted set of members
//! scored by when their announcement expires, in ms of the Redis server's clock, so
//! nodes whose clocks disagree still agree on who is live; and `partitions:<group>`,
//! the partition count the group first ran with.

use super::*;

/// KEYS: the group's set. ARGV: the member, its TTL in ms.
static JOIN: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
return 1
"#,
    )
});

/// KEYS: the group's set. Drops expired members, returns the others.
static LIVE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return redis.call('ZRANGE', KEYS[1], 0, -1)
"#,
    )
});

#[async_trait]
impl MembershipStore for RedisStore {
    async fn join_group(&self, group: &str, member: &str, ttl: Duration) -> Result<(), StoreError> {
        let mut c = self.connection.clone();
        JOIN.key(self.key(&["members", group]))
            .arg(member)
            .arg(ttl.as_millis().max(1) as u64)
            .invoke_async::<i64>(&mut c)
            .await
            .map(|_| ())
            .map_err(|e| store_error("join group", e))
    }

    async fn leave_group(&self, group: &str, member: &str) -> Result<(), StoreError> {
        let mut c = self.connection.clone();
        c.zrem::<_, _, ()>(self.key(&["members", group]), member)
            .await
            .map_err(|e| store_error("ZREM", e))
    }

    async fn group_members(&self, group: &str) -> Result<Vec<String>, StoreError> {
        let mut c = self.connection.clone();
        let mut members: Vec<String> = LIVE
            .key(self.key(&["members", group]))
            .invoke_async(&mut c)
            .await
            .map_err(|e| store_error("group members", e))?;
        members.sort();
        Ok(members)
    }

    async fn settle_partition_count(
        &self,
        group: &str,
        partitions: u32,
    ) -> Result<u32, StoreError> {
        let key = self.key(&["partitions", group]);
        let mut c = self.connection.clone();
        let (recorded,): (Option<String>,) = redis::pipe()
            .set_nx(&key, partitions)
            .ignore()
            .get(&key)
            .query_async(&mut c)
            .await
            .map_err(|e| store_error("settle partition count", e))?;
        let recorded = recorded.unwrap_or_default();
        recorded.parse().map_err(|_| StoreError::Corrupt {
            key,
            source: format!("{recorded:?} is not a partition count").into(),
        })
    }
}
