//! Admin WebSocket commands, against a running graph on the embedded backends, as the
//! operator and as a tenant.
#![no_main]

use std::sync::{Arc, OnceLock};

use libfuzzer_sys::fuzz_target;
use tokio_util::sync::CancellationToken;
use weir::admin::{AdminState, Scope};
use weir::graph::FunctionRegistry;
use weir::store::memory::MemoryStore;
use weir::transport::memory::MemoryBroker;
use weir::{AccumulatorSpec, GraphBuilder, Runtime, SupervisionPolicy, Supervisor};

struct Fixture {
    runtime: tokio::runtime::Runtime,
    state: AdminState,
}

fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        let state = runtime.block_on(async {
            let backends = Runtime {
                broker: Arc::new(MemoryBroker::default()),
                store: Arc::new(MemoryStore::new()),
                node_id: "fuzz".into(),
            };
            let supervisor = Arc::new(Supervisor::new(
                backends.clone(),
                SupervisionPolicy::default(),
                CancellationToken::new(),
            ));
            for tenant in [None, Some("acme")] {
                let mut builder = GraphBuilder::new("g")
                    .accumulator(AccumulatorSpec::passthrough("a"))
                    .function("snapshot", &FunctionRegistry::default(), "snapshot")
                    .output("snapshot", "g.out");
                if let Some(tenant) = tenant {
                    builder = builder.tenant(tenant);
                }
                supervisor
                    .spawn(builder.build().expect("the fuzz graph builds"))
                    .expect("the fuzz graph spawns");
            }
            AdminState::new()
                .with_supervisor(supervisor)
                .with_runtime(&backends)
        });
        Fixture { runtime, state }
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&who, frame)) = data.split_first() else {
        return;
    };
    let fixture = fixture();
    let scope = match who % 2 {
        0 => Scope::All,
        _ => Scope::Tenant("acme".into()),
    };
    let reply = fixture
        .runtime
        .block_on(weir::admin::ws::respond(&fixture.state, &scope, frame));
    assert!(reply.get("ok").is_some_and(|ok| ok.is_boolean()), "{reply}");
});
