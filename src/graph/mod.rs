//! Computation graphs: declaration ([`GraphBuilder`]), compilation and validation of the
//! node DAG ([`dag`]), and named graph functions for config-only use ([`registry`]).

pub mod dag;
pub mod firing;
pub mod registry;

use std::future::Future;
use std::sync::Arc;

use futures::future::BoxFuture;
use serde::de::DeserializeOwned;
use serde_json::Value;
use smallvec::SmallVec;

use crate::accumulator::{AccumulatorSpec, Boundary, SourceSpec};
use crate::transport::Sink;

pub use dag::CompiledGraph;
pub use firing::{Criteria, ReactorConfig, Strategy};
pub use registry::FunctionRegistry;

/// A keyed graph's key, as its events give it. A key of up to 23 bytes, as most are, is
/// held inline: copying it, as each of the key's fires and outputs does, is a copy of a
/// few words, not a shared count kept on memory of the key's own.
pub type Key = smol_str::SmolStr;

/// Everything one fire sees: the graph, the fire sequence number, whether the reactor
/// is degraded, and per source the cached boundary (if the source ever emitted).
#[derive(Debug)]
pub struct FireInput {
    pub graph: Arc<str>,
    pub fire: u64,
    pub degraded: bool,
    /// The key fired for, in a keyed graph.
    pub key: Option<Key>,
    pub(crate) names: Arc<[Arc<str>]>,
    pub(crate) values: FireValues,
}

/// Per source, in declaration order, the boundary a fire sees (`None` before the first).
/// Inline: a graph has a handful of sources.
pub type FireValues = SmallVec<[Option<Arc<Boundary>>; 4]>;

impl FireInput {
    pub fn new(
        graph: Arc<str>,
        fire: u64,
        degraded: bool,
        names: Arc<[Arc<str>]>,
        values: impl Into<FireValues>,
    ) -> Self {
        Self {
            graph,
            fire,
            degraded,
            key: None,
            names,
            values: values.into(),
        }
    }

    /// The same input, fired for one key of a keyed graph.
    pub fn with_key(mut self, key: Key) -> Self {
        self.key = Some(key);
        self
    }

    /// The cached boundary of a source.
    pub fn boundary(&self, source: &str) -> Option<&Boundary> {
        let i = self.names.iter().position(|n| same_name(n, source))?;
        self.values[i].as_deref()
    }

    pub fn value(&self, source: &str) -> Option<&Value> {
        self.boundary(source).map(|b| &b.value)
    }

    /// Source name → value (`null` for a source that never emitted).
    pub fn inputs_json(&self) -> Value {
        // Cannot fail: every key is a source name.
        serde_json::to_value(registry::SnapshotInputs(self)).unwrap_or(Value::Null)
    }
}

/// Whether two source names are the same. Names are short, and a node looks its inputs
/// up on every fire: compared byte by byte in place, not through a call to `memcmp`.
fn same_name(a: &str, b: &str) -> bool {
    a.len() == b.len() && a.bytes().zip(b.bytes()).all(|(x, y)| x == y)
}

/// What a node function receives: the fire's inputs and its upstream nodes' outputs.
pub struct NodeContext {
    node: Arc<str>,
    fire: Arc<FireInput>,
    upstream: Vec<(Arc<str>, Arc<Value>)>,
}

impl NodeContext {
    pub fn fire(&self) -> &FireInput {
        &self.fire
    }

    /// The current value of a source.
    pub fn source(&self, name: &str) -> Option<&Value> {
        self.fire.value(name)
    }

    /// The output of an upstream node, if it produced one this fire.
    pub fn node(&self, name: &str) -> Option<&Value> {
        self.upstream
            .iter()
            .find(|(n, _)| &**n == name)
            .map(|(_, v)| &**v)
    }

    /// A source or upstream node value, deserialized.
    pub fn get<T: DeserializeOwned>(&self, name: &str) -> Result<Option<T>, NodeError> {
        let Some(value) = self.node(name).or_else(|| self.source(name)) else {
            return Ok(None);
        };
        T::deserialize(value).map(Some).map_err(|e| {
            NodeError::new(format!(
                "input {name} of node {} has the wrong shape: {e}",
                self.node
            ))
        })
    }
}

/// A node function's failure. The fire is counted as failed; the graph keeps running.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{0}")]
pub struct NodeError(pub String);

impl NodeError {
    pub fn new(message: impl Into<String>) -> Self {
        Self(message.into())
    }
}

/// Output of a node: `None` routes nothing downstream for this fire.
pub type NodeResult = Result<Option<Value>, NodeError>;
pub type NodeFn = Arc<dyn Fn(NodeContext) -> BoxFuture<'static, NodeResult> + Send + Sync>;

/// Wraps an async closure as a node function.
pub fn node_fn<F, Fut>(f: F) -> NodeFn
where
    F: Fn(NodeContext) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = NodeResult> + Send + 'static,
{
    Arc::new(move |ctx| Box::pin(f(ctx)))
}

/// How a node computes its value.
#[derive(Clone)]
pub(crate) enum NodeFunction {
    /// A function of the node's context.
    Code(NodeFn),
    /// The built-in `snapshot`: a record of every source, encoded straight from the
    /// fire's inputs when it is published, and built as a value only for a node that
    /// reads it.
    Snapshot,
}

pub(crate) struct NodeDecl {
    pub name: String,
    pub inputs: Vec<String>,
    pub function: NodeFunction,
}

/// Where a node's output is published.
#[derive(Clone)]
pub struct OutputBinding {
    pub node: String,
    pub topic: String,
    /// Publish through this sink instead of the runtime's broker.
    pub sink: Option<Arc<dyn Sink>>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GraphBuildError {
    #[error(
        "graph name must be non-empty and contain only letters, digits, '.', '_' and '-': {0:?}"
    )]
    BadName(String),
    #[error("graph {graph} declares no accumulators")]
    NoAccumulators { graph: String },
    #[error("graph {graph} declares no nodes")]
    NoNodes { graph: String },
    #[error("graph {graph} publishes no output")]
    NoOutputs { graph: String },
    #[error("graph {graph}: the name {name} is declared twice")]
    DuplicateName { graph: String, name: String },
    #[error("graph {graph}: node {node} reads {input}, which is neither a source nor a node")]
    UnknownInput {
        graph: String,
        node: String,
        input: String,
    },
    #[error("graph {graph}: output bound to missing node {node}")]
    MissingNode { graph: String, node: String },
    #[error("graph {graph}: node {node} is an orphan: no output and no node reads it")]
    OrphanNode { graph: String, node: String },
    #[error("graph {graph}: cycle through nodes {}", nodes.join(" -> "))]
    Cycle { graph: String, nodes: Vec<String> },
    #[error("graph {graph}: unknown graph function {function}")]
    UnknownFunction { graph: String, function: String },
    #[error("graph {graph}: {reason}")]
    BadReactor { graph: String, reason: String },
}

impl std::fmt::Debug for OutputBinding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutputBinding")
            .field("node", &self.node)
            .field("topic", &self.topic)
            .finish()
    }
}

/// A validated, compiled graph ready for the supervisor.
#[derive(Clone, Debug)]
pub struct GraphDeclaration {
    pub name: String,
    pub tenant: Option<String>,
    pub accumulators: Vec<AccumulatorSpec>,
    pub reactor: ReactorConfig,
    pub graph: Arc<CompiledGraph>,
    pub outputs: Vec<OutputBinding>,
    /// Set for a keyed graph: one reactor state per key, run by every node over the
    /// partitions it owns.
    pub keyed: Option<Keying>,
}

/// Where a keyed graph finds each event's key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    /// The broker message key (on NATS, the `weir-key` header).
    MessageKey,
    /// A JSON pointer into the event (`/user`); a string is the key as it is, any other
    /// value its JSON text.
    Pointer(KeyPointer),
}

impl KeySource {
    /// `message_key`, or a JSON pointer starting with `/`.
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "message_key" => Some(Self::MessageKey),
            pointer if pointer.starts_with('/') => Some(Self::Pointer(pointer.into())),
            _ => None,
        }
    }
}

/// A JSON pointer (RFC 6901) split into its reference tokens once, so that looking up
/// every event's key unescapes nothing and allocates nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyPointer {
    text: String,
    tokens: Vec<String>,
}

impl KeyPointer {
    /// The value the pointer refers to in `value`, as [`Value::pointer`] finds it.
    pub fn find<'v>(&self, value: &'v Value) -> Option<&'v Value> {
        if self.text.is_empty() {
            return Some(value);
        }
        if !self.text.starts_with('/') {
            return None;
        }
        self.tokens
            .iter()
            .try_fold(value, |target, token| match target {
                Value::Object(map) => map.get(token),
                Value::Array(items) => array_index(token).and_then(|i| items.get(i)),
                _ => None,
            })
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }
}

/// An array index as a pointer writes it: digits without a sign or a leading zero.
fn array_index(token: &str) -> Option<usize> {
    if token.starts_with('+') || (token.starts_with('0') && token.len() != 1) {
        return None;
    }
    token.parse().ok()
}

impl From<&str> for KeyPointer {
    fn from(text: &str) -> Self {
        let tokens = text
            .split('/')
            .skip(1)
            .map(|token| token.replace("~1", "/").replace("~0", "~"))
            .collect();
        Self {
            text: text.to_string(),
            tokens,
        }
    }
}

impl From<String> for KeyPointer {
    fn from(text: String) -> Self {
        Self::from(text.as_str())
    }
}

impl std::fmt::Display for KeyPointer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

/// How a keyed graph is split.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keying {
    pub key: KeySource,
    /// Partitions per source where weir makes them (NATS subjects, topics it creates);
    /// a Kafka topic that exists keeps its own count.
    pub partitions: u32,
    /// Keys kept in memory per owned partition, at most; the least recently used leave first
    /// (their state stays in the store).
    pub max_keys_in_memory: usize,
    /// Lease TTL of each partition: how long a dead node's partitions wait.
    pub lease_ttl: std::time::Duration,
    /// A key's state is removed once its partition has applied a message this much newer
    /// (in the broker's message times) than the key's last one; `None` keeps every key.
    pub key_idle: Option<std::time::Duration>,
}

impl Keying {
    pub fn new(key: KeySource) -> Self {
        Self {
            key,
            partitions: 6,
            max_keys_in_memory: 100_000,
            lease_ttl: std::time::Duration::from_secs(6),
            key_idle: None,
        }
    }
}

impl GraphDeclaration {
    /// The graph's identity in the store and on the broker: `tenant/name`, or `name`.
    pub fn key(&self) -> String {
        crate::tenant::key(self.tenant.as_deref(), &self.name)
    }

    /// A topic as this graph sees it: tenants get their own prefix.
    pub fn qualify_topic(&self, topic: &str) -> String {
        crate::tenant::topic(self.tenant.as_deref(), topic)
    }

    /// The consumer group the `index`-th accumulator reads its topic under: the graph's,
    /// `weir.<graph>`. Two accumulators reading one topic each read all of it, so each
    /// has a group of its own, `weir.<graph>.<accumulator>`: under one group they would
    /// share its messages (and, on NATS, its durable).
    pub fn source_group(&self, index: usize) -> String {
        let group = format!("weir.{}", self.key().replace('/', "."));
        let Some(spec) = self.accumulators.get(index) else {
            return group;
        };
        let SourceSpec::Topic { topic, .. } = &spec.source else {
            return group;
        };
        let readers = self
            .accumulators
            .iter()
            .filter(
                |other| matches!(&other.source, SourceSpec::Topic { topic: t, .. } if t == topic),
            )
            .count();
        if readers > 1 {
            format!("{group}.{}", spec.name)
        } else {
            group
        }
    }
}

/// Declares a graph: accumulators, reactor, node DAG, outputs.
///
/// ```
/// use weir::graph::{GraphBuilder, NodeContext};
/// use weir::accumulator::AccumulatorSpec;
/// use weir::reactor::Criteria;
///
/// let graph = GraphBuilder::new("spread")
///     .accumulator(AccumulatorSpec::passthrough("bid"))
///     .accumulator(AccumulatorSpec::passthrough("ask"))
///     .criteria(Criteria::WhenAll)
///     .node("spread", ["bid", "ask"], |ctx: NodeContext| async move {
///         let bid = ctx.get::<f64>("bid")?.unwrap_or_default();
///         let ask = ctx.get::<f64>("ask")?.unwrap_or_default();
///         Ok(Some(serde_json::json!(ask - bid)))
///     })
///     .output("spread", "spreads")
///     .build()
///     .unwrap();
/// assert_eq!(graph.name, "spread");
/// ```
pub struct GraphBuilder {
    name: String,
    tenant: Option<String>,
    accumulators: Vec<AccumulatorSpec>,
    reactor: ReactorConfig,
    nodes: Vec<NodeDecl>,
    outputs: Vec<OutputBinding>,
    function_error: Option<GraphBuildError>,
    keyed: Option<Keying>,
}

impl GraphBuilder {
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            tenant: None,
            accumulators: Vec::new(),
            reactor: ReactorConfig::default(),
            nodes: Vec::new(),
            outputs: Vec::new(),
            function_error: None,
            keyed: None,
        }
    }

    /// Makes the graph keyed: one reactor state per key, fired per key.
    pub fn keyed(mut self, keying: Keying) -> Self {
        self.keyed = Some(keying);
        self
    }

    pub fn tenant(mut self, tenant: impl Into<String>) -> Self {
        self.tenant = Some(tenant.into());
        self
    }

    pub fn accumulator(mut self, spec: AccumulatorSpec) -> Self {
        self.accumulators.push(spec);
        self
    }

    pub fn criteria(mut self, criteria: Criteria) -> Self {
        self.reactor.criteria = criteria;
        self
    }

    pub fn strategy(mut self, strategy: Strategy) -> Self {
        self.reactor.strategy = strategy;
        self
    }

    /// All reactor settings at once.
    pub fn reactor(mut self, config: ReactorConfig) -> Self {
        self.reactor = config;
        self
    }

    /// A node reading sources and/or other nodes by name.
    pub fn node<I, S, F, Fut>(self, name: impl Into<String>, inputs: I, f: F) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
        F: Fn(NodeContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = NodeResult> + Send + 'static,
    {
        self.node_with(name, inputs, node_fn(f))
    }

    pub fn node_with<I, S>(self, name: impl Into<String>, inputs: I, function: NodeFn) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.declare_node(name, inputs, NodeFunction::Code(function))
    }

    fn declare_node<I, S>(
        mut self,
        name: impl Into<String>,
        inputs: I,
        function: NodeFunction,
    ) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.nodes.push(NodeDecl {
            name: name.into(),
            inputs: inputs.into_iter().map(Into::into).collect(),
            function,
        });
        self
    }

    /// A node running a registered graph function over every declared source.
    pub fn function(
        mut self,
        node: impl Into<String>,
        registry: &FunctionRegistry,
        function: &str,
    ) -> Self {
        match registry.function(function) {
            Some(f) => {
                let sources: Vec<String> =
                    self.accumulators.iter().map(|a| a.name.clone()).collect();
                self.declare_node(node, sources, f)
            }
            None => {
                self.function_error = Some(GraphBuildError::UnknownFunction {
                    graph: self.name.clone(),
                    function: function.to_string(),
                });
                self
            }
        }
    }

    /// Publishes a node's output to a topic of the runtime's broker.
    pub fn output(mut self, node: impl Into<String>, topic: impl Into<String>) -> Self {
        self.outputs.push(OutputBinding {
            node: node.into(),
            topic: topic.into(),
            sink: None,
        });
        self
    }

    /// Publishes a node's output through a given sink.
    pub fn output_to(
        mut self,
        node: impl Into<String>,
        topic: impl Into<String>,
        sink: Arc<dyn Sink>,
    ) -> Self {
        self.outputs.push(OutputBinding {
            node: node.into(),
            topic: topic.into(),
            sink: Some(sink),
        });
        self
    }

    /// Validates and compiles.
    pub fn build(self) -> Result<GraphDeclaration, GraphBuildError> {
        if let Some(e) = self.function_error {
            return Err(e);
        }
        let valid_name = |s: &str| {
            !s.is_empty()
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
        };
        if !valid_name(&self.name) {
            return Err(GraphBuildError::BadName(self.name));
        }
        if let Some(t) = &self.tenant {
            if !valid_name(t) {
                return Err(GraphBuildError::BadName(t.clone()));
            }
        }
        if self.accumulators.is_empty() {
            return Err(GraphBuildError::NoAccumulators { graph: self.name });
        }
        if self.reactor.queue_capacity == 0 || self.reactor.max_in_flight == 0 {
            return Err(GraphBuildError::BadReactor {
                graph: self.name,
                reason: "queue_capacity and max_in_flight must be at least 1".into(),
            });
        }
        if self.keyed.is_some() {
            if let Some(a) = self
                .accumulators
                .iter()
                .find(|a| a.kind != "passthrough" || !matches!(a.source, SourceSpec::Topic { .. }))
            {
                return Err(GraphBuildError::BadReactor {
                    graph: self.name,
                    reason: format!(
                        "a keyed graph reads topics through passthrough accumulators; {} is {} {}",
                        a.name,
                        a.kind,
                        match a.source {
                            SourceSpec::Topic { .. } => "on a topic",
                            _ => "without a topic",
                        }
                    ),
                });
            }
        }
        let sources: Vec<String> = self.accumulators.iter().map(|a| a.name.clone()).collect();
        let graph = CompiledGraph::compile(&self.name, &sources, self.nodes, &self.outputs)?;
        Ok(GraphDeclaration {
            name: self.name,
            tenant: self.tenant,
            accumulators: self.accumulators,
            reactor: self.reactor,
            graph: Arc::new(graph),
            outputs: self.outputs,
            keyed: self.keyed,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_pointers_find_what_serde_json_pointers_find() {
        let event = serde_json::json!({
            "user": "ann",
            "a/b": 1,
            "m~n": 2,
            "": {"": 3},
            "list": [10, 11, {"id": "x"}],
            "nested": {"id": 4, "null": null},
        });
        let pointers = [
            "",
            "/",
            "/user",
            "/a~1b",
            "/m~0n",
            "//",
            "/list/0",
            "/list/2/id",
            "/list/01",
            "/list/+1",
            "/list/3",
            "/list/-",
            "/nested/id",
            "/nested/null",
            "/missing",
            "/user/deeper",
            "user",
        ];
        for text in pointers {
            let pointer = KeyPointer::from(text);
            assert_eq!(
                pointer.find(&event),
                event.pointer(text),
                "pointer {text:?}"
            );
            assert_eq!(pointer.to_string(), text);
        }
    }

    fn declare(tenant: Option<&str>, sources: &[(&str, &str)]) -> GraphDeclaration {
        let mut builder = GraphBuilder::new("g");
        if let Some(tenant) = tenant {
            builder = builder.tenant(tenant);
        }
        for (name, topic) in sources {
            builder = builder.accumulator(AccumulatorSpec::passthrough(*name).topic(*topic));
        }
        builder
            .function("snapshot", &FunctionRegistry::default(), "snapshot")
            .output("snapshot", "out")
            .build()
            .unwrap()
    }

    #[test]
    fn sources_read_under_the_graphs_group_unless_they_share_a_topic() {
        let decl = declare(None, &[("a", "x"), ("b", "y")]);
        assert_eq!(decl.source_group(0), "weir.g");
        assert_eq!(decl.source_group(1), "weir.g");
        let decl = declare(None, &[("a", "x"), ("b", "x"), ("c", "y")]);
        assert_eq!(decl.source_group(0), "weir.g.a");
        assert_eq!(decl.source_group(1), "weir.g.b");
        assert_eq!(decl.source_group(2), "weir.g");
        let decl = declare(Some("t"), &[("a", "x")]);
        assert_eq!(decl.source_group(0), "weir.t.g");
    }
}
