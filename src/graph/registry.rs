//! Named graph functions, for graphs declared in configuration rather than code.

use std::collections::BTreeMap;

use serde_json::{Map, Value};

use super::{node_fn, NodeContext, NodeFn};

/// Name → node function over all of a graph's sources. Starts with the built-ins.
#[derive(Clone)]
pub struct FunctionRegistry {
    functions: BTreeMap<String, NodeFn>,
}

impl Default for FunctionRegistry {
    fn default() -> Self {
        let mut registry = Self {
            functions: BTreeMap::new(),
        };
        registry.register("snapshot", node_fn(snapshot));
        registry
    }
}

impl FunctionRegistry {
    pub fn register(&mut self, name: impl Into<String>, function: NodeFn) {
        self.functions.insert(name.into(), function);
    }

    pub fn get(&self, name: &str) -> Option<NodeFn> {
        self.functions.get(name).cloned()
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.functions.keys().map(String::as_str)
    }
}

/// Emits every source's current value as one record:
/// `{"graph", "fire", "degraded", "inputs": {source: value}}`, and `"key"` in a keyed
/// graph.
async fn snapshot(ctx: NodeContext) -> super::NodeResult {
    let fire = ctx.fire();
    // Built field by field: `json!` would copy the inputs once more through a serializer.
    let mut record = Map::with_capacity(5);
    record.insert("graph".into(), Value::String(fire.graph.to_string()));
    record.insert("fire".into(), Value::from(fire.fire));
    record.insert("degraded".into(), Value::Bool(fire.degraded));
    record.insert("inputs".into(), fire.inputs_json());
    if let Some(key) = &fire.key {
        record.insert("key".into(), Value::String(key.to_string()));
    }
    Ok(Some(Value::Object(record)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::accumulator::AccumulatorSpec;
    use crate::graph::{FireInput, GraphBuildError, GraphBuilder};
    use serde_json::json;
    use std::sync::Arc;

    #[tokio::test]
    async fn snapshot_emits_every_source() {
        let registry = FunctionRegistry::default();
        let decl = GraphBuilder::new("prices")
            .accumulator(AccumulatorSpec::passthrough("a"))
            .accumulator(AccumulatorSpec::passthrough("b"))
            .function("snapshot", &registry, "snapshot")
            .output("snapshot", "prices.out")
            .build()
            .unwrap();
        let names: Arc<[Arc<str>]> = vec![Arc::from("a"), Arc::from("b")].into();
        let a = crate::accumulator::Boundary {
            source: Arc::from("a"),
            sequence: 1,
            positions: crate::accumulator::Positions::new(),
            event_time_ms: 0,
            emit_time_ms: 0,
            value: json!({"px": 1}),
        };
        let input = FireInput::new(
            Arc::from("prices"),
            7,
            false,
            names,
            vec![Some(Arc::new(a)), None],
        );
        let out = decl.graph.run(Arc::new(input)).await.unwrap();
        assert_eq!(
            out[0].as_deref(),
            Some(
                &json!({"graph": "prices", "fire": 7, "degraded": false, "inputs": {"a": {"px": 1}, "b": null}})
            )
        );
    }

    #[test]
    fn unknown_functions_are_build_errors() {
        let err = GraphBuilder::new("g")
            .accumulator(AccumulatorSpec::passthrough("a"))
            .function("n", &FunctionRegistry::default(), "nope")
            .output("n", "o")
            .build()
            .unwrap_err();
        assert!(matches!(err, GraphBuildError::UnknownFunction { .. }));
    }
}
