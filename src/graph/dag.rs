//! Compiles a node declaration list into levels of a DAG, validating it once.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use futures::future::{join_all, BoxFuture};
use serde_json::Value;
use smallvec::SmallVec;

use super::registry::{snapshot_value, SnapshotRecord};
use super::{
    FireInput, GraphBuildError, NodeContext, NodeDecl, NodeError, NodeFunction, NodeResult,
    OutputBinding,
};

struct CompiledNode {
    name: Arc<str>,
    function: NodeFunction,
    /// Upstream node indices.
    upstream: Vec<usize>,
}

/// A graph's nodes in dependency levels; nodes of one level run concurrently.
pub struct CompiledGraph {
    nodes: Vec<CompiledNode>,
    levels: Vec<Vec<usize>>,
    /// Node index per output binding, in binding order.
    outputs: Vec<usize>,
}

/// A node's value in one fire.
#[derive(Debug)]
enum NodeValue {
    /// As the node returned it: shared only once a later node reads it, so an output
    /// node's value costs no allocation of its own.
    Owned(Value),
    Shared(Arc<Value>),
    /// The `snapshot` record of the fire's inputs, built only when something reads it.
    Snapshot,
}

impl NodeValue {
    /// The value for a later node to read, shared from now on.
    fn share(&mut self, fire: &FireInput) -> Arc<Value> {
        match self {
            Self::Owned(value) => {
                let value = Arc::new(std::mem::take(value));
                *self = Self::Shared(value.clone());
                value
            }
            Self::Shared(value) => value.clone(),
            Self::Snapshot => Arc::new(snapshot_value(fire)),
        }
    }

    fn get<'a>(&'a self, fire: &FireInput) -> Cow<'a, Value> {
        match self {
            Self::Owned(value) => Cow::Borrowed(value),
            Self::Shared(value) => Cow::Borrowed(&**value),
            Self::Snapshot => Cow::Owned(snapshot_value(fire)),
        }
    }
}

/// What one fire produced for each output binding, in binding order.
#[derive(Debug)]
pub struct FireOutputs {
    fire: Arc<FireInput>,
    values: SmallVec<[Option<NodeValue>; 2]>,
}

impl FireOutputs {
    /// The number of output bindings.
    pub fn len(&self) -> usize {
        self.values.len()
    }

    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// The JSON payload for output binding `index`; `None` when the fire routed it away.
    pub fn encoded(&self, index: usize) -> Option<Vec<u8>> {
        Some(match self.values.get(index)?.as_ref()? {
            NodeValue::Owned(value) => crate::codec::json::encode(value),
            NodeValue::Shared(value) => crate::codec::json::encode(&**value),
            NodeValue::Snapshot => crate::codec::json::encode(&SnapshotRecord(&self.fire)),
        })
    }

    /// The value of output binding `index`; `None` when the fire routed it away.
    pub fn value(&self, index: usize) -> Option<Cow<'_, Value>> {
        let value = self.values.get(index)?.as_ref()?;
        Some(value.get(&self.fire))
    }
}

/// A node failed during a fire.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("node {node} failed: {error}")]
pub struct FireError {
    pub node: String,
    pub error: NodeError,
}

impl std::fmt::Debug for CompiledGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompiledGraph")
            .field("levels", &self.level_names())
            .finish()
    }
}

impl CompiledGraph {
    pub(crate) fn compile(
        graph: &str,
        sources: &[String],
        decls: Vec<NodeDecl>,
        outputs: &[OutputBinding],
    ) -> Result<Self, GraphBuildError> {
        let g = || graph.to_string();
        if decls.is_empty() {
            return Err(GraphBuildError::NoNodes { graph: g() });
        }
        if outputs.is_empty() {
            return Err(GraphBuildError::NoOutputs { graph: g() });
        }
        let mut seen = HashSet::new();
        for name in sources.iter().chain(decls.iter().map(|d| &d.name)) {
            if !seen.insert(name.as_str()) {
                return Err(GraphBuildError::DuplicateName {
                    graph: g(),
                    name: name.clone(),
                });
            }
        }
        let index: HashMap<&str, usize> = decls
            .iter()
            .enumerate()
            .map(|(i, d)| (d.name.as_str(), i))
            .collect();
        let mut upstream = vec![Vec::new(); decls.len()];
        for (i, decl) in decls.iter().enumerate() {
            for input in &decl.inputs {
                if let Some(&j) = index.get(input.as_str()) {
                    upstream[i].push(j);
                } else if !sources.contains(input) {
                    return Err(GraphBuildError::UnknownInput {
                        graph: g(),
                        node: decl.name.clone(),
                        input: input.clone(),
                    });
                }
            }
        }
        let mut output_nodes = Vec::with_capacity(outputs.len());
        for binding in outputs {
            match index.get(binding.node.as_str()) {
                Some(&i) => output_nodes.push(i),
                None => {
                    return Err(GraphBuildError::MissingNode {
                        graph: g(),
                        node: binding.node.clone(),
                    })
                }
            }
        }
        let levels = levels(&upstream).map_err(|cycle| GraphBuildError::Cycle {
            graph: g(),
            nodes: cycle.iter().map(|&i| decls[i].name.clone()).collect(),
        })?;
        for (i, decl) in decls.iter().enumerate() {
            let read = upstream.iter().any(|ups| ups.contains(&i));
            if !read && !output_nodes.contains(&i) {
                return Err(GraphBuildError::OrphanNode {
                    graph: g(),
                    node: decl.name.clone(),
                });
            }
        }
        let nodes = decls
            .into_iter()
            .zip(upstream)
            .map(|(d, upstream)| CompiledNode {
                name: Arc::from(d.name),
                function: d.function,
                upstream,
            })
            .collect();
        Ok(Self {
            nodes,
            levels,
            outputs: output_nodes,
        })
    }

    /// Node names per level, in execution order.
    pub fn level_names(&self) -> Vec<Vec<String>> {
        self.levels
            .iter()
            .map(|l| l.iter().map(|&i| self.nodes[i].name.to_string()).collect())
            .collect()
    }

    /// Runs one fire; returns each output binding's value (`None` when routed away).
    pub async fn run(&self, fire: Arc<FireInput>) -> Result<FireOutputs, FireError> {
        // Inline: most graphs have a handful of nodes, and most levels one node.
        let mut values: SmallVec<[Option<NodeValue>; 8]> =
            (0..self.nodes.len()).map(|_| None).collect();
        for level in &self.levels {
            let mut runs: SmallVec<[(usize, BoxFuture<'static, NodeResult>); 2]> = SmallVec::new();
            for &i in level {
                let node = &self.nodes[i];
                let upstream: Vec<(Arc<str>, Arc<Value>)> = node
                    .upstream
                    .iter()
                    .filter_map(|&j| {
                        let value = values[j].as_mut()?.share(&fire);
                        Some((self.nodes[j].name.clone(), value))
                    })
                    .collect();
                // A node fed only by nodes runs when at least one of them produced output:
                // returning `None` from a node routes around its descendants.
                if !node.upstream.is_empty() && upstream.is_empty() {
                    continue;
                }
                let function = match &node.function {
                    NodeFunction::Code(function) => function,
                    NodeFunction::Snapshot => {
                        values[i] = Some(NodeValue::Snapshot);
                        continue;
                    }
                };
                let ctx = NodeContext {
                    node: node.name.clone(),
                    fire: fire.clone(),
                    upstream,
                };
                runs.push((i, function(ctx)));
            }
            if runs.len() == 1 {
                let (i, run) = runs.remove(0);
                let result = run.await;
                self.settle(&mut values, i, result)?;
            } else if !runs.is_empty() {
                let (ids, futures): (Vec<usize>, Vec<_>) = runs.into_iter().unzip();
                for (i, result) in ids.into_iter().zip(join_all(futures).await) {
                    self.settle(&mut values, i, result)?;
                }
            }
        }
        // A node bound to several outputs is shared among them; otherwise each output
        // takes its node's value as it is.
        let values = self
            .outputs
            .iter()
            .enumerate()
            .map(|(k, &i)| {
                if self.outputs[k + 1..].contains(&i) {
                    values[i].as_mut().map(|v| match v {
                        NodeValue::Snapshot => NodeValue::Snapshot,
                        v => NodeValue::Shared(v.share(&fire)),
                    })
                } else {
                    values[i].take()
                }
            })
            .collect();
        Ok(FireOutputs { fire, values })
    }

    /// Keeps node `i`'s value for the nodes after it, or ends the fire with its error.
    fn settle(
        &self,
        values: &mut [Option<NodeValue>],
        i: usize,
        result: NodeResult,
    ) -> Result<(), FireError> {
        match result {
            Ok(value) => {
                values[i] = value.map(NodeValue::Owned);
                Ok(())
            }
            Err(error) => Err(FireError {
                node: self.nodes[i].name.to_string(),
                error,
            }),
        }
    }
}

/// Kahn's algorithm by layers; on a cycle returns the nodes of one cycle in order.
fn levels(upstream: &[Vec<usize>]) -> Result<Vec<Vec<usize>>, Vec<usize>> {
    let n = upstream.len();
    let mut remaining: Vec<usize> = upstream.iter().map(Vec::len).collect();
    let mut downstream = vec![Vec::new(); n];
    for (i, ups) in upstream.iter().enumerate() {
        for &j in ups {
            downstream[j].push(i);
        }
    }
    let mut done = vec![false; n];
    let mut levels = Vec::new();
    let mut current: Vec<usize> = (0..n).filter(|&i| remaining[i] == 0).collect();
    while !current.is_empty() {
        let mut next = Vec::new();
        for &i in &current {
            done[i] = true;
            for &d in &downstream[i] {
                remaining[d] -= 1;
                if remaining[d] == 0 {
                    next.push(d);
                }
            }
        }
        levels.push(std::mem::take(&mut current));
        current = next;
    }
    if let Some(start) = (0..n).find(|&i| !done[i]) {
        // Every unfinished node has an unfinished upstream, so walking upstream from any
        // of them must revisit a node: that loop is a cycle.
        let mut path = vec![start];
        let mut at = start;
        while let Some(&up) = upstream[at].iter().find(|&&j| !done[j]) {
            if let Some(pos) = path.iter().position(|&p| p == up) {
                let mut cycle = path.split_off(pos);
                cycle.reverse();
                cycle.push(cycle[0]);
                return Err(cycle);
            }
            path.push(up);
            at = up;
        }
        return Err(path);
    }
    Ok(levels)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::accumulator::AccumulatorSpec;
    use crate::graph::GraphBuilder;
    use serde_json::json;

    fn base() -> GraphBuilder {
        GraphBuilder::new("g")
            .accumulator(AccumulatorSpec::passthrough("a"))
            .accumulator(AccumulatorSpec::passthrough("b"))
    }

    async fn echo(ctx: NodeContext) -> super::super::NodeResult {
        Ok(ctx.source("a").cloned())
    }

    #[test]
    fn cycles_are_rejected_with_their_path() {
        let err = base()
            .node("x", ["a", "z"], echo)
            .node("y", ["x"], echo)
            .node("z", ["y"], echo)
            .output("z", "out")
            .build()
            .unwrap_err();
        match &err {
            GraphBuildError::Cycle { nodes, .. } => {
                assert_eq!(nodes.first(), nodes.last());
                assert_eq!(nodes.len(), 4, "{nodes:?}");
            }
            other => panic!("expected a cycle, got {other}"),
        }
        assert!(err.to_string().contains("cycle through nodes"));
    }

    #[test]
    fn unknown_inputs_missing_and_orphan_nodes_are_rejected() {
        let err = base().node("x", ["nope"], echo).output("x", "o").build();
        assert!(
            matches!(err, Err(GraphBuildError::UnknownInput { ref input, .. }) if input == "nope")
        );

        let err = base().node("x", ["a"], echo).output("ghost", "o").build();
        assert!(
            matches!(err, Err(GraphBuildError::MissingNode { ref node, .. }) if node == "ghost")
        );

        let err = base()
            .node("x", ["a"], echo)
            .node("lonely", ["b"], echo)
            .output("x", "o")
            .build();
        assert!(
            matches!(err, Err(GraphBuildError::OrphanNode { ref node, .. }) if node == "lonely")
        );

        let err = base().node("a", ["b"], echo).output("a", "o").build();
        assert!(matches!(err, Err(GraphBuildError::DuplicateName { .. })));

        let err = GraphBuilder::new("g")
            .node("x", ["a"], echo)
            .output("x", "o")
            .build();
        assert!(matches!(err, Err(GraphBuildError::NoAccumulators { .. })));

        let err = base().node("x", ["a"], echo).build();
        assert!(matches!(err, Err(GraphBuildError::NoOutputs { .. })));

        let err = GraphBuilder::new("bad name")
            .accumulator(AccumulatorSpec::passthrough("a"))
            .build();
        assert!(matches!(err, Err(GraphBuildError::BadName(_))));
    }

    #[test]
    fn levels_follow_dependencies() {
        let decl = base()
            .node("left", ["a"], echo)
            .node("right", ["b"], echo)
            .node("join", ["left", "right"], echo)
            .output("join", "o")
            .build()
            .unwrap();
        assert_eq!(
            decl.graph.level_names(),
            vec![
                vec!["left".to_string(), "right".to_string()],
                vec!["join".to_string()]
            ]
        );
    }

    fn fire_input(a: i64) -> Arc<FireInput> {
        let names: Arc<[Arc<str>]> = vec![Arc::from("a"), Arc::from("b")].into();
        let boundary = crate::accumulator::Boundary {
            source: Arc::from("a"),
            sequence: 1,
            positions: crate::accumulator::Positions::new(),
            event_time_ms: 0,
            emit_time_ms: 0,
            value: json!(a),
        };
        Arc::new(FireInput::new(
            Arc::from("g"),
            1,
            false,
            names,
            vec![Some(Arc::new(boundary)), None],
        ))
    }

    #[tokio::test]
    async fn independent_branches_run_concurrently() {
        // Each branch waits for the other to start: only a concurrent run finishes.
        let barrier = Arc::new(tokio::sync::Barrier::new(2));
        let (b1, b2) = (barrier.clone(), barrier.clone());
        let decl = base()
            .node("left", ["a"], move |_ctx| {
                let b = b1.clone();
                async move {
                    b.wait().await;
                    Ok(Some(json!("l")))
                }
            })
            .node("right", ["b"], move |_ctx| {
                let b = b2.clone();
                async move {
                    b.wait().await;
                    Ok(Some(json!("r")))
                }
            })
            .node("join", ["left", "right"], |ctx: NodeContext| async move {
                Ok(Some(json!([ctx.node("left"), ctx.node("right")])))
            })
            .output("join", "o")
            .build()
            .unwrap();
        let out = tokio::time::timeout(
            std::time::Duration::from_secs(5),
            decl.graph.run(fire_input(1)),
        )
        .await
        .expect("branches ran concurrently")
        .unwrap();
        assert_eq!(out.value(0).as_deref(), Some(&json!(["l", "r"])));
    }

    #[tokio::test]
    async fn none_routes_around_descendants_and_errors_name_the_node() {
        let decl = base()
            .node("gate", ["a"], |ctx: NodeContext| async move {
                let a: i64 = ctx.get("a")?.unwrap_or(0);
                Ok((a > 10).then(|| json!(a)))
            })
            .node("after", ["gate"], |ctx: NodeContext| async move {
                let v: i64 = ctx.get("gate")?.unwrap_or(0);
                if v > 100 {
                    return Err(NodeError::new("too big"));
                }
                Ok(Some(json!(v * 2)))
            })
            .output("after", "o")
            .build()
            .unwrap();
        assert_eq!(decl.graph.run(fire_input(5)).await.unwrap().value(0), None);
        assert_eq!(
            decl.graph
                .run(fire_input(20))
                .await
                .unwrap()
                .value(0)
                .as_deref(),
            Some(&json!(40))
        );
        let err = decl.graph.run(fire_input(200)).await.unwrap_err();
        assert_eq!(err.node, "after");
        assert_eq!(err.to_string(), "node after failed: too big");
    }
}
