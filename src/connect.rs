//! Connecting what a config names: the broker, the store, the runtime graphs run on,
//! and the workflow state manager. Apart from [`crate::config`], which stays plain data
//! with its validation and conversions, and below the command line, because tests and
//! benchmarks connect the same way `weir run` does.

use std::sync::Arc;
use std::time::Duration;

use crate::config::{BrokerKind, Config, ConfigError, StoreKind};
use crate::store::Store;
use crate::supervisor::Runtime;
use crate::transport::Broker;

impl Config {
    /// The workflow state manager over the runtime's store and broker.
    pub fn state_manager(
        &self,
        runtime: &Runtime,
    ) -> Result<crate::dispatch::StateManager, ConfigError> {
        Ok(crate::dispatch::StateManager::new(
            runtime.store.clone(),
            runtime.broker.sink(),
            self.workflows()?,
            self.router()?,
            crate::dispatch::DispatchSettings {
                results_topic: self.dispatch.results_topic.clone(),
            },
        ))
    }

    /// The admin API's state over a runtime, as every command serving it starts: its
    /// tokens and origins, and the cron shards schedules are filed in.
    pub fn admin_state(&self, runtime: &Runtime) -> crate::admin::AdminState {
        crate::admin::AdminState::new()
            .with_runtime(runtime)
            .with_token(self.admin.token.as_ref().map(|t| t.expose().to_string()))
            .with_tenant_tokens(self.admin.tenant_tokens())
            .with_allowed_origins(self.admin.allowed_origins.clone())
            .with_cron_shards(self.cron.shards)
    }

    /// Connects to the configured broker and store.
    pub async fn runtime(&self) -> Result<Runtime, ConfigError> {
        let broker = self.connect_broker().await?;
        let store = self.store().await?;
        Ok(Runtime {
            broker,
            store,
            node_id: self.node_id(),
        })
    }

    /// Connects to the configured broker only (for commands that need no store).
    pub async fn connect_broker(&self) -> Result<Arc<dyn Broker>, ConfigError> {
        Ok(match self.broker.kind {
            BrokerKind::Memory => Arc::new(crate::transport::memory::MemoryBroker::new(
                self.broker.partitions as usize,
            )),
            BrokerKind::Kafka => {
                let broker = crate::transport::kafka::KafkaBroker::connect(
                    crate::transport::kafka::KafkaSettings {
                        brokers: self.broker.brokers.clone(),
                        partitions: self.broker.partitions,
                        replication: self.broker.replication,
                        options: self.broker.options.clone(),
                        retention: self.broker.retention(),
                    },
                )
                .map_err(ConfigError::Broker)?;
                broker.ping().await.map_err(ConfigError::Broker)?;
                Arc::new(broker)
            }
            BrokerKind::Nats => Arc::new(
                crate::transport::nats::NatsBroker::connect(crate::transport::nats::NatsSettings {
                    url: self.broker.url.clone(),
                    jetstream: self.broker.jetstream,
                    ack_wait: Duration::from_millis(self.broker.ack_wait_ms),
                    retention: self.broker.retention(),
                    auth: crate::transport::nats::NatsAuth {
                        user: self.broker.user.clone(),
                        password: self.broker.password.clone(),
                        token: self.broker.token.clone(),
                        nkey_seed_file: self.broker.nkey_seed_file.clone(),
                        credentials_file: self.broker.credentials_file.clone(),
                        tls_ca_file: self.broker.tls_ca_file.clone(),
                        tls_cert_file: self.broker.tls_cert_file.clone(),
                        tls_key_file: self.broker.tls_key_file.clone(),
                        tls_required: self.broker.tls_required,
                    },
                })
                .await
                .map_err(ConfigError::Broker)?,
            ),
        })
    }

    /// Connects to the configured store only (for commands that need no broker).
    pub async fn store(&self) -> Result<Arc<dyn Store>, ConfigError> {
        Ok(match self.store.kind {
            StoreKind::Memory => Arc::new(crate::store::memory::MemoryStore::new()),
            StoreKind::Redis => Arc::new(
                crate::store::redis::RedisStore::connect_with(
                    &crate::store::redis::RedisSettings {
                        url: self.store.url.clone(),
                        username: self.store.username.clone(),
                        password: self.store.password.clone(),
                        tls_ca_file: self.store.tls_ca_file.clone(),
                        tls_cert_file: self.store.tls_cert_file.clone(),
                        tls_key_file: self.store.tls_key_file.clone(),
                    },
                    &self.store.prefix,
                )
                .await
                .map_err(ConfigError::Store)?,
            ),
        })
    }
}
