//! `weir demo`: a market-data graph on the embedded default.
//!
//! A generator publishes quotes and trades to in-process topics; the `quotes`
//! accumulator passes each quote through, the `trades` accumulator batches trades; the
//! graph computes the mid price and the trades' VWAP in parallel branches and joins them
//! into a signal published to `market.signals`, which the demo prints as it arrives.

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use crate::accumulator::AccumulatorSpec;
use crate::admin::{AdminState, Listen};
use crate::graph::{GraphBuilder, GraphDeclaration, NodeContext, NodeError, NodeResult};
use crate::reactor::{Criteria, Strategy};
use crate::stats::StatsSnapshot;
use crate::supervisor::{Runtime, SupervisionPolicy, Supervisor};
use crate::transport::memory::MemoryBroker;
use crate::transport::{Broker, Outbound, Sink, Subscription};

pub const QUOTES_TOPIC: &str = "market.quotes";
pub const TRADES_TOPIC: &str = "market.trades";
pub const SIGNALS_TOPIC: &str = "market.signals";

#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// Stop after this long; `None` runs until cancelled.
    pub duration: Option<Duration>,
    /// Quotes per second (trades come at a third of that).
    pub rate: u32,
    /// Metrics and admin listeners, if any.
    pub listen: Listen,
}

#[derive(Debug, Deserialize)]
struct Quote {
    bid: f64,
    ask: f64,
}

#[derive(Debug, Deserialize)]
struct Trade {
    price: f64,
    qty: f64,
}

async fn mid(ctx: NodeContext) -> NodeResult {
    let Some(q) = ctx.get::<Quote>("quotes")? else {
        return Ok(None);
    };
    Ok(Some(
        json!({"mid": (q.bid + q.ask) / 2.0, "spread": q.ask - q.bid}),
    ))
}

async fn vwap(ctx: NodeContext) -> NodeResult {
    let Some(trades) = ctx.get::<Vec<Trade>>("trades")? else {
        return Ok(None);
    };
    let volume: f64 = trades.iter().map(|t| t.qty).sum();
    if volume <= 0.0 {
        return Err(NodeError::new("trade batch with no volume"));
    }
    let vwap = trades.iter().map(|t| t.price * t.qty).sum::<f64>() / volume;
    Ok(Some(json!({"vwap": vwap, "volume": volume})))
}

async fn signal(ctx: NodeContext) -> NodeResult {
    let Some(mid) = ctx.node("mid").and_then(|m| m["mid"].as_f64()) else {
        return Ok(None);
    };
    let vwap = ctx.node("vwap").and_then(|v| v["vwap"].as_f64());
    let edge_bps = vwap.map(|v| (mid - v) / v * 10_000.0);
    let action = match edge_bps {
        Some(e) if e > 1.0 => "sell",
        Some(e) if e < -1.0 => "buy",
        _ => "hold",
    };
    Ok(Some(json!({
        "fire": ctx.fire().fire,
        "mid": mid,
        "vwap": vwap,
        "edge_bps": edge_bps,
        "action": action,
    })))
}

/// The demo's graph, declared in Rust.
pub fn market_graph() -> Result<GraphDeclaration, crate::graph::GraphBuildError> {
    GraphBuilder::new("market")
        .accumulator(AccumulatorSpec::passthrough("quotes").topic(QUOTES_TOPIC))
        .accumulator(
            AccumulatorSpec::batch("trades", 5, Duration::from_millis(500)).topic(TRADES_TOPIC),
        )
        .criteria(Criteria::WhenAny)
        .strategy(Strategy::Latest)
        .node("mid", ["quotes"], mid)
        .node("vwap", ["trades"], vwap)
        .node("signal", ["mid", "vwap"], signal)
        .output("signal", SIGNALS_TOPIC)
        .build()
}

/// A deterministic random walk, so runs are comparable.
struct Market {
    price: f64,
    state: u64,
}

impl Market {
    fn noise(&mut self) -> f64 {
        // xorshift64*
        self.state ^= self.state >> 12;
        self.state ^= self.state << 25;
        self.state ^= self.state >> 27;
        let x = self.state.wrapping_mul(0x2545_F491_4F6C_DD1D);
        (x >> 11) as f64 / (1u64 << 53) as f64 - 0.5
    }
}

async fn publish(broker: &MemoryBroker, topic: &str, value: &Value) {
    // The in-process broker only refuses malformed topic names, and these are constants.
    let _ = broker
        .publish(Outbound::new(topic, crate::codec::json::encode(value)))
        .await;
}

async fn generate(broker: MemoryBroker, rate: u32, cancel: CancellationToken) {
    let mut market = Market {
        price: 1.0850,
        state: 0x9E37_79B9_7F4A_7C15,
    };
    let period = Duration::from_secs_f64(1.0 / f64::from(rate.max(1)));
    let mut ticker = tokio::time::interval(period);
    let mut n: u64 = 0;
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = ticker.tick() => {}
        }
        n += 1;
        market.price *= 1.0 + market.noise() * 0.0004;
        let half_spread = 0.00005 + market.noise().abs() * 0.00004;
        let quote = json!({"symbol": "EURUSD", "bid": market.price - half_spread, "ask": market.price + half_spread});
        publish(&broker, QUOTES_TOPIC, &quote).await;
        if n % 3 == 0 {
            let trade = json!({"symbol": "EURUSD", "price": market.price + market.noise() * 0.0002, "qty": 1.0 + (market.noise() + 0.5) * 9.0});
            publish(&broker, TRADES_TOPIC, &trade).await;
        }
    }
}

fn print_signal(out: &mut impl Write, payload: &[u8]) -> std::io::Result<()> {
    let Ok(v) = serde_json::from_slice::<Value>(payload) else {
        return writeln!(out, "{}", String::from_utf8_lossy(payload));
    };
    let num = |key: &str, digits: usize| match v[key].as_f64() {
        Some(x) => format!("{x:.digits$}"),
        None => "-".to_string(),
    };
    writeln!(
        out,
        "fire={} mid={} vwap={} edge_bps={} action={}",
        v["fire"],
        num("mid", 5),
        num("vwap", 5),
        num("edge_bps", 2),
        v["action"].as_str().unwrap_or("-")
    )
}

/// Why the demo could not run.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error(transparent)]
    Graph(#[from] crate::graph::GraphBuildError),
    #[error(transparent)]
    Supervisor(#[from] crate::supervisor::SupervisorError),
    #[error(transparent)]
    Admin(#[from] crate::admin::AdminError),
    #[error(transparent)]
    Transport(#[from] crate::transport::TransportError),
    #[error("writing the outputs: {0}")]
    Io(#[from] std::io::Error),
}

/// Runs the demo until `options.duration` passes or `cancel` fires, printing each output
/// and then the summary line. Returns the graph's counters.
pub async fn run(
    options: DemoOptions,
    cancel: CancellationToken,
    out: &mut (impl Write + Send),
) -> Result<StatsSnapshot, DemoError> {
    let broker = MemoryBroker::default();
    let runtime = Runtime {
        broker: Arc::new(broker.clone()),
        ..Runtime::embedded()
    };
    let supervisor = Arc::new(Supervisor::new(
        runtime.clone(),
        SupervisionPolicy::default(),
        cancel.child_token(),
    ));
    // Before the graph: its metric handles bind to the recorder present when created.
    let admin_stop = CancellationToken::new();
    let admin = AdminState::new()
        .with_supervisor(supervisor.clone())
        .with_runtime(&runtime);
    let servers = crate::admin::serve(admin, &options.listen, admin_stop.clone()).await?;
    let graph = supervisor.spawn(market_graph()?)?;
    let mut signals = broker
        .subscribe(&Subscription::new(SIGNALS_TOPIC, "weir.demo.printer"))
        .await?;

    let generator_stop = CancellationToken::new();
    let generator = tokio::spawn(generate(
        broker.clone(),
        options.rate,
        generator_stop.clone(),
    ));
    let deadline = async {
        match options.duration {
            Some(d) => tokio::time::sleep(d).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(deadline);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => break,
            _ = &mut deadline => break,
            message = signals.next() => {
                let Ok(message) = message else { break };
                print_signal(out, &message.payload)?;
                let _ = signals.commit(&[message.position]).await;
            }
        }
    }
    generator_stop.cancel();
    let _ = generator.await;
    supervisor.shutdown().await;
    admin_stop.cancel();
    servers.stopped().await;
    // Print what the graph published after the loop stopped reading, so the printed
    // lines match the outputs counted.
    while let Ok(Ok(message)) =
        tokio::time::timeout(Duration::from_millis(10), signals.next()).await
    {
        print_signal(out, &message.payload)?;
    }
    let stats = graph.stats();
    writeln!(
        out,
        "summary: events={} boundaries={} fires={} outputs={}",
        stats.events, stats.boundaries, stats.fires, stats.outputs
    )?;
    out.flush()?;
    Ok(stats)
}
