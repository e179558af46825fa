//! The README's quick start: a graph declared in Rust, on the embedded default.

use std::sync::Arc;

use serde_json::json;
use tokio_util::sync::CancellationToken;
use weir::transport::memory::MemoryBroker;
use weir::transport::{Broker, Subscription};
use weir::{
    AccumulatorSpec, Criteria, GraphBuilder, NodeContext, ReactorState, Runtime, Strategy,
    SupervisionPolicy, Supervisor,
};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let graph = GraphBuilder::new("spread")
        .accumulator(AccumulatorSpec::passthrough("bid").topic("quotes.bid"))
        .accumulator(AccumulatorSpec::passthrough("ask").topic("quotes.ask"))
        .criteria(Criteria::WhenAll) // fire once both sides moved
        .strategy(Strategy::Latest) // newest value per source
        .node("spread", ["bid", "ask"], |ctx: NodeContext| async move {
            let bid: f64 = ctx.get("bid")?.unwrap_or_default();
            let ask: f64 = ctx.get("ask")?.unwrap_or_default();
            Ok(Some(json!({ "spread": ask - bid })))
        })
        .output("spread", "quotes.spread")
        .build()?; // cycles, orphans, unknown inputs: errors here

    let broker = MemoryBroker::default();
    let runtime = Runtime {
        broker: Arc::new(broker.clone()),
        ..Runtime::embedded()
    };
    let supervisor = Supervisor::new(
        runtime,
        SupervisionPolicy::default(),
        CancellationToken::new(),
    );
    let handle = supervisor.spawn(graph)?;
    handle.wait_for_state(ReactorState::Live).await;
    handle.push("bid", json!(1.0841)).await?; // the socket path, in process
    handle.push("ask", json!(1.0843)).await?;

    let mut outputs = broker
        .subscribe(&Subscription::new("quotes.spread", "readme"))
        .await?;
    let message = outputs.next().await?;
    println!("{}", String::from_utf8_lossy(&message.payload)); // {"spread":0.000199...}
    supervisor.shutdown().await;
    Ok(())
}
