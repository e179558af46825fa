//! Group membership on the Redis store: `members:<group>`, a sorted set of members
//! scored by when their announcement expires (ms, the announcing node's clock).

use super::*;

#[async_trait]
impl MembershipStore for RedisStore {
    async fn join_group(&self, group: &str, member: &str, ttl: Duration) -> Result<(), StoreError> {
        let expires = crate::transport::now_ms() + ttl.as_millis() as i64;
        let mut c = self.connection.clone();
        c.zadd::<_, _, _, ()>(self.key(&["members", group]), member, expires)
            .await
            .map_err(|e| store_error("ZADD", e))
    }

    async fn leave_group(&self, group: &str, member: &str) -> Result<(), StoreError> {
        let mut c = self.connection.clone();
        c.zrem::<_, _, ()>(self.key(&["members", group]), member)
            .await
            .map_err(|e| store_error("ZREM", e))
    }

    async fn group_members(&self, group: &str) -> Result<Vec<String>, StoreError> {
        let key = self.key(&["members", group]);
        let now = crate::transport::now_ms();
        let mut c = self.connection.clone();
        let (mut members,): (Vec<String>,) = redis::pipe()
            .zrembyscore(&key, "-inf", now)
            .ignore()
            .cmd("ZRANGE")
            .arg(&key)
            .arg(0)
            .arg(-1)
            .query_async(&mut c)
            .await
            .map_err(|e| store_error("group members", e))?;
        members.sort();
        Ok(members)
    }
}
