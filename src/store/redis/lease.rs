//! Leases and their fencing tokens on the Redis store.

use super::*;

static ACQUIRE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
local current = redis.call('GET', KEYS[1])
if current then
  -- The token follows the last '|': a node id may hold one too.
  local holder, token = string.match(current, '^(.*)|(%d+)$')
  if holder == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return tonumber(token)
  end
  return false
end
local token = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1] .. '|' .. token, 'PX', ARGV[2])
return token
"#,
    )
});

static RENEW: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"#,
    )
});

static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"#,
    )
});

impl RedisStore {
    fn lease_value(lease: &Lease) -> String {
        format!("{}|{}", lease.holder, lease.token)
    }
}

#[async_trait]
impl LeaseStore for RedisStore {
    async fn acquire_lease(
        &self,
        name: &str,
        holder: &str,
        ttl: Duration,
    ) -> Result<Option<Lease>, StoreError> {
        let mut c = self.connection.clone();
        let token: Option<u64> = ACQUIRE
            .key(self.key(&["lease", name]))
            .key(self.key(&["fence", name]))
            .arg(holder)
            .arg(ttl.as_millis().max(1) as u64)
            .invoke_async(&mut c)
            .await
            .map_err(|e| store_error("acquire lease", e))?;
        Ok(token.map(|token| Lease {
            name: name.to_string(),
            holder: holder.to_string(),
            token,
        }))
    }

    async fn renew_lease(&self, lease: &Lease, ttl: Duration) -> Result<bool, StoreError> {
        let mut c = self.connection.clone();
        let renewed: i64 = RENEW
            .key(self.key(&["lease", &lease.name]))
            .arg(Self::lease_value(lease))
            .arg(ttl.as_millis().max(1) as u64)
            .invoke_async(&mut c)
            .await
            .map_err(|e| store_error("renew lease", e))?;
        Ok(renewed == 1)
    }

    async fn current_lease(&self, name: &str) -> Result<Option<Lease>, StoreError> {
        let mut c = self.connection.clone();
        let key = self.key(&["lease", name]);
        let value: Option<String> = c.get(&key).await.map_err(|e| store_error("GET", e))?;
        let Some(value) = value else {
            return Ok(None);
        };
        let parsed = value
            .rsplit_once('|')
            .and_then(|(holder, token)| Some((holder, token.parse::<u64>().ok()?)));
        match parsed {
            Some((holder, token)) => Ok(Some(Lease {
                name: name.to_string(),
                holder: holder.to_string(),
                token,
            })),
            None => Err(StoreError::Corrupt {
                key,
                source: format!("lease value {value:?} is not holder|token").into(),
            }),
        }
    }

    async fn release_lease(&self, lease: &Lease) -> Result<bool, StoreError> {
        let mut c = self.connection.clone();
        let released: i64 = RELEASE
            .key(self.key(&["lease", &lease.name]))
            .arg(Self::lease_value(lease))
            .invoke_async(&mut c)
            .await
            .map_err(|e| store_error("release lease", e))?;
        Ok(released == 1)
    }
}
