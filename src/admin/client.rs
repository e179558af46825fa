//! A small HTTP/1.1 client for the admin API (plain `http://`: the API is meant for
//! loopback or a private network), used by `weir graph`.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::header::{ACCEPT, AUTHORIZATION, CONTENT_TYPE};
use hyper::{Method, Request, Uri};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

use super::AdminError;

/// Longest one request may take, connection included.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

pub struct AdminClient {
    base: String,
    token: Option<String>,
    client: Client<HttpConnector, Full<Bytes>>,
}

impl AdminClient {
    /// `url` is the admin listener's base, e.g. `http://127.0.0.1:9899`.
    pub fn new(url: &str, token: Option<String>) -> Result<Self, AdminError> {
        let bad = |reason: &str| AdminError::Url {
            url: url.to_string(),
            reason: reason.to_string(),
        };
        let uri: Uri = url
            .parse()
            .map_err(|e: hyper::http::uri::InvalidUri| bad(&e.to_string()))?;
        if uri.scheme_str() != Some("http") {
            return Err(bad("only http:// URLs are supported"));
        }
        if uri.host().is_none() {
            return Err(bad("no host"));
        }
        Ok(Self {
            base: url.trim_end_matches('/').to_string(),
            token,
            client: Client::builder(TokioExecutor::new()).build_http(),
        })
    }

    pub async fn get(&self, path: &str) -> Result<Value, AdminError> {
        self.call(Method::GET, path, None).await
    }

    pub async fn post(&self, path: &str, body: Option<&Value>) -> Result<Value, AdminError> {
        self.call(Method::POST, path, body).await
    }

    /// The JSON answer of a 2xx; otherwise the server's error message.
    async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Value, AdminError> {
        let url = format!("{}{path}", self.base);
        // The server takes state-changing requests as JSON only, body or not.
        let changes_state = method != Method::GET;
        let mut request = Request::builder()
            .method(method)
            .uri(&url)
            .header(ACCEPT, "application/json");
        if changes_state {
            request = request.header(CONTENT_TYPE, "application/json");
        }
        if let Some(token) = &self.token {
            request = request.header(AUTHORIZATION, format!("Bearer {token}"));
        }
        let payload = match body {
            Some(body) => Bytes::from(body.to_string()),
            None => Bytes::new(),
        };
        let request = request
            .body(Full::new(payload))
            .map_err(|e| AdminError::Url {
                url: url.clone(),
                reason: e.to_string(),
            })?;
        let connect = |reason: String| AdminError::Connect {
            url: url.clone(),
            reason,
        };
        let exchange = async {
            let response = self
                .client
                .request(request)
                .await
                .map_err(|e| connect(describe(&e)))?;
            let status = response.status();
            let bytes = response
                .into_body()
                .collect()
                .await
                .map_err(|e| connect(e.to_string()))?
                .to_bytes();
            Ok::<_, AdminError>((status, bytes))
        };
        let (status, bytes) = tokio::time::timeout(REQUEST_TIMEOUT, exchange)
            .await
            .map_err(|_| connect(format!("no answer within {REQUEST_TIMEOUT:?}")))??;
        let parsed = serde_json::from_slice::<Value>(&bytes);
        if !status.is_success() {
            let message = match &parsed {
                Ok(v) => v["error"]
                    .as_str()
                    .map(str::to_string)
                    .unwrap_or_else(|| v.to_string()),
                Err(_) => String::from_utf8_lossy(&bytes).into_owned(),
            };
            return Err(AdminError::Status {
                status: status.as_u16(),
                message,
            });
        }
        parsed.map_err(|e| AdminError::Response(e.to_string()))
    }
}

/// hyper's client error says little at the top; the cause says why (refused, reset).
fn describe(e: &hyper_util::client::legacy::Error) -> String {
    match std::error::Error::source(e) {
        Some(cause) => format!("{e}: {cause}"),
        None => e.to_string(),
    }
}

/// Percent-encodes one path segment (graph names may hold a tenant's `/`).
pub fn segment(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_escape_reserved_characters() {
        assert_eq!(segment("prices"), "prices");
        assert_eq!(segment("acme/prices v2"), "acme%2Fprices%20v2");
    }

    #[test]
    fn only_plain_http_urls_are_accepted() {
        assert!(AdminClient::new("http://127.0.0.1:9899/", None).is_ok());
        assert!(matches!(
            AdminClient::new("https://example.com", None),
            Err(AdminError::Url { .. })
        ));
        assert!(matches!(
            AdminClient::new("not a url", None),
            Err(AdminError::Url { .. })
        ));
    }
}
