//! Ordered glob rules from task namespaces to executor keys. A namespace is `::`
//! separated segments; in a pattern `*` matches exactly one segment, `**` any number of
//! segments (zero included), anything else matches its segment literally. The first rule
//! that matches wins; no match goes to the default executor. An executor key `k` is the
//! topic or subject `weir.tasks.k`.

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid route pattern {pattern:?}: {reason}")]
pub struct RouteError {
    pub pattern: String,
    pub reason: String,
}

impl RouteError {
    /// A bad pattern stays bad.
    pub fn is_retryable(&self) -> bool {
        false
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Literal(String),
    One,
    Any,
}

/// One rule: a pattern and the executor its matches go to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    pattern: String,
    segments: Vec<Segment>,
    executor: String,
}

impl Route {
    pub fn new(pattern: &str, executor: &str) -> Result<Self, RouteError> {
        let err = |reason: &str| RouteError {
            pattern: pattern.to_string(),
            reason: reason.to_string(),
        };
        if pattern.trim().is_empty() {
            return Err(err("empty pattern"));
        }
        validate_executor(executor).map_err(|reason| err(&reason))?;
        let segments = pattern
            .split("::")
            .map(|s| match s {
                "" => Err(err("empty segment (a ':::' or a leading or trailing '::')")),
                "*" => Ok(Segment::One),
                "**" => Ok(Segment::Any),
                s if s.contains('*') => Err(err("'*' must be a whole segment: '*' or '**'")),
                s if s.contains(':') || s.chars().any(char::is_whitespace) => {
                    Err(err("a segment holds no ':' and no whitespace"))
                }
                s => Ok(Segment::Literal(s.to_string())),
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            pattern: pattern.to_string(),
            segments,
            executor: executor.to_string(),
        })
    }

    pub fn pattern(&self) -> &str {
        &self.pattern
    }

    pub fn executor(&self) -> &str {
        &self.executor
    }

    pub fn matches(&self, namespace: &str) -> bool {
        let parts: Vec<&str> = namespace.split("::").collect();
        matches(&self.segments, &parts)
    }
}

fn matches(pattern: &[Segment], parts: &[&str]) -> bool {
    match pattern.split_first() {
        None => parts.is_empty(),
        Some((Segment::Any, rest)) => (0..=parts.len()).any(|skip| matches(rest, &parts[skip..])),
        Some((Segment::One, rest)) => !parts.is_empty() && matches(rest, &parts[1..]),
        Some((Segment::Literal(l), rest)) => {
            parts.first() == Some(&l.as_str()) && matches(rest, &parts[1..])
        }
    }
}

fn validate_executor(key: &str) -> Result<(), String> {
    let ok = !key.is_empty()
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "executor key {key:?} must be letters, digits, '-' or '_' (it names the topic weir.tasks.<key>)"
        ))
    }
}

/// The executor of namespaces no route matches, unless configured otherwise.
pub const DEFAULT_EXECUTOR: &str = "default";

/// Ordered rules plus the default executor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Router {
    routes: Vec<Route>,
    default: String,
}

impl Router {
    pub fn new(routes: Vec<Route>, default: &str) -> Result<Self, RouteError> {
        validate_executor(default).map_err(|reason| RouteError {
            pattern: "(default)".into(),
            reason,
        })?;
        Ok(Self {
            routes,
            default: default.to_string(),
        })
    }

    /// The executor key for a namespace: the first matching rule's, else the default.
    pub fn executor(&self, namespace: &str) -> &str {
        self.routes
            .iter()
            .find(|r| r.matches(namespace))
            .map(Route::executor)
            .unwrap_or(&self.default)
    }

    /// The topic or subject the namespace's TaskReadyEvents go to.
    pub fn topic(&self, namespace: &str) -> String {
        executor_topic(self.executor(namespace))
    }
}

pub use crate::wire::executor_topic;

#[cfg(test)]
mod tests {
    use super::*;

    fn router() -> Router {
        Router::new(
            vec![
                Route::new("acme::billing::*::charge", "payments").unwrap(),
                Route::new("acme::ml::**", "gpu").unwrap(),
                Route::new("*::etl::nightly::*", "batch").unwrap(),
                Route::new("**::notify", "email").unwrap(),
            ],
            "default",
        )
        .unwrap()
    }

    #[test]
    fn first_match_wins_else_default() {
        let r = router();
        assert_eq!(r.executor("acme::billing::monthly::charge"), "payments");
        assert_eq!(r.executor("acme::billing::monthly::refund"), "default");
        assert_eq!(r.executor("acme::ml::train::epoch"), "gpu");
        assert_eq!(r.executor("acme::ml"), "gpu", "** matches zero segments");
        assert_eq!(r.executor("other::etl::nightly::load"), "batch");
        assert_eq!(
            r.executor("other::etl::nightly::load::x"),
            "default",
            "* is one segment"
        );
        assert_eq!(r.executor("acme::ml::notify"), "gpu", "earlier rule wins");
        assert_eq!(r.executor("x::y::notify"), "email");
        assert_eq!(r.topic("acme::ml::a::b"), "weir.tasks.gpu");
        assert_eq!(r.topic("nothing::here"), "weir.tasks.default");
    }

    #[test]
    fn literals_are_exact() {
        let r = Router::new(vec![Route::new("acme::etl", "e").unwrap()], "d").unwrap();
        assert_eq!(r.executor("acme::etl"), "e");
        assert_eq!(r.executor("acme::etl2"), "d");
        assert_eq!(r.executor("acme::etl::x"), "d");
    }

    #[test]
    fn invalid_patterns_and_keys_are_errors() {
        for bad in ["", "a:::b", "::a", "a::", "a*::b", "a::b*c", "a b::c"] {
            let err = Route::new(bad, "x").unwrap_err();
            assert!(err.to_string().contains(&format!("{bad:?}")), "{err}");
        }
        assert!(Route::new("a::b", "bad key").is_err());
        assert!(Router::new(Vec::new(), "").is_err());
    }
}
