//! The admin API and the metrics endpoint, over HTTP (axum), and the client `weir graph`
//! talks to it with.
//!
//! [`serve`] starts the listeners a [`Listen`] names. The metrics listener serves only
//! `GET /metrics`; the admin listener serves every route:
//!
//! | route | auth | what |
//! | --- | --- | --- |
//! | `GET /healthz` | open | 200 `ok` while the process runs |
//! | `GET /readyz` | open | 200 when the store and broker answer and every graph is Live, else 503 naming why ([`health`]) |
//! | `GET /metrics` | open | Prometheus text format |
//! | `GET /graphs`, `GET /graphs/{name}`, `POST /graphs/{name}/fire`, `/fire-with`, `/pause`, `/resume` | token | [`graphs`] |
//! | `GET /ws` | token | the graph commands over a WebSocket ([`ws`]) |
//! | `GET /schedules`, `GET /schedules/{id}`, `POST /schedules/{id}/pause`, `/resume` | token | [`schedules`] |
//! | `GET /recovery-events?graph=&limit=` | token | [`recovery`] |
//! | `GET /jobs/{type}/{id}` | token | one job's state and owner ([`jobs`]) |
//! | `GET /graphs/{name}/keys/{key}` | token | one key of a keyed graph: state and owner ([`keys`]) |
//! | `GET /graphs/{name}/partitions` | token | a keyed graph's partitions and the node owning each ([`keys`]) |
//!
//! With a token configured, "token" routes need `Authorization: Bearer <token>` (see `auth`).
//! A tenant's token (`[[admin.tokens]]`) admits its holder to that tenant's graphs,
//! schedules, executions and recovery events only; the rest answer 404, as if absent.
//! Within the tenant, names may leave the tenant out (`report` for `acme/report`).
//! `/metrics` stays open on both listeners: scrapers rarely carry credentials, and it
//! shows counts, never data, and controls nothing.
//!
//! Safe by default, against the network and against web pages in an operator's browser:
//! - the admin listener refuses to start on a non-loopback address without a token,
//!   unless told `allow_unauthenticated`;
//! - a request that changes state (`POST`) must say `Content-Type: application/json`,
//!   which no HTML form can send to another site without the browser asking first;
//! - a WebSocket upgrade from a browser must come from the listener's own origin or one
//!   of `allowed_origins` (browsers send `Origin`; other clients need not);
//! - without tokens, protected routes answer only requests addressed to loopback (or a
//!   listed origin's host), which a DNS-rebinding page cannot send;
//! - the listener can serve TLS ([`tls`]).
//!
//! Every error is JSON `{"error": "...", "retryable": bool}` ([`error`]).
//!
//! [`AdminState`] holds what this process has: a supervisor (graphs), a store
//! (schedules, recovery events), a broker (readiness). A process with none of them still
//! serves health and metrics. A new concern's routes go in their own file, merged in
//! [`router`]; its handlers read the state through the accessors.

mod auth;
pub mod client;
pub mod error;
pub mod graphs;
pub mod health;
pub mod jobs;
pub mod keys;
pub mod recovery;
pub mod schedules;
pub mod tls;
pub mod workflows;
pub mod ws;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::metrics::MetricsError;
use crate::store::Store;
use crate::supervisor::{Runtime, Supervisor};
use crate::transport::Broker;

pub use auth::Scope;
pub use error::ApiError;

/// How often histograms are rotated when nobody scrapes.
const UPKEEP_PERIOD: Duration = Duration::from_secs(5);
/// Longest [`Servers::stopped`] lets requests in progress finish.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Where the HTTP listeners run; `None` runs none.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Listen {
    /// `GET /metrics` only.
    pub metrics: Option<SocketAddr>,
    /// Every admin route, `/metrics` included.
    pub admin: Option<SocketAddr>,
    /// Serve the admin listener over TLS with this certificate chain and key (PEM).
    pub admin_tls: Option<TlsFiles>,
    /// Serve the admin API on a non-loopback address without any token.
    pub allow_unauthenticated: bool,
}

/// A PEM certificate chain and its private key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    pub cert: std::path::PathBuf,
    pub key: std::path::PathBuf,
}

/// What the admin routes can reach in this process.
#[derive(Clone)]
pub struct AdminState {
    supervisor: Option<Arc<Supervisor>>,
    store: Option<Arc<dyn Store>>,
    broker: Option<Arc<dyn Broker>>,
    token: Option<Arc<str>>,
    /// Tokens scoped to one tenant: (token, tenant).
    tenant_tokens: Arc<[(String, Arc<str>)]>,
    /// Origins besides the listener's own allowed to open the WebSocket.
    allowed_origins: Arc<[String]>,
    /// Without tokens, answer requests addressed to any host, not only loopback
    /// (`allow_unauthenticated`).
    any_host: bool,
    cron_shards: u32,
    metrics: Option<PrometheusHandle>,
    shutdown: CancellationToken,
    /// Background tasks the process needs: readiness fails once one has stopped.
    tasks: Vec<health::Watched>,
    /// Keyed graphs this process runs, by key (`tenant/name`), with their partitions.
    keyed_graphs: Arc<std::collections::BTreeMap<String, u32>>,
}

impl Default for AdminState {
    fn default() -> Self {
        Self {
            supervisor: None,
            store: None,
            broker: None,
            token: None,
            tenant_tokens: Arc::from(Vec::new()),
            allowed_origins: Arc::from(Vec::new()),
            any_host: false,
            cron_shards: crate::cron::scheduler::SchedulerConfig::new("").shards,
            metrics: None,
            shutdown: CancellationToken::new(),
            tasks: Vec::new(),
            keyed_graphs: Default::default(),
        }
    }
}

impl AdminState {
    /// Health and metrics only; add what the process has with the `with_` methods.
    pub fn new() -> Self {
        Self::default()
    }

    pub fn with_supervisor(mut self, supervisor: Arc<Supervisor>) -> Self {
        self.supervisor = Some(supervisor);
        self
    }

    /// The runtime's store and broker.
    pub fn with_runtime(self, runtime: &Runtime) -> Self {
        self.with_store(runtime.store.clone())
            .with_broker(runtime.broker.clone())
    }

    pub fn with_store(mut self, store: Arc<dyn Store>) -> Self {
        self.store = Some(store);
        self
    }

    pub fn with_broker(mut self, broker: Arc<dyn Broker>) -> Self {
        self.broker = Some(broker);
        self
    }

    /// The bearer token protected routes require; `None` leaves them open.
    pub fn with_token(mut self, token: Option<String>) -> Self {
        self.token = token.map(Arc::from);
        self
    }

    /// Tokens that admit a caller to one tenant's graphs, schedules and executions only:
    /// (token, tenant) pairs.
    pub fn with_tenant_tokens(mut self, tokens: Vec<(String, String)>) -> Self {
        self.tenant_tokens = tokens
            .into_iter()
            .map(|(token, tenant)| (token, Arc::from(tenant)))
            .collect();
        self
    }

    /// Web origins (`https://ops.example.com`) whose pages may open the WebSocket, besides
    /// the admin listener's own.
    pub fn with_allowed_origins(mut self, origins: Vec<String>) -> Self {
        self.allowed_origins = Arc::from(origins);
        self
    }

    /// A background task readiness depends on (see [`health::Watched::watch`]).
    pub fn with_task(mut self, task: health::Watched) -> Self {
        self.tasks.push(task);
        self
    }

    /// Keyed graphs this process runs (`tenant/name` → partitions), for their keys' routes.
    pub fn with_keyed_graphs(mut self, graphs: std::collections::BTreeMap<String, u32>) -> Self {
        self.keyed_graphs = Arc::new(graphs);
        self
    }

    /// The keyed graphs this process runs, with their partitions.
    pub fn keyed_graphs(&self) -> impl Iterator<Item = (&str, u32)> {
        self.keyed_graphs
            .iter()
            .map(|(name, p)| (name.as_str(), *p))
    }

    /// The partitions of a keyed graph this process runs.
    pub fn keyed_graph(&self, graph: &str) -> Option<u32> {
        self.keyed_graphs.get(graph).copied()
    }

    /// Shards of the cron scheduler, so resuming a schedule files it in the right one.
    pub fn with_cron_shards(mut self, shards: u32) -> Self {
        self.cron_shards = shards;
        self
    }

    pub fn supervisor(&self) -> Option<&Arc<Supervisor>> {
        self.supervisor.as_ref()
    }

    pub fn store(&self) -> Option<&Arc<dyn Store>> {
        self.store.as_ref()
    }

    /// The store, or the error a route that needs one answers with.
    pub fn require_store(&self) -> Result<&Arc<dyn Store>, ApiError> {
        self.store.as_ref().ok_or(ApiError::NotServed("store"))
    }

    pub fn broker(&self) -> Option<&Arc<dyn Broker>> {
        self.broker.as_ref()
    }

    pub fn cron_shards(&self) -> u32 {
        self.cron_shards
    }

    /// Cancelled when the listeners stop; long-lived handlers (WebSockets) end on it.
    pub fn shutdown(&self) -> &CancellationToken {
        &self.shutdown
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error(
        "refusing to serve the admin API on {addr} without a token: anyone who can reach \
         it could pause graphs and inject values. Set [admin] token (or WEIR__ADMIN__TOKEN), \
         listen on 127.0.0.1, or set [admin] allow_unauthenticated = true"
    )]
    Unprotected { addr: SocketAddr },
    #[error("admin TLS: {0}")]
    Tls(#[from] tls::TlsError),
    #[error(transparent)]
    Metrics(#[from] MetricsError),
    #[error("admin URL {url:?}: {reason}")]
    Url { url: String, reason: String },
    #[error("cannot reach the admin API at {url}: {reason}")]
    Connect { url: String, reason: String },
    /// The admin API answered with an error status; `message` is its error text.
    #[error("admin API answered {status}: {message}")]
    Status { status: u16, message: String },
    #[error("admin API answer is not JSON: {0}")]
    Response(String),
}

impl AdminError {
    /// A busy port may free up, an unreachable server come back, a 503 clear; a wrong
    /// URL or a refused request stays so.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Bind { source, .. } => source.kind() == std::io::ErrorKind::AddrInUse,
            Self::Connect { .. } => true,
            Self::Status { status, .. } => *status == 503,
            Self::Metrics(_)
            | Self::Url { .. }
            | Self::Response(_)
            | Self::Unprotected { .. }
            | Self::Tls(_) => false,
        }
    }
}

/// The running listeners.
pub struct Servers {
    /// The admin listener's bound address (useful with port 0).
    pub admin: Option<SocketAddr>,
    pub metrics: Option<SocketAddr>,
    tasks: Vec<JoinHandle<()>>,
}

impl Servers {
    /// Waits for the listeners to stop once the token given to [`serve`] is cancelled;
    /// requests still running after a grace period are dropped.
    pub async fn stopped(self) {
        let aborts: Vec<_> = self.tasks.iter().map(|t| t.abort_handle()).collect();
        let all = futures::future::join_all(self.tasks);
        if tokio::time::timeout(SHUTDOWN_GRACE, all).await.is_err() {
            warn!("admin requests still running at shutdown; dropping them");
            aborts.iter().for_each(|a| a.abort());
        }
    }
}

/// Every route, on `state`.
pub fn router(state: AdminState) -> Router {
    let protected = Router::new()
        .merge(graphs::routes())
        .merge(ws::routes())
        .merge(schedules::routes())
        .merge(recovery::routes())
        .merge(workflows::routes())
        .merge(jobs::routes())
        .merge(keys::routes())
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            auth::require_token,
        ))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            auth::same_site_only,
        ));
    Router::new()
        .merge(health::routes())
        .merge(protected)
        .fallback(|| async { ApiError::NoRoute })
        .layer(axum::middleware::map_response(error::json_errors))
        .with_state(state)
}

/// Starts the listeners `listen` names, serving `state` until `cancel` fires.
///
/// Installs the process's Prometheus recorder (once). Metric handles bind to the
/// recorder present when they are created, so call this before spawning graphs. Both
/// addresses are bound before anything is served: a bind error starts nothing.
pub async fn serve(
    mut state: AdminState,
    listen: &Listen,
    cancel: CancellationToken,
) -> Result<Servers, AdminError> {
    let mut servers = Servers {
        admin: None,
        metrics: None,
        tasks: Vec::new(),
    };
    if listen.admin.is_none() && listen.metrics.is_none() {
        return Ok(servers);
    }
    if let Some(addr) = listen.admin {
        let unprotected = state.token.is_none() && state.tenant_tokens.is_empty();
        if !addr.ip().is_loopback() && unprotected && !listen.allow_unauthenticated {
            return Err(AdminError::Unprotected { addr });
        }
    }
    let tls = match &listen.admin_tls {
        Some(files) => Some(tls::server_config(&files.cert, &files.key)?),
        None => None,
    };
    state.any_host = listen.allow_unauthenticated;
    let handle = crate::metrics::prometheus()?;
    state.metrics = Some(handle.clone());
    state.shutdown = cancel.clone();
    let admin = bind(listen.admin).await?;
    let metrics = bind(listen.metrics).await?;
    if let Some(listener) = admin {
        servers.admin = listener.local_addr().ok();
        info!(addr = ?servers.admin, tls = tls.is_some(), "admin API listening");
        let app = router(state.clone());
        let task = match tls {
            Some(config) => tokio::spawn(run(
                tls::TlsListener::new(listener, config),
                app,
                cancel.clone(),
            )),
            None => tokio::spawn(run(listener, app, cancel.clone())),
        };
        servers.tasks.push(task);
    }
    if let Some(listener) = metrics {
        servers.metrics = listener.local_addr().ok();
        info!(addr = ?servers.metrics, "metrics listening");
        let app = health::metrics_routes().with_state(state);
        servers
            .tasks
            .push(tokio::spawn(run(listener, app, cancel.clone())));
    }
    servers.tasks.push(tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(UPKEEP_PERIOD) => handle.run_upkeep(),
            }
        }
    }));
    Ok(servers)
}

async fn bind(addr: Option<SocketAddr>) -> Result<Option<TcpListener>, AdminError> {
    let Some(addr) = addr else { return Ok(None) };
    TcpListener::bind(addr)
        .await
        .map(Some)
        .map_err(|source| AdminError::Bind { addr, source })
}

async fn run<L>(listener: L, app: Router, cancel: CancellationToken)
where
    L: axum::serve::Listener<Addr = SocketAddr>,
{
    let addr = listener.local_addr().ok();
    if let Err(e) = axum::serve(listener, app)
        .with_graceful_shutdown(cancel.cancelled_owned())
        .await
    {
        warn!(?addr, error = %e, "HTTP listener stopped");
    }
}
