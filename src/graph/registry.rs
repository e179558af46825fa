//! Named graph functions, for graphs declared in configuration rather than code.

use std::collections::BTreeMap;

use serde::ser::{Serialize, SerializeMap, Serializer};
use smallvec::SmallVec;

use serde_json::Value;

use super::{node_fn, FireInput, NodeContext, NodeFn, NodeFunction};

/// Name → node function over all of a graph's sources. Starts with the built-ins.
#[derive(Clone)]
pub struct FunctionRegistry {
    functions: BTreeMap<String, NodeFunction>,
}

impl Default for FunctionRegistry {
    fn default() -> Self {
        let mut functions = BTreeMap::new();
        functions.insert("snapshot".to_string(), NodeFunction::Snapshot);
        Self { functions }
    }
}

impl FunctionRegistry {
    /// Registers a function under `name`, replacing any function of that name, a
    /// built-in included.
    pub fn register(&mut self, name: impl Into<String>, function: NodeFn) {
        self.functions
            .insert(name.into(), NodeFunction::Code(function));
    }

    pub fn get(&self, name: &str) -> Option<NodeFn> {
        self.functions.get(name).map(|f| match f {
            NodeFunction::Code(function) => function.clone(),
            NodeFunction::Snapshot => node_fn(snapshot),
        })
    }

    /// The function as a graph node runs it: a built-in keeps its own fast path.
    pub(crate) fn function(&self, name: &str) -> Option<NodeFunction> {
        self.functions.get(name).cloned()
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.functions.keys().map(String::as_str)
    }
}

/// Emits every source's current value as one record:
/// `{"graph", "fire", "degraded", "inputs": {source: value}}`, and `"key"` in a keyed
/// graph. A graph running the built-in directly encodes the record without this value
/// ([`SnapshotRecord`]); this form is for code composing it with other nodes.
async fn snapshot(ctx: NodeContext) -> super::NodeResult {
    Ok(Some(snapshot_value(ctx.fire())))
}

/// `snapshot`'s record of a fire as a JSON value.
pub(crate) fn snapshot_value(fire: &FireInput) -> Value {
    // Cannot fail: every key of the record is a string.
    serde_json::to_value(SnapshotRecord(fire)).unwrap_or(Value::Null)
}

/// `snapshot`'s record, serialized straight from a fire's inputs. Its keys come in the
/// order a JSON object value keeps them (sorted), so encoding this and encoding the
/// record built as a value give the same bytes; this way no input is copied into a new
/// tree first.
pub(crate) struct SnapshotRecord<'a>(pub &'a FireInput);

impl Serialize for SnapshotRecord<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let fire = self.0;
        let mut record = serializer.serialize_map(Some(4 + usize::from(fire.key.is_some())))?;
        record.serialize_entry("degraded", &fire.degraded)?;
        record.serialize_entry("fire", &fire.fire)?;
        record.serialize_entry("graph", &*fire.graph)?;
        record.serialize_entry("inputs", &SnapshotInputs(fire))?;
        if let Some(key) = &fire.key {
            record.serialize_entry("key", &**key)?;
        }
        record.end()
    }
}

/// Source name → value (`null` for a source that never emitted), by name: `snapshot`'s
/// `inputs`, and what a dead letter records of a fire.
pub(crate) struct SnapshotInputs<'a>(pub &'a FireInput);

impl Serialize for SnapshotInputs<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let fire = self.0;
        let mut order: SmallVec<[usize; 8]> = (0..fire.names.len()).collect();
        order.sort_unstable_by(|&a, &b| fire.names[a].cmp(&fire.names[b]));
        let mut inputs = serializer.serialize_map(Some(order.len()))?;
        for i in order {
            let value = fire
                .values
                .get(i)
                .and_then(|b| b.as_ref())
                .map(|b| &b.value);
            inputs.serialize_entry(&*fire.names[i], &value)?;
        }
        inputs.end()
    }
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
            out.value(0).as_deref(),
            Some(
                &json!({"graph": "prices", "fire": 7, "degraded": false, "inputs": {"a": {"px": 1}, "b": null}})
            )
        );
    }

    #[tokio::test]
    async fn snapshot_encodes_the_bytes_of_its_record_built_as_a_value() {
        // Sources declared out of name order, names needing escapes, and a key.
        let decl = GraphBuilder::new("g")
            .accumulator(AccumulatorSpec::passthrough("zeta"))
            .accumulator(AccumulatorSpec::passthrough("alpha"))
            .accumulator(AccumulatorSpec::passthrough("mid"))
            .function("snapshot", &FunctionRegistry::default(), "snapshot")
            .output("snapshot", "out")
            .build()
            .unwrap();
        let names: Arc<[Arc<str>]> =
            vec![Arc::from("zeta"), Arc::from("alpha"), Arc::from("mid")].into();
        let boundary = |value| {
            Some(Arc::new(crate::accumulator::Boundary {
                source: Arc::from("zeta"),
                sequence: 1,
                positions: crate::accumulator::Positions::new(),
                event_time_ms: 0,
                emit_time_ms: 0,
                value,
            }))
        };
        let values = vec![
            boundary(json!({"b": [1, 2.5, "x\n"], "a": null})),
            None,
            boundary(json!("é")),
        ];
        for key in [None, Some(crate::graph::Key::from("user\"7"))] {
            let mut input =
                FireInput::new(Arc::from("q\"uote"), 3, true, names.clone(), values.clone());
            input.key = key.clone();
            let input = Arc::new(input);
            let mut expected = json!({
                "graph": "q\"uote",
                "fire": 3,
                "degraded": true,
                "inputs": {"zeta": {"b": [1, 2.5, "x\n"], "a": null}, "alpha": null, "mid": "é"},
            });
            if let Some(key) = &key {
                expected["key"] = json!(&**key);
            }
            let out = decl.graph.run(input.clone()).await.unwrap();
            assert_eq!(
                String::from_utf8(out.encoded(0).unwrap()).unwrap(),
                expected.to_string()
            );
            assert_eq!(out.value(0).as_deref(), Some(&expected));
            // The same record through the function code composes with.
            let composed = GraphBuilder::new("composed")
                .accumulator(AccumulatorSpec::passthrough("zeta"))
                .node_with(
                    "snapshot",
                    ["zeta"],
                    FunctionRegistry::default().get("snapshot").unwrap(),
                )
                .output("snapshot", "out")
                .build()
                .unwrap();
            let out = composed.graph.run(input).await.unwrap();
            assert_eq!(out.value(0).as_deref(), Some(&expected));
        }
    }

    #[tokio::test]
    async fn a_node_reading_snapshot_sees_its_record() {
        let decl = GraphBuilder::new("g")
            .accumulator(AccumulatorSpec::passthrough("a"))
            .function("snap", &FunctionRegistry::default(), "snapshot")
            .node("fire", ["snap"], |ctx: NodeContext| async move {
                Ok(ctx.node("snap").map(|record| record["fire"].clone()))
            })
            .output("fire", "out")
            .build()
            .unwrap();
        let names: Arc<[Arc<str>]> = vec![Arc::from("a")].into();
        let input = FireInput::new(Arc::from("g"), 9, false, names, vec![None]);
        let out = decl.graph.run(Arc::new(input)).await.unwrap();
        assert_eq!(out.value(0).as_deref(), Some(&json!(9)));
        assert_eq!(out.encoded(0), Some(b"9".to_vec()));
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
