//! Checks on the protected routes: the bearer token, and that a browser page from another
//! site cannot drive them.

use axum::extract::{Request, State};
use axum::http::header::{AUTHORIZATION, CONTENT_TYPE, HOST, ORIGIN, UPGRADE};
use axum::http::Method;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use std::sync::Arc;

use super::{AdminState, ApiError};

/// What a caller may see and do: everything (the operator's token, or an API without
/// tokens), or one tenant's graphs, schedules and workflow executions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    All,
    Tenant(Arc<str>),
}

impl Scope {
    /// Whether the thing keyed `key` (`tenant/name`, or `name`) is within this scope.
    pub fn sees(&self, key: &str) -> bool {
        match self {
            Self::All => true,
            Self::Tenant(tenant) => crate::tenant::of_key(key) == Some(tenant.as_ref()),
        }
    }

    /// Whether something of `tenant` (`None`: of no tenant) is within this scope.
    pub fn owns(&self, tenant: Option<&str>) -> bool {
        match self {
            Self::All => true,
            Self::Tenant(mine) => tenant == Some(mine.as_ref()),
        }
    }

    /// The key a caller means by `name`: a tenant's callers name their own things with
    /// or without the tenant; another tenant's are not found, as if they did not exist.
    pub fn resolve(&self, kind: &'static str, name: &str) -> Result<String, ApiError> {
        let key = match self {
            Self::All => name.to_string(),
            Self::Tenant(tenant) if crate::tenant::of_key(name).is_none() => {
                crate::tenant::key(Some(tenant), name)
            }
            Self::Tenant(_) => name.to_string(),
        };
        if self.sees(&key) {
            Ok(key)
        } else {
            Err(ApiError::NotFound {
                kind,
                name: name.to_string(),
            })
        }
    }
}

/// Admits callers with the operator's token (everything) or a tenant's (that tenant's
/// things), and records which in the request as a [`Scope`].
pub(super) async fn require_token(
    State(state): State<AdminState>,
    mut request: Request,
    next: Next,
) -> Response {
    let protected = state.token.is_some() || !state.tenant_tokens.is_empty();
    let scope = if protected {
        let given = request
            .headers()
            .get(AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or_default()
            .as_bytes();
        let operator = state
            .token
            .as_ref()
            .is_some_and(|t| same(given, t.as_bytes()));
        let tenant = state
            .tenant_tokens
            .iter()
            .find(|(token, _)| same(given, token.as_bytes()));
        match (operator, tenant) {
            (true, _) => Scope::All,
            (false, Some((_, tenant))) => Scope::Tenant(tenant.clone()),
            (false, None) => return ApiError::Unauthorized.into_response(),
        }
    } else {
        Scope::All
    };
    request.extensions_mut().insert(scope);
    next.run(request).await
}

/// Refuses what a web page on another site could make an operator's browser send: a
/// state-changing request without a JSON content type (an HTML form's), or a WebSocket
/// upgrade whose `Origin` is neither this listener's nor an allowed one.
pub(super) async fn same_site_only(
    State(state): State<AdminState>,
    request: Request,
    next: Next,
) -> Response {
    let headers = request.headers();
    // An API without tokens trusts whoever reaches it, so it takes requests addressed
    // to loopback (or a listed origin) only: a web page whose name an attacker pointed
    // at 127.0.0.1 (DNS rebinding) sends its own name as Host.
    let unprotected = state.token.is_none() && state.tenant_tokens.is_empty();
    if unprotected && !state.any_host {
        let host = headers
            .get(HOST)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        let listed = state.allowed_origins.iter().any(|origin| {
            origin.split_once("://").is_some_and(|(_, authority)| {
                authority.trim_end_matches('/').eq_ignore_ascii_case(host)
            })
        });
        if !is_loopback_host(host) && !listed {
            return ApiError::ForbiddenHost(host.to_string()).into_response();
        }
    }
    let changes_state = !matches!(
        *request.method(),
        Method::GET | Method::HEAD | Method::OPTIONS
    );
    if changes_state && !is_json(headers.get(CONTENT_TYPE).and_then(|v| v.to_str().ok())) {
        return ApiError::UnsupportedMediaType.into_response();
    }
    if headers.contains_key(UPGRADE) {
        if let Some(origin) = headers.get(ORIGIN) {
            let origin = origin.to_str().unwrap_or_default();
            let host = headers
                .get(HOST)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default();
            if !origin_allowed(origin, host, &state.allowed_origins) {
                return ApiError::ForbiddenOrigin(origin.to_string()).into_response();
            }
        }
    }
    next.run(request).await
}

/// `localhost`, `127.x.x.x` or `[::1]`, with or without a port.
fn is_loopback_host(host: &str) -> bool {
    let name = match host.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or_default(),
        None => host.rsplit_once(':').map_or(host, |(name, _)| name),
    };
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

fn is_json(content_type: Option<&str>) -> bool {
    content_type
        .and_then(|v| v.split(';').next())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/json"))
}

/// The page's origin is the listener's own (same host and port, either scheme, since
/// TLS may end at a proxy) or one listed.
fn origin_allowed(origin: &str, host: &str, allowed: &[String]) -> bool {
    let origin = origin.trim_end_matches('/');
    if allowed
        .iter()
        .any(|a| a.trim_end_matches('/').eq_ignore_ascii_case(origin))
    {
        return true;
    }
    let authority = origin
        .strip_prefix("https://")
        .or_else(|| origin.strip_prefix("http://"));
    !host.is_empty() && authority.is_some_and(|a| a.eq_ignore_ascii_case(host))
}

/// Compares without stopping at the first difference, so timing does not reveal how much
/// of a guess was right.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::{is_json, origin_allowed, same, Scope};

    #[test]
    fn a_tenant_scope_sees_only_its_tenant() {
        let acme = Scope::Tenant("acme".into());
        assert!(acme.sees("acme/report"));
        assert!(!acme.sees("globex/report"));
        assert!(!acme.sees("report"));
        assert_eq!(acme.resolve("graph", "report").unwrap(), "acme/report");
        assert_eq!(acme.resolve("graph", "acme/report").unwrap(), "acme/report");
        assert!(acme.resolve("graph", "globex/report").is_err());
        assert!(Scope::All.sees("globex/report"));
        assert_eq!(Scope::All.resolve("graph", "report").unwrap(), "report");
    }

    #[test]
    fn loopback_hosts_are_told_apart_from_names_pointed_at_loopback() {
        use super::is_loopback_host;
        for host in [
            "localhost",
            "localhost:9899",
            "127.0.0.1:9899",
            "127.1.2.3",
            "[::1]:9899",
        ] {
            assert!(is_loopback_host(host), "{host}");
        }
        for host in [
            "rebind.evil:9899",
            "weir:9899",
            "10.0.0.1:9899",
            "",
            "[::2]:1",
        ] {
            assert!(!is_loopback_host(host), "{host}");
        }
    }

    #[test]
    fn only_json_content_types_pass() {
        assert!(is_json(Some("application/json")));
        assert!(is_json(Some("Application/JSON; charset=utf-8")));
        assert!(!is_json(Some("text/plain")));
        assert!(!is_json(Some("application/x-www-form-urlencoded")));
        assert!(!is_json(None));
    }

    #[test]
    fn origins_are_the_listeners_own_or_listed() {
        let allowed = vec!["https://ops.example.com".to_string()];
        assert!(origin_allowed(
            "http://127.0.0.1:9899",
            "127.0.0.1:9899",
            &[]
        ));
        assert!(origin_allowed(
            "https://weir.internal",
            "weir.internal",
            &[]
        ));
        assert!(origin_allowed(
            "https://ops.example.com/",
            "weir:9899",
            &allowed
        ));
        assert!(!origin_allowed(
            "https://evil.example",
            "127.0.0.1:9899",
            &allowed
        ));
        assert!(!origin_allowed("http://127.0.0.1:9899", "", &[]));
        assert!(!origin_allowed("null", "127.0.0.1:9899", &[]));
    }

    #[test]
    fn tokens_compare_exactly() {
        assert!(same(b"s3cret", b"s3cret"));
        assert!(!same(b"s3cret", b"s3cres"));
        assert!(!same(b"s3cret", b"s3cret!"));
        assert!(!same(b"", b"x"));
    }
}
