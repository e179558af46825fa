//! The admin API and `/metrics`: counters scraped while a pipeline runs, every route
//! with and without the token, the WebSocket commands, `weir graph`; and, on real
//! services, readiness following Redis, `weir tail` and `weir produce`.

mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::eventually;
use futures::{SinkExt, StreamExt};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;
use tokio_util::sync::CancellationToken;
use weir::admin::{AdminState, Listen};
use weir::graph::FunctionRegistry;
use weir::store::memory::MemoryStore;
use weir::store::prelude::*;
use weir::store::{RecoveryAction, RecoveryEvent};
use weir::transport::memory::MemoryBroker;
use weir::{
    AccumulatorSpec, Criteria, GraphBuilder, GraphHandle, ReactorConfig, ReactorState, Runtime,
    Strategy, SupervisionPolicy, Supervisor,
};

const TOKEN: &str = "s3cret";

/// A supervisor on the embedded backends with both listeners on free ports.
struct Admin {
    supervisor: Arc<Supervisor>,
    store: Arc<MemoryStore>,
    admin: SocketAddr,
    metrics: SocketAddr,
    cancel: CancellationToken,
}

impl Admin {
    async fn start(token: Option<&str>) -> Self {
        Self::start_with(
            token,
            SupervisionPolicy {
                graph_lease_ttl: Some(Duration::from_secs(10)),
                ..SupervisionPolicy::default()
            },
        )
        .await
    }

    async fn start_with(token: Option<&str>, policy: SupervisionPolicy) -> Self {
        let broker = MemoryBroker::default();
        let store = Arc::new(MemoryStore::new());
        let runtime = Runtime {
            broker: Arc::new(broker),
            store: store.clone(),
            node_id: "admin-test".into(),
        };
        let cancel = CancellationToken::new();
        let supervisor = Arc::new(Supervisor::new(runtime.clone(), policy, cancel.clone()));
        let state = AdminState::new()
            .with_supervisor(supervisor.clone())
            .with_runtime(&runtime)
            .with_token(token.map(String::from));
        let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let listen = Listen {
            metrics: Some(any),
            admin: Some(any),
            ..Default::default()
        };
        let servers = weir::admin::serve(state, &listen, cancel.clone())
            .await
            .unwrap();
        Self {
            supervisor,
            store,
            admin: servers.admin.unwrap(),
            metrics: servers.metrics.unwrap(),
            cancel,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.admin)
    }

    /// A sequential, when_any graph of one push-only source `a`: one fire per event.
    async fn graph(&self, name: &str) -> GraphHandle {
        let decl = GraphBuilder::new(name)
            .reactor(ReactorConfig {
                criteria: Criteria::WhenAny,
                strategy: Strategy::Sequential,
                ..ReactorConfig::default()
            })
            .accumulator(AccumulatorSpec::passthrough("a"))
            .function("snapshot", &FunctionRegistry::default(), "snapshot")
            .output("snapshot", format!("{name}.out"))
            .build()
            .unwrap();
        let handle = self.supervisor.spawn(decl).unwrap();
        handle.wait_for_state(ReactorState::Live).await;
        handle
    }
}

impl Drop for Admin {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// One HTTP exchange: status and body text.
/// State-changing requests say they are JSON, as every client of the API does.
async fn http(method: &str, url: &str, token: Option<&str>, body: Option<&str>) -> (u16, String) {
    let content_type = (method != "GET").then_some("application/json");
    http_as(method, url, token, body, content_type).await
}

async fn http_as(
    method: &str,
    url: &str,
    token: Option<&str>,
    body: Option<&str>,
    content_type: Option<&str>,
) -> (u16, String) {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let mut request = hyper::Request::builder().method(method).uri(url);
    if let Some(content_type) = content_type {
        request = request.header("content-type", content_type);
    }
    if let Some(token) = token {
        request = request.header("authorization", format!("Bearer {token}"));
    }
    let request = request
        .body(Full::new(Bytes::from(body.unwrap_or_default().to_string())))
        .unwrap();
    let response = client.request(request).await.unwrap();
    let status = response.status().as_u16();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&bytes).into_owned())
}

async fn json_of(method: &str, url: &str, token: Option<&str>, body: Option<&str>) -> (u16, Value) {
    let (status, text) = http(method, url, token, body).await;
    let value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{url}: {e}: {text}"));
    (status, value)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A Prometheus text-format sample: name, labels, value.
type Sample = (String, BTreeMap<String, String>, f64);

fn parse_samples(text: &str) -> Vec<Sample> {
    let mut samples = Vec::new();
    for line in text.lines() {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (series, value) = line.rsplit_once(' ').expect("sample has a value");
        let value: f64 = value.parse().expect("numeric value");
        let (name, labels) = match series.split_once('{') {
            Some((name, rest)) => {
                let body = rest.strip_suffix('}').expect("closing brace");
                let mut labels = BTreeMap::new();
                // Label values here are graph, source and state names: no quotes or commas.
                for pair in body.split(',').filter(|p| !p.is_empty()) {
                    let (k, v) = pair.split_once('=').expect("label=value");
                    labels.insert(k.to_string(), v.trim_matches('"').to_string());
                }
                (name.to_string(), labels)
            }
            None => (series.to_string(), BTreeMap::new()),
        };
        samples.push((name, labels, value));
    }
    samples
}

/// The value of the one series of `name` whose labels include `labels`.
fn metric(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let matching: Vec<f64> = samples
        .iter()
        .filter(|(n, l, _)| {
            n == name
                && labels
                    .iter()
                    .all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|(_, _, v)| *v)
        .collect();
    assert!(
        matching.len() <= 1,
        "{name} {labels:?} matches several series"
    );
    matching.first().copied()
}

async fn scrape(addr: SocketAddr) -> Vec<Sample> {
    let (status, text) = http("GET", &format!("http://{addr}/metrics"), None, None).await;
    assert_eq!(status, 200);
    parse_samples(&text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_listener_serves_metrics_only() {
    let admin = Admin::start(None).await;
    let _graph = admin.graph("scraped").await;
    let base = format!("http://{}", admin.metrics);
    let (status, _) = http("GET", &format!("{base}/metrics"), None, None).await;
    assert_eq!(status, 200);
    for (method, path) in [
        ("GET", "/graphs"),
        ("GET", "/graphs/scraped"),
        ("POST", "/graphs/scraped/pause"),
        ("GET", "/readyz"),
    ] {
        let (status, body) = http(method, &format!("{base}{path}"), None, None).await;
        assert_eq!(status, 404, "{method} {path}: {body}");
    }
    let (_, state) = http("GET", &admin.url("/graphs/scraped"), None, None).await;
    let state: Value = serde_json::from_str(&state).unwrap();
    assert_eq!(state["paused"], false, "{state}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_what_the_pipeline_did() {
    const N: u64 = 500;
    let admin = Admin::start(None).await;
    let graph = admin.graph("metered").await;
    for i in 0..N {
        graph.push("a", json!(i)).await.unwrap();
    }
    eventually("every event published", || async {
        graph.stats().outputs == N
    })
    .await;

    let g = ("graph", "metered");
    let samples = scrape(admin.metrics).await;
    for name in [
        weir::metrics::EVENTS_TOTAL,
        weir::metrics::BOUNDARIES_TOTAL,
        weir::metrics::OUTPUTS_TOTAL,
    ] {
        assert_eq!(metric(&samples, name, &[g]), Some(N as f64), "{name}");
    }
    let fires = |samples: &[Sample], reason| {
        metric(
            samples,
            weir::metrics::FIRES_TOTAL,
            &[g, ("reason", reason)],
        )
    };
    assert_eq!(fires(&samples, "criteria"), Some(N as f64));
    assert_eq!(fires(&samples, "force"), Some(0.0));
    let state = |state| {
        metric(
            &samples,
            weir::metrics::REACTOR_STATE,
            &[g, ("state", state)],
        )
    };
    assert_eq!(state("live"), Some(1.0));
    assert_eq!(state("warming"), Some(0.0));
    assert_eq!(state("starting"), Some(0.0));
    let health = |health| {
        metric(
            &samples,
            weir::metrics::ACCUMULATOR_HEALTH,
            &[g, ("source", "a"), ("health", health)],
        )
    };
    assert_eq!(health("socket_only"), Some(1.0));
    assert_eq!(health("starting"), Some(0.0));
    assert_eq!(
        metric(&samples, weir::metrics::QUEUE_DEPTH, &[g, ("source", "a")]),
        Some(0.0)
    );
    let role = ("role", "graph");
    assert!(metric(&samples, weir::metrics::LEASE_HELD, &[role]).unwrap() >= 1.0);
    assert!(metric(&samples, weir::metrics::LEASE_ACQUISITIONS_TOTAL, &[role]).unwrap() >= 1.0);

    // Commands count under their own reason; the admin listener serves /metrics too.
    let (status, _) = http("POST", &admin.url("/graphs/metered/fire"), None, None).await;
    assert_eq!(status, 200);
    let body = r#"{"a": 42}"#;
    let (status, _) = http(
        "POST",
        &admin.url("/graphs/metered/fire-with"),
        None,
        Some(body),
    )
    .await;
    assert_eq!(status, 200);
    let samples = scrape(admin.admin).await;
    assert_eq!(fires(&samples, "force"), Some(1.0));
    assert_eq!(fires(&samples, "fire_with"), Some(1.0));
    assert_eq!(fires(&samples, "criteria"), Some(N as f64));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_route_answers_and_protected_ones_need_the_token() {
    let admin = Admin::start(Some(TOKEN)).await;
    let graph = admin.graph("routed").await;
    graph.push("a", json!({"px": 1})).await.unwrap();
    eventually("the event fired", || async { graph.stats().outputs == 1 }).await;
    let store: &dyn Store = admin.store.as_ref();
    weir::cron::scheduler::register(
        store,
        &weir::cron::Schedule::new("nightly", "0 3 * * *", "UTC"),
        1,
    )
    .await
    .unwrap();
    store
        .record_recovery(&RecoveryEvent {
            graph: "routed".into(),
            component: "a".into(),
            action: RecoveryAction::AccumulatorRestarted,
            attempt: 1,
            error: "boom".into(),
            at_ms: 1,
            node_id: "admin-test".into(),
        })
        .await
        .unwrap();

    // Open routes.
    assert_eq!(
        http("GET", &admin.url("/healthz"), None, None).await,
        (200, "ok".into())
    );
    let (status, ready) = json_of("GET", &admin.url("/readyz"), None, None).await;
    assert_eq!((status, &ready), (200, &json!({"ready": true})));
    let (status, text) = http("GET", &admin.url("/metrics"), None, None).await;
    assert_eq!(status, 200);
    assert!(text.contains("weir_events_total"), "{text}");

    let protected = [
        ("GET", "/graphs", None),
        ("GET", "/graphs/routed", None),
        ("POST", "/graphs/routed/fire", None),
        ("POST", "/graphs/routed/fire-with", Some(r#"{"a": 2}"#)),
        ("POST", "/graphs/routed/pause", None),
        ("POST", "/graphs/routed/resume", None),
        ("GET", "/schedules", None),
        ("GET", "/schedules/nightly", None),
        ("POST", "/schedules/nightly/pause", None),
        ("POST", "/schedules/nightly/resume", None),
        ("GET", "/recovery-events", None),
        ("GET", "/ws", None),
    ];
    for (method, path, body) in protected {
        for token in [None, Some("wrong")] {
            let (status, error) = json_of(method, &admin.url(path), token, body).await;
            assert_eq!(status, 401, "{method} {path} with {token:?}");
            assert_eq!(error["retryable"], false);
            assert!(
                error["error"].as_str().unwrap().contains("token"),
                "{error}"
            );
        }
        if path != "/ws" {
            let (status, answer) = json_of(method, &admin.url(path), Some(TOKEN), body).await;
            assert_eq!(status, 200, "{method} {path}: {answer}");
        }
    }

    let t = Some(TOKEN);
    let (_, list) = json_of("GET", &admin.url("/graphs"), t, None).await;
    assert_eq!(
        list,
        json!([{"name": "routed", "state": "live", "status": "running"}])
    );
    let (_, state) = json_of("GET", &admin.url("/graphs/routed"), t, None).await;
    assert_eq!(state["graph"], "routed");
    assert_eq!(state["state"], "live");
    assert_eq!(state["status"], "running");
    assert_eq!(state["paused"], false);
    assert_eq!(state["sources"]["a"]["health"], "socket_only");
    assert_eq!(state["sources"]["a"]["dirty"], false);
    // fire-with replaced the cached value.
    assert_eq!(state["sources"]["a"]["value"], 2);
    let (_, fired) = json_of("POST", &admin.url("/graphs/routed/fire"), t, None).await;
    assert_eq!(fired["outputs"], 1);
    assert!(fired["fire"].as_u64().unwrap() >= 3, "{fired}");

    let (_, paused) = json_of("POST", &admin.url("/graphs/routed/pause"), t, None).await;
    assert_eq!(paused, json!({"graph": "routed", "paused": true}));
    let (_, state) = json_of("GET", &admin.url("/graphs/routed"), t, None).await;
    assert_eq!(state["paused"], true);
    json_of("POST", &admin.url("/graphs/routed/resume"), t, None).await;

    // Bad input and unknown names.
    for (method, path) in [
        ("GET", "/graphs/nope"),
        ("POST", "/graphs/nope/fire"),
        ("POST", "/graphs/nope/pause"),
        ("GET", "/schedules/nope"),
        ("POST", "/schedules/nope/resume"),
    ] {
        let (status, error) = json_of(method, &admin.url(path), t, Some("{}")).await;
        assert_eq!(status, 404, "{method} {path}");
        assert!(
            error["error"].as_str().unwrap().contains("\"nope\""),
            "{error}"
        );
    }
    let url = admin.url("/graphs/routed/fire-with");
    let (status, error) = json_of("POST", &url, t, Some("[1]")).await;
    assert_eq!(status, 400, "{error}");
    let (status, error) = json_of("POST", &url, t, Some(r#"{"zz": 1}"#)).await;
    assert_eq!(status, 400, "{error}");
    assert!(error["error"].as_str().unwrap().contains("zz"), "{error}");
    let (status, _) = json_of("GET", &admin.url("/no/such/route"), t, None).await;
    assert_eq!(status, 404);

    // Schedules.
    let (_, schedules) = json_of("GET", &admin.url("/schedules"), t, None).await;
    assert_eq!(schedules[0]["id"], "nightly");
    assert!(schedules[0]["next_fire"]
        .as_str()
        .unwrap()
        .ends_with("T03:00:00Z"));
    let (_, paused) = json_of("POST", &admin.url("/schedules/nightly/pause"), t, None).await;
    assert_eq!(paused, json!({"id": "nightly", "enabled": false}));
    let (_, shown) = json_of("GET", &admin.url("/schedules/nightly"), t, None).await;
    assert_eq!(shown["enabled"], false);
    assert_eq!(shown["next_fire"], Value::Null);
    assert_eq!(shown["executions"], json!([]));
    json_of("POST", &admin.url("/schedules/nightly/resume"), t, None).await;
    let (_, shown) = json_of("GET", &admin.url("/schedules/nightly"), t, None).await;
    assert_eq!(shown["enabled"], true);
    assert!(shown["next_fire"].is_string());

    // Recovery events.
    let url = admin.url("/recovery-events?graph=routed&limit=5");
    let (_, events) = json_of("GET", &url, t, None).await;
    assert_eq!(events[0]["component"], "a");
    assert_eq!(events[0]["action"], "accumulator_restarted");
    let (_, events) = json_of("GET", &admin.url("/recovery-events?graph=other"), t, None).await;
    assert_eq!(events, json!([]));
    let (status, _) = json_of("GET", &admin.url("/recovery-events?limit=x"), t, None).await;
    assert_eq!(status, 400);
}

/// The errors axum answers by itself carry the same JSON body as weir's own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_the_framework_answers_carry_the_json_error_body() {
    let admin = Admin::start(Some(TOKEN)).await;
    admin.graph("routed").await;
    let t = Some(TOKEN);
    let oversized = format!(r#"{{"a": "{}"}}"#, "x".repeat(2 * 1024 * 1024));
    let cases = [
        // A method the route does not take.
        ("DELETE", "/graphs/routed", None, 405),
        // A path segment that is not UTF-8 once decoded.
        ("GET", "/graphs/%FF", None, 400),
        // A body over the limit.
        (
            "POST",
            "/graphs/routed/fire-with",
            Some(oversized.as_str()),
            413,
        ),
        // A WebSocket route asked without the upgrade.
        ("GET", "/ws", None, 400),
    ];
    for (method, path, body, expected) in cases {
        let (status, text) = http(method, &admin.url(path), t, body).await;
        assert_eq!(status, expected, "{method} {path}: {text}");
        let error: Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("{method} {path} answered {text:?}, not JSON: {e}"));
        assert!(
            error["error"].as_str().is_some_and(|e| !e.is_empty()),
            "{method} {path}: {error}"
        );
        assert_eq!(error["retryable"], false, "{method} {path}: {error}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cross_site_form_cannot_change_state() {
    let admin = Admin::start(None).await;
    let graph = admin.graph("formed").await;
    let pause = admin.url("/graphs/formed/pause");
    for content_type in [
        None,
        Some("application/x-www-form-urlencoded"),
        Some("text/plain"),
        Some("multipart/form-data; boundary=x"),
    ] {
        let (status, body) = http_as("POST", &pause, None, Some("a=1"), content_type).await;
        assert_eq!(status, 415, "{content_type:?}: {body}");
        assert!(body.contains("application/json"), "{body}");
    }
    let paused = || async {
        json_of("GET", &admin.url("/graphs/formed"), None, None)
            .await
            .1["paused"]
            .clone()
    };
    assert_eq!(paused().await, false, "no form paused the graph");
    let json = Some("application/json; charset=utf-8");
    let (status, _) = http_as("POST", &pause, None, None, json).await;
    assert_eq!(status, 200);
    assert_eq!(paused().await, true);
    drop(graph);
    // Reads stay plain.
    let (status, _) = http_as("GET", &admin.url("/graphs"), None, None, None).await;
    assert_eq!(status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_without_a_token_answers_loopback_hosts_only() {
    let admin = Admin::start(None).await;
    admin.graph("rebound").await;
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let ask = |host: &'static str| {
        let request = hyper::Request::builder()
            .method("POST")
            .uri(admin.url("/graphs/rebound/pause"))
            .header("host", host)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::new()))
            .unwrap();
        client.request(request)
    };
    // A page at rebind.evil, whose name now points at 127.0.0.1.
    let refused = ask("rebind.evil:9899").await.unwrap();
    assert_eq!(refused.status(), 403);
    let (_, graph) = json_of("GET", &admin.url("/graphs/rebound"), None, None).await;
    assert_eq!(graph["paused"], false, "the page paused nothing");
    assert_eq!(ask("localhost:9899").await.unwrap().status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_websocket_from_another_origin_is_refused() {
    let admin = Admin::start(Some(TOKEN)).await;
    admin.graph("origins").await;
    let url = format!("ws://{}/ws", admin.admin);
    let connect = |origin: Option<String>| {
        let mut request = url.as_str().into_client_request().unwrap();
        let headers = request.headers_mut();
        headers.insert("authorization", format!("Bearer {TOKEN}").parse().unwrap());
        if let Some(origin) = origin {
            headers.insert("origin", origin.parse().unwrap());
        }
        tokio_tungstenite::connect_async(request)
    };
    match connect(Some("https://evil.example".into())).await {
        Err(tokio_tungstenite::tungstenite::Error::Http(response)) => {
            assert_eq!(response.status(), 403)
        }
        other => panic!("a foreign origin was let in: {:?}", other.map(|_| ())),
    }
    let own = format!("http://{}", admin.admin);
    assert!(
        connect(Some(own)).await.is_ok(),
        "the listener's own origin"
    );
    assert!(
        connect(None).await.is_ok(),
        "a client that is no browser sends no origin"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listed_origins_may_open_the_websocket() {
    let store = Arc::new(MemoryStore::new());
    let state = AdminState::new()
        .with_store(store)
        .with_allowed_origins(vec!["https://ops.example.com".into()]);
    let listen = Listen {
        admin: Some("127.0.0.1:0".parse().unwrap()),
        ..Default::default()
    };
    let cancel = CancellationToken::new();
    let servers = weir::admin::serve(state, &listen, cancel.clone())
        .await
        .unwrap();
    let url = format!("ws://{}/ws", servers.admin.unwrap());
    let with_origin = |origin: &str| {
        let mut request = url.as_str().into_client_request().unwrap();
        request
            .headers_mut()
            .insert("origin", origin.parse().unwrap());
        tokio_tungstenite::connect_async(request)
    };
    assert!(with_origin("https://ops.example.com").await.is_ok());
    assert!(with_origin("https://ops.example.com.evil.example")
        .await
        .is_err());
    cancel.cancel();
}

#[tokio::test]
async fn an_open_admin_api_on_the_network_refuses_to_start() {
    let exposed: SocketAddr = "0.0.0.0:0".parse().unwrap();
    let listen = Listen {
        admin: Some(exposed),
        ..Default::default()
    };
    let cancel = CancellationToken::new();
    let refused = weir::admin::serve(AdminState::new(), &listen, cancel.clone()).await;
    match refused {
        Err(e @ weir::admin::AdminError::Unprotected { .. }) => {
            assert!(e.to_string().contains("allow_unauthenticated"), "{e}")
        }
        Err(e) => panic!("refused for the wrong reason: {e}"),
        Ok(_) => panic!("an open admin API started on 0.0.0.0"),
    }
    let with_token = AdminState::new().with_token(Some(TOKEN.into()));
    let servers = weir::admin::serve(with_token, &listen, cancel.clone()).await;
    assert!(servers.is_ok(), "a token makes it safe");
    let allowed = Listen {
        allow_unauthenticated: true,
        ..listen
    };
    let servers = weir::admin::serve(AdminState::new(), &allowed, cancel.clone()).await;
    assert!(servers.is_ok(), "an operator may insist");
    cancel.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_commands_answer_in_order() {
    let admin = Admin::start(Some(TOKEN)).await;
    let graph = admin.graph("socketed").await;
    graph.push("a", json!(1)).await.unwrap();
    eventually("the event fired", || async { graph.stats().outputs == 1 }).await;

    let url = format!("ws://{}/ws", admin.admin);
    let refused = tokio_tungstenite::connect_async(url.as_str()).await;
    assert!(refused.is_err(), "the upgrade needs the token");

    let mut request = url.as_str().into_client_request().unwrap();
    request
        .headers_mut()
        .insert("authorization", format!("Bearer {TOKEN}").parse().unwrap());
    let (mut socket, _) = tokio_tungstenite::connect_async(request).await.unwrap();
    let mut ask = async |request: Value| -> Value {
        socket
            .send(Message::text(request.to_string()))
            .await
            .unwrap();
        loop {
            match socket.next().await.unwrap().unwrap() {
                Message::Text(text) => return serde_json::from_str(text.as_str()).unwrap(),
                Message::Ping(_) | Message::Pong(_) => continue,
                other => panic!("unexpected frame {other:?}"),
            }
        }
    };

    let list = ask(json!({"id": 1, "command": "list"})).await;
    assert_eq!(list["id"], 1);
    assert_eq!(list["ok"], true);
    assert_eq!(list["result"][0]["name"], "socketed");
    let fired = ask(json!({"id": 2, "command": "fire", "graph": "socketed"})).await;
    assert_eq!(fired["result"]["outputs"], 1, "{fired}");
    let injected =
        ask(json!({"id": 3, "command": "fire_with", "graph": "socketed", "cache": {"a": 7}})).await;
    assert_eq!(injected["ok"], true, "{injected}");
    let paused = ask(json!({"id": "p", "command": "pause", "graph": "socketed"})).await;
    assert_eq!(
        paused["result"],
        json!({"graph": "socketed", "paused": true})
    );
    let state = ask(json!({"command": "state", "graph": "socketed"})).await;
    assert_eq!(state["id"], Value::Null);
    assert_eq!(state["result"]["paused"], true);
    assert_eq!(state["result"]["sources"]["a"]["value"], 7);
    let resumed = ask(json!({"command": "resume", "graph": "socketed"})).await;
    assert_eq!(resumed["result"]["paused"], false);
    let restarted = ask(json!({"id": 4, "command": "restart", "graph": "socketed"})).await;
    assert_eq!(
        restarted["result"],
        json!({"graph": "socketed", "restarting": true})
    );
    graph.wait_for_state(ReactorState::Live).await;

    let unknown = ask(json!({"id": 9, "command": "fire", "graph": "nope"})).await;
    assert_eq!(unknown["ok"], false);
    assert_eq!(unknown["status"], 404);
    assert_eq!(unknown["id"], 9);
    let bad = ask(json!({"id": 10, "command": "explode"})).await;
    assert_eq!(
        (bad["ok"].clone(), bad["status"].clone(), bad["id"].clone()),
        (json!(false), json!(400), json!(10))
    );
    let garbage = ask(Value::String("not an object".into())).await;
    assert_eq!(garbage["status"], 400);

    // Shutting the server down closes the socket.
    admin.cancel.cancel();
    let closed = tokio::time::timeout(Duration::from_secs(5), async {
        while let Some(Ok(frame)) = socket.next().await {
            if frame.is_close() {
                break;
            }
        }
    })
    .await;
    assert!(closed.is_ok(), "the server closes sockets on shutdown");
}

/// A WebSocket message over 2 MiB closes its socket, where a message just under it is
/// answered: a client cannot make the server hold an unbounded message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_websocket_message_over_two_mib_closes_its_socket() {
    let admin = Admin::start(Some(TOKEN)).await;
    admin.graph("sized").await;
    let connect = || async {
        let mut request = format!("ws://{}/ws", admin.admin)
            .into_client_request()
            .unwrap();
        request
            .headers_mut()
            .insert("authorization", format!("Bearer {TOKEN}").parse().unwrap());
        tokio_tungstenite::connect_async(request).await.unwrap().0
    };
    // A command padded with an unknown field to `size` bytes.
    let command = |size: usize| {
        let head = r#"{"id": 1, "command": "list", "pad": ""#;
        let tail = r#""}"#;
        format!("{head}{}{tail}", "x".repeat(size - head.len() - tail.len()))
    };
    const LIMIT: usize = 2 * 1024 * 1024;

    let mut socket = connect().await;
    socket.send(Message::text(command(LIMIT))).await.unwrap();
    let answer = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match socket.next().await {
                Some(Ok(Message::Text(text))) => {
                    return serde_json::from_str::<Value>(text.as_str()).unwrap()
                }
                Some(Ok(Message::Ping(_) | Message::Pong(_))) => continue,
                other => panic!("no answer to a message at the limit: {other:?}"),
            }
        }
    })
    .await
    .expect("an answer within 10 s");
    assert_eq!(answer["ok"], true, "{answer}");

    let mut socket = connect().await;
    // The server may close while the message is still being sent.
    let _ = socket.send(Message::text(command(LIMIT + 1))).await;
    let closed = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match socket.next().await {
                None | Some(Err(_)) | Some(Ok(Message::Close(_))) => return,
                Some(Ok(Message::Ping(_) | Message::Pong(_))) => continue,
                Some(Ok(other)) => panic!("answered a message over the limit: {other:?}"),
            }
        }
    })
    .await;
    assert!(closed.is_ok(), "the socket closes within 10 s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weir_graph_talks_to_the_admin_api() {
    let admin = Admin::start(Some(TOKEN)).await;
    admin.graph("commanded").await;
    let base = format!("http://{}", admin.admin);
    let weir = move |args: &[&str], token: Option<&str>| {
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_weir"));
        command.arg("graph").args(args).arg("--admin").arg(&base);
        command.env_remove("WEIR_ADMIN_TOKEN");
        if let Some(token) = token {
            command.env("WEIR_ADMIN_TOKEN", token);
        }
        command.output().unwrap()
    };
    let (list, fire, pause, state, resume, restart, missing, refused) =
        tokio::task::spawn_blocking(move || {
            (
                weir(&["list"], Some(TOKEN)),
                weir(&["fire", "commanded"], Some(TOKEN)),
                weir(&["pause", "commanded"], Some(TOKEN)),
                weir(&["state", "commanded"], Some(TOKEN)),
                weir(&["resume", "commanded"], Some(TOKEN)),
                weir(&["restart", "commanded"], Some(TOKEN)),
                weir(&["fire", "nope"], Some(TOKEN)),
                weir(&["list"], None),
            )
        })
        .await
        .unwrap();
    let stdout = |o: &std::process::Output| -> Value {
        assert!(o.status.success(), "{o:?}");
        serde_json::from_slice(&o.stdout).unwrap()
    };
    assert_eq!(stdout(&list)[0]["name"], "commanded");
    assert_eq!(stdout(&fire)["fire"], 1);
    assert_eq!(stdout(&pause)["paused"], true);
    assert_eq!(stdout(&state)["paused"], true);
    assert_eq!(stdout(&resume)["paused"], false);
    assert_eq!(
        stdout(&restart),
        json!({"graph": "commanded", "restarting": true})
    );
    assert_eq!(missing.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&missing.stderr);
    assert!(
        stderr.contains("404") && stderr.contains("no graph named \"nope\""),
        "{stderr}"
    );
    assert_eq!(refused.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&refused.stderr).contains("401"));
}

/// A source whose connection never completes: its accumulator stays Connecting.
struct NeverOpens;

#[async_trait::async_trait]
impl weir::transport::SourceFactory for NeverOpens {
    fn describe(&self) -> String {
        "never".into()
    }

    async fn open(
        &self,
        _: &[weir::transport::Position],
    ) -> Result<Box<dyn weir::transport::Source>, weir::transport::TransportError> {
        std::future::pending().await
    }
}

/// `weir_lease_held{role="cron"}` feeds the "no cron master" alert: 1 while this node's
/// scheduler holds its shard, back to 0 once it stopped and let the shard go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cron_masters_lease_is_in_the_metrics_while_held() {
    use weir::cron::scheduler::{Scheduler, SchedulerConfig};
    let admin = Admin::start(None).await;
    let stop = CancellationToken::new();
    let scheduler = tokio::spawn(
        Scheduler::new(
            admin.store.clone(),
            Arc::new(MemoryBroker::default()),
            SchedulerConfig::new("cron-node"),
        )
        .run(stop.clone()),
    );
    let role = ("role", "cron");
    let held = || async {
        metric(
            &scrape(admin.metrics).await,
            weir::metrics::LEASE_HELD,
            &[role],
        )
    };
    eventually("the shard's lease held", || async {
        held().await == Some(1.0)
    })
    .await;
    let samples = scrape(admin.metrics).await;
    assert!(metric(&samples, weir::metrics::LEASE_ACQUISITIONS_TOTAL, &[role]).unwrap() >= 1.0);
    stop.cancel();
    scheduler.await.unwrap();
    assert_eq!(held().await, Some(0.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warming_graph_makes_the_node_unready() {
    let admin = Admin::start(None).await;
    let decl = GraphBuilder::new("cold")
        .accumulator(AccumulatorSpec::passthrough("slow").source(Arc::new(NeverOpens)))
        .function("snapshot", &FunctionRegistry::default(), "snapshot")
        .output("snapshot", "cold.out")
        .build()
        .unwrap();
    let graph = admin.supervisor.spawn(decl).unwrap();
    graph.wait_for_state(ReactorState::Warming).await;

    let (status, ready) = json_of("GET", &admin.url("/readyz"), None, None).await;
    assert_eq!(status, 503);
    assert_eq!(
        ready,
        json!({"ready": false, "reasons": ["graph cold: warming"]})
    );
    let samples = scrape(admin.metrics).await;
    let g = ("graph", "cold");
    let state = |s| metric(&samples, weir::metrics::REACTOR_STATE, &[g, ("state", s)]);
    assert_eq!((state("warming"), state("live")), (Some(1.0), Some(0.0)));
    let health = |h| {
        metric(
            &samples,
            weir::metrics::ACCUMULATOR_HEALTH,
            &[g, ("source", "slow"), ("health", h)],
        )
    };
    assert_eq!(
        (health("connecting"), health("live")),
        (Some(1.0), Some(0.0))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_graph_is_unready_and_flagged_until_restarted() {
    let admin = Admin::start_with(
        Some(TOKEN),
        SupervisionPolicy {
            max_failures: 1,
            ..SupervisionPolicy::default()
        },
    )
    .await;
    let down = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let flag = down.clone();
    let decl = GraphBuilder::new("fragile")
        .accumulator(AccumulatorSpec::passthrough("a"))
        .node("n", ["a"], move |ctx: weir::NodeContext| {
            let down = flag.load(std::sync::atomic::Ordering::SeqCst);
            async move {
                assert!(!down, "dependency down");
                Ok(ctx.source("a").cloned())
            }
        })
        .output("n", "fragile.out")
        .build()
        .unwrap();
    let graph = admin.supervisor.spawn(decl).unwrap();
    graph.wait_for_state(ReactorState::Live).await;
    graph.push("a", json!(1)).await.unwrap();
    graph.wait_for_state(ReactorState::Failed).await;

    let (status, ready) = json_of("GET", &admin.url("/readyz"), None, None).await;
    assert_eq!(status, 503);
    assert!(ready["reasons"][0]
        .as_str()
        .is_some_and(|r| r.starts_with("graph fragile: failed")));
    let samples = scrape(admin.metrics).await;
    let state = |s| {
        metric(
            &samples,
            weir::metrics::REACTOR_STATE,
            &[("graph", "fragile"), ("state", s)],
        )
    };
    assert_eq!((state("failed"), state("live")), (Some(1.0), Some(0.0)));

    // Still Failed a while later: the alert keeps firing.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let samples = scrape(admin.metrics).await;
    assert_eq!(
        metric(
            &samples,
            weir::metrics::REACTOR_STATE,
            &[("graph", "fragile"), ("state", "failed")]
        ),
        Some(1.0)
    );

    down.store(false, std::sync::atomic::Ordering::SeqCst);
    let restart = admin.url("/graphs/fragile/restart");
    let (status, _) = http("POST", &restart, None, None).await;
    assert_eq!(status, 401, "restart needs the token");
    let (status, answer) = json_of("POST", &restart, Some(TOKEN), None).await;
    assert_eq!(status, 200);
    assert_eq!(answer, json!({"graph": "fragile", "restarting": true}));
    graph.wait_for_state(ReactorState::Live).await;
    let (status, _) = json_of("GET", &admin.url("/readyz"), None, None).await;
    assert_eq!(status, 200);
    let samples = scrape(admin.metrics).await;
    assert_eq!(
        metric(
            &samples,
            weir::metrics::REACTOR_STATE,
            &[("graph", "fragile"), ("state", "failed")]
        ),
        Some(0.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graph_another_node_runs_answers_503_and_leaves_this_node_ready() {
    let admin = Admin::start(Some(TOKEN)).await;
    let decl = || {
        GraphBuilder::new("elsewhere")
            .accumulator(AccumulatorSpec::passthrough("a"))
            .function("snapshot", &FunctionRegistry::default(), "snapshot")
            .output("snapshot", "elsewhere.out")
            .build()
            .unwrap()
    };
    // Another node, sharing the store, holds the graph's lease first.
    let other = Supervisor::new(
        Runtime {
            broker: Arc::new(MemoryBroker::default()),
            store: admin.store.clone(),
            node_id: "other".into(),
        },
        SupervisionPolicy {
            graph_lease_ttl: Some(Duration::from_secs(10)),
            ..SupervisionPolicy::default()
        },
        admin.cancel.clone(),
    );
    other
        .spawn(decl())
        .unwrap()
        .wait_for_state(ReactorState::Live)
        .await;
    let _standby = admin.supervisor.spawn(decl()).unwrap();
    let fire = admin.url("/graphs/elsewhere/fire");
    let mut answer = (0, Value::Null);
    for _ in 0..100 {
        answer = json_of("POST", &fire, Some(TOKEN), None).await;
        if answer.0 == 503 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(answer.0, 503, "{answer:?}");
    assert_eq!(
        answer.1,
        json!({"error": "graph elsewhere is standby, not running on this node", "retryable": true})
    );
    let (status, ready) = json_of("GET", &admin.url("/readyz"), None, None).await;
    assert_eq!(status, 200, "standing by is ready: {ready}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_background_task_makes_the_node_unready() {
    let cancel = CancellationToken::new();
    let scheduler = weir::admin::health::Watched::new("cron scheduler");
    let state = AdminState::new().with_task(scheduler.clone());
    let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let listen = Listen {
        metrics: None,
        admin: Some(any),
        ..Default::default()
    };
    let servers = weir::admin::serve(state, &listen, cancel.clone())
        .await
        .unwrap();
    let ready = format!("http://{}/readyz", servers.admin.unwrap());
    let (release, wait) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let _ = wait.await;
        panic!("the scheduler hit a bug");
    });
    let watcher = scheduler.watch(task, cancel.clone());
    assert_eq!(json_of("GET", &ready, None, None).await.0, 200);
    release.send(()).unwrap();
    watcher.await.unwrap();
    let (status, body) = json_of("GET", &ready, None, None).await;
    assert_eq!(status, 503);
    assert_eq!(body["reasons"], json!(["cron scheduler: stopped"]));
    cancel.cancel();
}

/// How [`PingedBroker`] answers a ping.
#[derive(Debug, Clone, Copy)]
enum Ping {
    Refused,
    Answered,
    Unanswered,
}

/// A broker whose ping answers as told; it serves nothing else.
struct PingedBroker(std::sync::Mutex<Ping>);

impl PingedBroker {
    fn new(ping: Ping) -> Arc<Self> {
        Arc::new(Self(std::sync::Mutex::new(ping)))
    }

    fn set(&self, ping: Ping) {
        *self.0.lock().unwrap() = ping;
    }
}

#[async_trait::async_trait]
impl weir::transport::Broker for PingedBroker {
    fn kind(&self) -> &'static str {
        "pinged"
    }

    async fn subscribe(
        &self,
        subscription: &weir::transport::Subscription,
    ) -> Result<Box<dyn weir::transport::Source>, weir::transport::TransportError> {
        Err(weir::transport::TransportError::Closed {
            topic: subscription.topic.clone(),
        })
    }

    fn sink(&self) -> Arc<dyn weir::transport::Sink> {
        Arc::new(MemoryBroker::default())
    }

    async fn partitioned(
        &self,
        topic: &str,
        partitions: u32,
    ) -> Result<weir::transport::PartitionedTopic, weir::transport::TransportError> {
        Ok(weir::transport::PartitionedTopic::native(topic, partitions))
    }

    async fn ping(&self) -> Result<(), weir::transport::TransportError> {
        let ping = *self.0.lock().unwrap();
        match ping {
            Ping::Answered => Ok(()),
            Ping::Refused => Err(weir::transport::TransportError::Unreachable {
                broker: "pinged:4222".into(),
                source: "connection refused".into(),
            }),
            Ping::Unanswered => std::future::pending().await,
        }
    }
}

/// An admin listener on a store that answers and on `broker`: its `/readyz` URL, and
/// the token that stops it.
async fn readyz_over(broker: Arc<PingedBroker>) -> (String, CancellationToken) {
    let cancel = CancellationToken::new();
    let state = AdminState::new()
        .with_store(Arc::new(MemoryStore::new()))
        .with_broker(broker);
    let listen = Listen {
        admin: Some("127.0.0.1:0".parse().unwrap()),
        ..Default::default()
    };
    let servers = weir::admin::serve(state, &listen, cancel.clone())
        .await
        .unwrap();
    (format!("http://{}/readyz", servers.admin.unwrap()), cancel)
}

/// `/readyz` follows the broker: 503 naming the broker while its ping fails, 200 once
/// it answers again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_follows_the_broker() {
    let broker = PingedBroker::new(Ping::Refused);
    let (url, cancel) = readyz_over(broker.clone()).await;
    let (status, body) = json_of("GET", &url, None, None).await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["ready"], false);
    let reasons = body["reasons"].as_array().unwrap();
    assert_eq!(reasons.len(), 1, "the store answers: {body}");
    let reason = reasons[0].as_str().unwrap();
    assert!(reason.starts_with("broker: "), "{reason}");
    assert!(reason.contains("connection refused"), "{reason}");

    broker.set(Ping::Answered);
    assert_eq!(
        json_of("GET", &url, None, None).await,
        (200, json!({"ready": true}))
    );
    cancel.cancel();
}

/// A broker that never answers its ping makes the node unready once the ping's time is
/// up: `/readyz` answers 503 saying so, rather than waiting on the broker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_that_never_answers_makes_the_node_unready_within_the_ping_timeout() {
    use weir::admin::health::PING_TIMEOUT;
    let (url, cancel) = readyz_over(PingedBroker::new(Ping::Unanswered)).await;
    let (status, body) = tokio::time::timeout(
        PING_TIMEOUT + Duration::from_secs(3),
        json_of("GET", &url, None, None),
    )
    .await
    .expect("/readyz answers soon after the ping timeout");
    assert_eq!(status, 503, "{body}");
    let reasons = body["reasons"].as_array().unwrap();
    assert_eq!(reasons.len(), 1, "the store answers: {body}");
    let reason = reasons[0].as_str().unwrap();
    assert!(reason.starts_with("broker: no answer"), "{reason}");
    cancel.cancel();
}

/// The time of each recovery event in a `/recovery-events` answer, in its order.
fn event_times(events: &Value) -> Vec<i64> {
    events
        .as_array()
        .unwrap_or_else(|| panic!("not a list: {events}"))
        .iter()
        .map(|e| e["at_ms"].as_i64().unwrap())
        .collect()
}

/// The admin API over `store` on a port of its own, with the token `all-token` for
/// everything and `acme-token` for the tenant `acme`: its address, and the token that
/// stops it.
async fn serve_with_tenant_token(store: Arc<dyn Store>) -> (SocketAddr, CancellationToken) {
    let cancel = CancellationToken::new();
    let listen = Listen {
        admin: Some("127.0.0.1:0".parse().unwrap()),
        ..Default::default()
    };
    let state = AdminState::new()
        .with_store(store)
        .with_token(Some("all-token".into()))
        .with_tenant_tokens(vec![("acme-token".into(), "acme".into())]);
    let servers = weir::admin::serve(state, &listen, cancel.clone())
        .await
        .unwrap();
    (servers.admin.unwrap(), cancel)
}

/// A tenant's token lists that tenant's recovery events only: `limit` counts its own
/// events (another tenant's newer ones do not use it up), and `graph` names its graphs
/// without the tenant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_token_lists_only_its_own_recovery_events() {
    let store = Arc::new(MemoryStore::new());
    // Recorded oldest first: another tenant's event is the newest of all.
    for (at_ms, graph) in [
        (1, "acme/orders"),
        (2, "orders"),
        (3, "acme/orders"),
        (4, "globex/orders"),
    ] {
        store
            .record_recovery(&RecoveryEvent {
                graph: graph.into(),
                component: "a".into(),
                action: RecoveryAction::AccumulatorRestarted,
                attempt: 1,
                error: "boom".into(),
                at_ms,
                node_id: "admin-test".into(),
            })
            .await
            .unwrap();
    }
    let (admin, cancel) = serve_with_tenant_token(store).await;
    let base = format!("http://{admin}/recovery-events");
    let (acme, all) = (Some("acme-token"), Some("all-token"));

    let (status, events) = json_of("GET", &base, acme, None).await;
    assert_eq!(status, 200, "{events}");
    assert_eq!(event_times(&events), [3, 1], "{events}");
    assert!(
        events
            .as_array()
            .unwrap()
            .iter()
            .all(|e| e["graph"] == "acme/orders"),
        "{events}"
    );
    let (_, events) = json_of("GET", &format!("{base}?limit=1"), acme, None).await;
    assert_eq!(event_times(&events), [3], "the tenant's newest: {events}");
    let (_, events) = json_of("GET", &format!("{base}?graph=orders"), acme, None).await;
    assert_eq!(
        event_times(&events),
        [3, 1],
        "orders is acme/orders: {events}"
    );
    let url = format!("{base}?graph=globex/orders");
    let (status, answer) = json_of("GET", &url, acme, None).await;
    assert_eq!(status, 404, "another tenant's graph is not found: {answer}");

    // The operator's token sees every graph's, and `orders` is the tenant-less graph.
    let (_, events) = json_of("GET", &base, all, None).await;
    assert_eq!(event_times(&events), [4, 3, 2, 1], "{events}");
    let (_, events) = json_of("GET", &format!("{base}?graph=orders"), all, None).await;
    assert_eq!(event_times(&events), [2], "{events}");
    cancel.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_serves_metrics_where_the_environment_says() {
    let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let mut demo = tokio::process::Command::new(env!("CARGO_BIN_EXE_weir"))
        .args(["demo", "--seconds", "5", "--rate", "200"])
        .env("WEIR__METRICS__LISTEN", addr.to_string())
        .stdout(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut events = None;
    for _ in 0..100 {
        if tokio::net::TcpStream::connect(addr).await.is_ok() {
            let samples = scrape(addr).await;
            events = metric(
                &samples,
                weir::metrics::EVENTS_TOTAL,
                &[("graph", "market")],
            );
            if events.is_some_and(|e| e > 0.0) {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(events.is_some_and(|e| e > 0.0), "{events:?}");
    demo.kill().await.unwrap();
}

#[test]
fn json_logs_carry_the_graph_and_source_spans() {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_weir"))
        .args([
            "--log-format",
            "json",
            "--log",
            "debug",
            "demo",
            "--seconds",
            "1",
        ])
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    let line = stderr
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v["span"]["name"] == "accumulator")
        .unwrap_or_else(|| panic!("no accumulator log line in {stderr}"));
    assert_eq!(line["spans"][0]["graph"], "market", "{line}");
    assert!(
        ["quotes", "trades"].contains(&line["span"]["source"].as_str().unwrap_or_default()),
        "{line}"
    );
}

#[cfg(feature = "it")]
mod services {
    use std::io::Write;
    use std::process::{Child, Command, Stdio};

    use super::*;
    use common::services::{nats_table, unique};
    use weir::store::redis::RedisStore;
    use weir::transport::Outbound;

    /// A Redis of this test's own, so stopping it disturbs no other test.
    fn redis(port: u16) -> Child {
        redis_with(port, &[])
    }

    fn redis_with(port: u16, flags: &[&str]) -> Child {
        Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .args(flags)
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server on PATH")
    }

    /// `/readyz` needs no token: what it says of an unreachable store must not carry the
    /// store's password.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn readyz_names_an_unreachable_store_without_its_password() {
        let password = "s3cret-redis-pass";
        let (mut server, port, admin, cancel) = admin_on_redis(
            &["--requirepass", password],
            |port| format!("redis://:{password}@127.0.0.1:{port}"),
            |state| state,
        )
        .await;
        let readyz = format!("http://{admin}/readyz");
        assert_eq!(ready(&readyz).await.0, 200);
        server.kill().unwrap();
        server.wait().unwrap();
        let last = await_unready(&readyz).await;
        let answer = last.1.to_string();
        assert!(
            answer.contains(&port.to_string()),
            "names the store: {answer}"
        );
        assert!(!answer.contains(password), "{answer}");
        cancel.cancel();
    }

    /// A Redis of the test's own, started with `flags` and reached through `url` (given
    /// its port), and the admin API over it, as `state` makes it from the store: the
    /// server, its port, the admin address and the token that stops the API.
    async fn admin_on_redis(
        flags: &[&str],
        url: impl FnOnce(u16) -> String,
        state: impl FnOnce(AdminState) -> AdminState,
    ) -> (Child, u16, SocketAddr, CancellationToken) {
        let port = free_port();
        let server = redis_with(port, flags);
        wait_for_port(port).await;
        let store = RedisStore::connect(&url(port), &unique("admin"))
            .await
            .unwrap();
        let cancel = CancellationToken::new();
        let listen = Listen {
            admin: Some("127.0.0.1:0".parse().unwrap()),
            ..Default::default()
        };
        let state = state(AdminState::new().with_store(Arc::new(store)));
        let servers = weir::admin::serve(state, &listen, cancel.clone())
            .await
            .unwrap();
        (server, port, servers.admin.unwrap(), cancel)
    }

    async fn wait_for_port(port: u16) {
        for _ in 0..200 {
            if tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("redis on {port} did not start");
    }

    async fn ready(url: &str) -> (u16, Value) {
        json_of("GET", url, None, None).await
    }

    /// `/readyz` once it answers 503, within 10 s.
    async fn await_unready(url: &str) -> (u16, Value) {
        let mut last = (0, Value::Null);
        for _ in 0..100 {
            last = ready(url).await;
            if last.0 == 503 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(last.0, 503, "{last:?}");
        last
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn readyz_follows_the_store() {
        let (mut server, port, admin, cancel) = admin_on_redis(
            &[],
            |port| format!("redis://127.0.0.1:{port}"),
            |state| state,
        )
        .await;
        let url = format!("http://{admin}/readyz");
        assert_eq!(ready(&url).await, (200, json!({"ready": true})));

        server.kill().unwrap();
        server.wait().unwrap();
        let last = await_unready(&url).await;
        assert_eq!(last.1["ready"], false);
        let reason = last.1["reasons"][0].as_str().unwrap();
        assert!(reason.starts_with("store: "), "{reason}");

        let mut server = redis(port);
        wait_for_port(port).await;
        let mut recovered = false;
        for _ in 0..100 {
            if ready(&url).await.0 == 200 {
                recovered = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        server.kill().unwrap();
        server.wait().unwrap();
        cancel.cancel();
        assert!(recovered, "ready again once Redis is back");
    }

    /// A keyed graph's pause flag lives in the store: while the store cannot say (Redis
    /// stopped, its connection open and silent), `GET /graphs` still answers, soon, with
    /// `"paused": null`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_keyed_graphs_pause_flag_is_null_while_the_store_cannot_say() {
        let (mut server, _, admin, cancel) = admin_on_redis(
            &[],
            |port| format!("redis://127.0.0.1:{port}"),
            |state| state.with_keyed_graphs(BTreeMap::from([("per_user".to_string(), 3)])),
        )
        .await;
        let url = format!("http://{admin}/graphs");
        let paused = || async {
            let (status, listed) = json_of("GET", &url, None, None).await;
            assert_eq!(status, 200, "{listed}");
            listed[0]["paused"].clone()
        };
        assert_eq!(paused().await, json!(false));
        common::servers::signal(&server, "STOP");
        let asked = std::time::Instant::now();
        assert_eq!(paused().await, Value::Null);
        assert!(
            asked.elapsed() < Duration::from_secs(5),
            "answered after {:?}",
            asked.elapsed()
        );
        common::servers::signal(&server, "CONT");
        eventually("the flag known again", || async {
            paused().await == json!(false)
        })
        .await;
        server.kill().unwrap();
        server.wait().unwrap();
        cancel.cancel();
    }

    /// A stored schedule this version cannot read is listed by id with why, among the
    /// schedules that read; a tenant's token sees only its own.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn schedules_list_an_unreadable_record_by_id_among_the_rest() {
        let prefix = unique("adminsched");
        let _cleanup_prefix = common::services::cleanup(&prefix);
        let store = common::services::redis(&prefix).await;
        for id in ["a", "b", "z", "acme/c"] {
            let mut schedule = weir::cron::Schedule::new(id, "0 3 * * *", "UTC");
            schedule.tenant = weir::tenant::of_key(id).map(str::to_string);
            weir::cron::scheduler::register(store.as_ref(), &schedule, 1)
                .await
                .unwrap();
        }
        let client = redis::Client::open(common::services::redis_url()).unwrap();
        let mut connection = client.get_multiplexed_async_connection().await.unwrap();
        for id in ["b", "acme/c"] {
            redis::cmd("SET")
                .arg(format!("{prefix}:sched:{id}"))
                .arg(r#"{"id": "x", "cron": 7}"#)
                .query_async::<()>(&mut connection)
                .await
                .unwrap();
        }
        let (admin, cancel) = serve_with_tenant_token(store.clone()).await;
        let url = format!("http://{admin}/schedules");
        let (status, listed) = json_of("GET", &url, Some("all-token"), None).await;
        assert_eq!(status, 200, "{listed}");
        let ids: Vec<&str> = listed
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["id"].as_str().unwrap())
            .collect();
        // Those that read first, then the unreadable, each in id order.
        assert_eq!(ids, ["a", "z", "acme/c", "b"], "{listed}");
        assert!(listed[1]["next_fire"].is_string(), "{listed}");
        assert!(listed[1].get("unreadable").is_none(), "{listed}");
        let unreadable = listed[3]["unreadable"].as_str().unwrap();
        assert!(
            unreadable.contains(&format!("{prefix}:sched:b")),
            "{unreadable}"
        );
        let (status, mine) = json_of("GET", &url, Some("acme-token"), None).await;
        assert_eq!(status, 200, "{mine}");
        assert_eq!(mine.as_array().unwrap().len(), 1, "{mine}");
        assert_eq!(mine[0]["id"], "acme/c");
        let why = mine[0]["unreadable"].as_str().unwrap();
        assert!(
            !why.contains(&prefix),
            "a tenant is not shown the store's keys: {why}"
        );
        cancel.cancel();
    }

    /// A schedule's execution records this version cannot read are listed after the
    /// rest, by time, with why.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_schedule_shows_its_unreadable_executions_after_the_rest() {
        let prefix = unique("adminexec");
        let _cleanup_prefix = common::services::cleanup(&prefix);
        let store = common::services::redis(&prefix).await;
        let schedule = weir::cron::Schedule::new("s", "0 3 * * *", "UTC");
        weir::cron::scheduler::register(store.as_ref(), &schedule, 1)
            .await
            .unwrap();
        for at in [1_000, 2_000] {
            let execution = common::services::completed_execution("s", at);
            assert!(store.claim_execution(&execution).await.unwrap());
        }
        common::services::write_unreadable_execution(&prefix, "s", 2_000).await;
        let (admin, cancel) = serve_with_tenant_token(store.clone()).await;
        let url = format!("http://{admin}/schedules/s");
        let (status, shown) = json_of("GET", &url, Some("all-token"), None).await;
        assert_eq!(status, 200, "{shown}");
        let executions = shown["executions"].as_array().unwrap();
        assert_eq!(executions.len(), 2, "{shown}");
        assert_eq!(executions[0]["scheduled_ms"], 1_000, "{shown}");
        assert_eq!(executions[0]["status"], "completed", "{shown}");
        assert_eq!(executions[1]["scheduled_ms"], 2_000, "{shown}");
        let why = executions[1]["unreadable"].as_str().unwrap();
        assert!(why.contains(&format!("{prefix}:exec:s:2000")), "{why}");
        cancel.cancel();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn produce_then_tail_prints_each_message_on_a_line() {
        let subject = unique("tail");
        let _cleanup_subject = common::services::cleanup(&subject);
        let mut config = tempfile::NamedTempFile::new().unwrap();
        write!(config, "[broker]\n{}\n", nats_table()).unwrap();
        let path = config.path().to_path_buf();

        let mut produce = Command::new(env!("CARGO_BIN_EXE_weir"))
            .args(["produce", &subject, "--config"])
            .arg(&path)
            .stdin(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        produce
            .stdin
            .take()
            .unwrap()
            .write_all(b"plain text\n\n{ \"x\": [1, 2] }\n")
            .unwrap();
        let produced = produce.wait_with_output().unwrap();
        assert!(produced.status.success(), "{produced:?}");
        assert!(String::from_utf8_lossy(&produced.stderr).contains("2 messages published"));

        let broker = weir::config::Config::load(&path)
            .unwrap()
            .connect_broker()
            .await
            .unwrap();
        let tick = weir::codec::CronTick {
            schedule_id: "nightly".into(),
            tick_id: "nightly@1".into(),
            scheduled_time_ms: 1,
            emitted_time_ms: 2,
            fencing_token: 3,
            delivery: "at_least_once".into(),
            attempt: 1,
            payload: "{}".into(),
            node_id: "n1".into(),
            tenant: None,
        };
        let bytes = weir::codec::avro::encode(&tick).unwrap();
        broker
            .sink()
            .publish(Outbound::new(subject.clone(), bytes))
            .await
            .unwrap();

        let tail = tokio::task::spawn_blocking(move || {
            Command::new(env!("CARGO_BIN_EXE_weir"))
                .args([
                    "tail",
                    &subject,
                    "--from-beginning",
                    "--count",
                    "3",
                    "--config",
                ])
                .arg(&path)
                .output()
                .unwrap()
        });
        let tailed = tokio::time::timeout(Duration::from_secs(30), tail)
            .await
            .expect("tail stops after --count messages")
            .unwrap();
        assert!(tailed.status.success(), "{tailed:?}");
        let stdout = String::from_utf8(tailed.stdout).unwrap();
        let lines: Vec<&str> = stdout.lines().collect();
        assert_eq!(lines[0], "plain text");
        assert_eq!(lines[1], r#"{"x":[1,2]}"#);
        let tick: Value = serde_json::from_str(lines[2]).unwrap();
        assert_eq!(tick["tick_id"], "nightly@1");
        assert_eq!(tick["fencing_token"], 3);
        drop(config);
    }

    /// Runs `weir produce SUBJECT` with the config at `path` and `flags`, `input` on its
    /// stdin.
    fn produce(
        subject: &str,
        path: &std::path::Path,
        flags: &[&str],
        input: &[u8],
    ) -> std::process::Output {
        let mut child = spawn_produce(subject, path, flags);
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(input).unwrap();
        drop(stdin);
        child.wait_with_output().unwrap()
    }

    /// Starts `weir produce SUBJECT` with the config at `path` and `flags`, its stdin,
    /// stdout and stderr piped.
    fn spawn_produce(subject: &str, path: &std::path::Path, flags: &[&str]) -> Child {
        Command::new(env!("CARGO_BIN_EXE_weir"))
            .args(["produce", subject, "--config"])
            .arg(path)
            .args(flags)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    }

    /// The payloads on a subject from its beginning, as text: `count` of them, then
    /// whatever else arrives within half a second.
    async fn payloads(path: &std::path::Path, subject: &str, count: usize) -> Vec<String> {
        payloads_then(path, subject, count, Duration::from_millis(500)).await
    }

    /// The payloads on a subject from its beginning, as text: `count` of them, then
    /// whatever else arrives with no gap of `quiet` (none with a zero `quiet`).
    async fn payloads_then(
        path: &std::path::Path,
        subject: &str,
        count: usize,
        quiet: Duration,
    ) -> Vec<String> {
        use weir::transport::{Assignment, StartFrom, Subscription};
        let broker = weir::config::Config::load(path)
            .unwrap()
            .connect_broker()
            .await
            .unwrap();
        let mut subscription = Subscription::new(subject.to_string(), unique("reader"));
        subscription.assignment = Assignment::All;
        subscription.start = StartFrom::Earliest;
        let mut source = broker.subscribe(&subscription).await.unwrap();
        let mut read = Vec::new();
        loop {
            let wait = if read.len() < count {
                Duration::from_secs(30)
            } else {
                quiet
            };
            match tokio::time::timeout(wait, source.next()).await {
                Ok(message) => {
                    let message = message.unwrap();
                    read.push(String::from_utf8(message.payload.to_vec()).unwrap());
                }
                Err(_) if read.len() < count => panic!("{} of {count} read", read.len()),
                Err(_) => return read,
            }
        }
    }

    /// 20,000 lines through `weir produce` (many awaiting acknowledgement at once) arrive
    /// once each, in their order.
    async fn many_lines_keep_their_order(broker_table: &str, flags: &[&str]) {
        let subject = unique("produce");
        let _cleanup_subject = common::services::cleanup(&subject);
        let mut config = tempfile::NamedTempFile::new().unwrap();
        write!(config, "[broker]\n{broker_table}\n").unwrap();
        let lines: Vec<String> = (0..20_000).map(|n| format!("line {n}")).collect();
        let produced = produce(&subject, config.path(), flags, lines.join("\n").as_bytes());
        assert!(produced.status.success(), "{produced:?}");
        let report = String::from_utf8_lossy(&produced.stderr);
        assert!(report.contains("20000 messages published"), "{report}");
        assert_eq!(payloads(config.path(), &subject, lines.len()).await, lines);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn produce_publishes_many_lines_in_their_order_on_nats() {
        many_lines_keep_their_order(&nats_table(), &[]).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn produce_publishes_many_lines_in_their_order_on_kafka() {
        // One key: one partition, whose order is the lines'.
        let table = common::services::kafka_table();
        many_lines_keep_their_order(&table, &["--key", "k"]).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn produce_stops_at_a_line_the_broker_refuses_and_says_which() {
        let server = common::servers::Server::nats("max_payload: 1024");
        let subject = unique("produce");
        let _cleanup_subject = common::services::cleanup(&subject);
        let config = broker_config(&server);
        let big = "x".repeat(4096);
        let input = format!("first\nsecond\n{big}\nfourth\n");
        let produced = produce(&subject, config.path(), &[], input.as_bytes());
        // Bad input: the line, not the broker, is at fault.
        assert_eq!(produced.status.code(), Some(2), "{produced:?}");
        let report = String::from_utf8_lossy(&produced.stderr);
        assert!(
            report.contains("2 messages published to")
                && report.contains("before line 3, which the broker refused"),
            "{report}"
        );
        // Nothing after the refused line was read, so nothing after it was sent.
        assert_eq!(
            payloads(config.path(), &subject, 2).await,
            ["first", "second"]
        );
    }

    /// A config file naming `server` as the broker.
    fn broker_config(server: &common::servers::Server) -> tempfile::NamedTempFile {
        let mut config = tempfile::NamedTempFile::new().unwrap();
        write!(
            config,
            "[broker]\nkind = \"nats\"\nurl = \"{}\"\n",
            server.nats_url()
        )
        .unwrap();
        config
    }

    /// What happens to the NATS server while `weir produce` feeds it lines.
    enum Fault {
        /// Stopped as an operator would, and started again.
        Restart,
        /// Paused (SIGSTOP) for 10 s, past the client's 5 s wait for the
        /// acknowledgement `produce` waits on once its window is full.
        Pause,
    }

    /// `weir produce` fed a line a millisecond, `fault` once the first lines are in the
    /// stream, then the rest at once: what reaches the stream keeps the lines' order,
    /// once each, and the report is true to it.
    /// Either every line got through, or the report names the first line not
    /// confirmed (returned): every line before it is in the stream, as are the lines
    /// after it it counts as published, and the command fails as for unreachable
    /// infrastructure.
    async fn produce_through(fault: Fault) -> Option<String> {
        const LINES: usize = 4_000;
        let mut server = common::servers::Server::nats("");
        let subject = unique("produce");
        let config = broker_config(&server);
        let mut child = spawn_produce(&subject, config.path(), &[]);
        let mut stdin = child.stdin.take().unwrap();
        let hurry = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let feeder = std::thread::spawn({
            let hurry = hurry.clone();
            move || {
                for n in 1..=LINES {
                    // Closed once the command stops reading.
                    if writeln!(stdin, "line {n}")
                        .and_then(|()| stdin.flush())
                        .is_err()
                    {
                        return;
                    }
                    if !hurry.load(std::sync::atomic::Ordering::Relaxed) {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
            }
        });
        payloads_then(config.path(), &subject, 100, Duration::ZERO).await;
        // The rest at once: with the server paused, `produce` fills its window and
        // waits on the oldest acknowledgement straight away.
        match fault {
            Fault::Restart => {
                server.restart();
                hurry.store(true, std::sync::atomic::Ordering::Relaxed);
            }
            Fault::Pause => {
                server.signal("STOP");
                hurry.store(true, std::sync::atomic::Ordering::Relaxed);
                tokio::time::sleep(Duration::from_secs(10)).await;
                server.signal("CONT");
            }
        }
        let produced = tokio::task::spawn_blocking(move || {
            feeder.join().unwrap();
            child.wait_with_output().unwrap()
        })
        .await
        .unwrap();
        let report = String::from_utf8_lossy(&produced.stderr).to_string();
        eprintln!("{}: {report}", produced.status);
        let stream = |count| {
            let path = config.path().to_path_buf();
            let subject = subject.clone();
            async move {
                let stream: Vec<usize> = payloads(&path, &subject, count)
                    .await
                    .iter()
                    .map(|p| p.strip_prefix("line ").unwrap().parse().unwrap())
                    .collect();
                assert!(
                    stream.windows(2).all(|w| w[0] < w[1]),
                    "out of order or twice: {stream:?}"
                );
                stream
            }
        };
        if produced.status.success() {
            assert!(
                report.contains(&format!("{LINES} messages published")),
                "{report}"
            );
            assert_eq!(stream(LINES).await, (1..=LINES).collect::<Vec<_>>());
            return None;
        }
        assert_eq!(produced.status.code(), Some(1), "{report}");
        let line = report
            .lines()
            .find(|l| l.contains("before line"))
            .unwrap_or_else(|| panic!("{report}"))
            .replace(&subject, "");
        // "N messages published to S before line K, <its fate>; of the lines handed over
        // after it, A were published and B were not confirmed"
        let numbers: Vec<usize> = line
            .split(|c: char| !c.is_ascii_digit())
            .filter(|n| !n.is_empty())
            .map(|n| n.parse().unwrap())
            .collect();
        let [published, unconfirmed, after, unconfirmed_after] = numbers[..] else {
            panic!("{line}");
        };
        let stream = stream(published + after).await;
        assert_eq!(published, unconfirmed - 1, "{line}");
        assert_eq!(
            stream[..published],
            (1..unconfirmed).collect::<Vec<_>>(),
            "{line}"
        );
        let later = stream.iter().filter(|&&n| n > unconfirmed).count();
        assert!(
            later >= after && later <= after + unconfirmed_after,
            "{later} later lines in the stream; {line}"
        );
        if line.contains("did not confirm") {
            assert!(
                report.contains("weir: the broker may have stored the message all the same"),
                "{report}"
            );
        }
        Some(line)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn produce_through_a_nats_restart_keeps_order_and_reports_truly() {
        produce_through(Fault::Restart).await;
    }

    /// The line whose acknowledgement did not come is reported as such, not as lost: the
    /// server stores what it was sent once it resumes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn produce_to_a_paused_nats_server_reports_the_line_it_did_not_confirm() {
        let line = produce_through(Fault::Pause)
            .await
            .expect("a pause past the acknowledgement wait fails the command");
        assert!(
            line.contains("which the broker did not confirm (it may have stored it"),
            "{line}"
        );
    }
}

#[tokio::test]
async fn keyed_graphs_are_listed_with_the_owner_of_each_partition() {
    use weir::graph::{KeySource, Keying};
    let broker = MemoryBroker::default();
    let store = Arc::new(MemoryStore::new());
    let mut keying = Keying::new(KeySource::MessageKey);
    keying.partitions = 3;
    keying.lease_ttl = Duration::from_millis(600);
    let decl = GraphBuilder::new("per_user")
        .keyed(keying)
        .accumulator(AccumulatorSpec::passthrough("a").topic("per_user.in"))
        .function("snapshot", &FunctionRegistry::default(), "snapshot")
        .output("snapshot", "per_user.out")
        .build()
        .unwrap();
    let broker: Arc<dyn weir::transport::Broker> = Arc::new(broker);
    let topics = weir::keyed::topics(&decl, broker.as_ref()).await.unwrap();
    let cancel = CancellationToken::new();
    let node = tokio::spawn(weir::keyed::serve(
        decl.clone(),
        topics,
        broker.clone(),
        store.clone(),
        "n1".into(),
        cancel.clone(),
    ));
    let runtime = Runtime {
        broker,
        store: store.clone(),
        node_id: "n1".into(),
    };
    let state = AdminState::new()
        .with_runtime(&runtime)
        .with_keyed_graphs(BTreeMap::from([("per_user".to_string(), 3)]));
    let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let listen = Listen {
        admin: Some(any),
        ..Default::default()
    };
    let admin = weir::admin::serve(state, &listen, cancel.clone())
        .await
        .unwrap()
        .admin
        .unwrap();
    let (status, listed) = json_of("GET", &format!("http://{admin}/graphs"), None, None).await;
    assert_eq!(status, 200);
    assert_eq!(
        listed,
        json!([{"name": "per_user", "status": "running", "paused": false, "keyed": {"partitions": 3}}])
    );
    let url = format!("http://{admin}/graphs/per_user/partitions");
    eventually("every partition owned by n1", || async {
        let (status, view) = json_of("GET", &url, None, None).await;
        status == 200
            && view
                == json!({"graph": "per_user", "partitions": [
                    {"partition": 0, "owner": "n1"},
                    {"partition": 1, "owner": "n1"},
                    {"partition": 2, "owner": "n1"},
                ]})
    })
    .await;
    // The command line asks the same.
    let printed = tokio::process::Command::new(env!("CARGO_BIN_EXE_weir"))
        .args(["graph", "partitions", "per_user", "--admin"])
        .arg(format!("http://{admin}"))
        .output()
        .await
        .unwrap();
    assert!(printed.status.success(), "{printed:?}");
    let view: Value = serde_json::from_slice(&printed.stdout).unwrap();
    assert_eq!(
        view["partitions"][2],
        json!({"partition": 2, "owner": "n1"})
    );
    let (status, _) = json_of(
        "GET",
        &format!("http://{admin}/graphs/nobody/partitions"),
        None,
        None,
    )
    .await;
    assert_eq!(status, 404);
    // A pause is stored for every node running the graph, and listed.
    let url = format!("http://{admin}/graphs/per_user/pause");
    let (status, paused) = json_of("POST", &url, None, Some("{}")).await;
    assert_eq!(
        (status, paused),
        (200, json!({"graph": "per_user", "paused": true}))
    );
    assert!(store.load_paused("per_user").await.unwrap());
    let (_, listed) = json_of("GET", &format!("http://{admin}/graphs"), None, None).await;
    assert_eq!(listed[0]["paused"], json!(true), "{listed}");
    // The command line resumes it the same way.
    let resumed = tokio::process::Command::new(env!("CARGO_BIN_EXE_weir"))
        .args(["graph", "resume", "per_user", "--admin"])
        .arg(format!("http://{admin}"))
        .output()
        .await
        .unwrap();
    assert!(resumed.status.success(), "{resumed:?}");
    assert!(!store.load_paused("per_user").await.unwrap());
    // Commands to a graph's one reactor are refused, saying why, rather than "no graph".
    let url = format!("http://{admin}/graphs/per_user/fire");
    let (status, refused) = json_of("POST", &url, None, Some("{}")).await;
    assert_eq!(status, 409, "{refused}");
    let error = refused["error"].as_str().unwrap_or_default();
    assert!(error.contains("is keyed"), "{error}");
    let (status, _) = json_of(
        "GET",
        &format!("http://{admin}/graphs/per_user"),
        None,
        None,
    )
    .await;
    assert_eq!(status, 409);
    cancel.cancel();
    tokio::time::timeout(Duration::from_secs(20), node)
        .await
        .expect("the node stops in time")
        .unwrap();
}

/// The admin API as a command serves it from its config finds schedules in whichever
/// cron shard they are filed: before, `weir worker`'s looked in shard 0 only, showing
/// the others with no next fire and filing a resumed one in the wrong shard.
#[tokio::test]
async fn the_admin_api_built_from_a_config_reads_schedules_in_every_cron_shard() {
    const SHARDS: u32 = 4;
    let id = (0..)
        .map(|n| format!("every-minute-{n}"))
        .find(|id| weir::cron::scheduler::shard_of(id, SHARDS) != 0)
        .unwrap();
    let text = format!(
        "[cron]\nshards = {SHARDS}\n[[schedule]]\nid = \"{id}\"\ncron = \"* * * * *\"\ntopic = \"t.ticks\"\n"
    );
    let config = weir::config::Config::parse(&text, std::path::Path::new("weir.toml"), []).unwrap();
    let runtime = config.runtime().await.unwrap();
    for schedule in config.declared_schedules().unwrap() {
        weir::cron::scheduler::register(runtime.store.as_ref(), &schedule, SHARDS)
            .await
            .unwrap();
    }
    let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let listen = Listen {
        admin: Some(any),
        ..Default::default()
    };
    let cancel = CancellationToken::new();
    let servers = weir::admin::serve(config.admin_state(&runtime), &listen, cancel.clone())
        .await
        .unwrap();
    let url = |path: &str| format!("http://{}{path}", servers.admin.unwrap());
    let (_, shown) = json_of("GET", &url(&format!("/schedules/{id}")), None, None).await;
    assert!(shown["next_fire"].is_string(), "{shown}");
    json_of("POST", &url(&format!("/schedules/{id}/pause")), None, None).await;
    json_of("POST", &url(&format!("/schedules/{id}/resume")), None, None).await;
    let (_, listed) = json_of("GET", &url("/schedules"), None, None).await;
    assert!(listed[0]["next_fire"].is_string(), "{listed}");
    cancel.cancel();
}
