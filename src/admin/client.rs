//! A small HTTP/1.1 client for the admin API, `http://` or `https://` (trusting the
//! system's roots, or a given CA for a private one), used by `weir graph`.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::header::{ACCEPT, AUTHORIZATION, CONTENT_TYPE};
use hyper::{Method, Request, Uri};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

use super::AdminError;

/// Where `weir graph` finds the admin API unless told otherwise: the documented
/// `[admin] listen` address. No listener runs unless configured.
pub const DEFAULT_URL: &str = "http://127.0.0.1:9899";

/// Longest one request may take, connection included.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

pub struct AdminClient {
    base: String,
    token: Option<String>,
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
}

impl AdminClient {
    /// `url` is the admin listener's base, e.g. `http://127.0.0.1:9899` or
    /// `https://weir.internal:9899`; `ca` a PEM file of the CA that signed an `https://`
    /// listener's certificate, when it is not one the system trusts.
    pub fn new(url: &str, token: Option<String>, ca: Option<&Path>) -> Result<Self, AdminError> {
        let bad = |reason: &str| AdminError::Url {
            url: url.to_string(),
            reason: reason.to_string(),
        };
        let uri: Uri = url
            .parse()
            .map_err(|e: hyper::http::uri::InvalidUri| bad(&e.to_string()))?;
        if !matches!(uri.scheme_str(), Some("http" | "https")) {
            return Err(bad("only http:// and https:// URLs are supported"));
        }
        if uri.host().is_none() {
            return Err(bad("no host"));
        }
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls_config(ca).map_err(|reason| bad(&reason))?)
            .https_or_http()
            .enable_http1()
            .build();
        Ok(Self {
            base: url.trim_end_matches('/').to_string(),
            token,
            client: Client::builder(TokioExecutor::new()).build(connector),
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

/// Trusts `ca` if given, else the system's roots.
fn tls_config(ca: Option<&Path>) -> Result<tokio_rustls::rustls::ClientConfig, String> {
    use rustls_pki_types::pem::PemObject;
    use tokio_rustls::rustls;
    let mut roots = rustls::RootCertStore::empty();
    match ca {
        Some(path) => {
            let certs = rustls_pki_types::CertificateDer::pem_file_iter(path)
                .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
                .map_err(|e| format!("cannot read the CA {}: {e}", path.display()))?;
            let (added, _) = roots.add_parsable_certificates(certs);
            if added == 0 {
                return Err(format!("{} holds no usable certificate", path.display()));
            }
        }
        None => {
            // Roots the system cannot parse are skipped; an https:// URL then fails to
            // verify, saying so.
            roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
        }
    }
    rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map(|builder| builder.with_root_certificates(roots).with_no_client_auth())
        .map_err(|e| e.to_string())
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
        assert!(AdminClient::new("http://127.0.0.1:9899/", None, None).is_ok());
        assert!(AdminClient::new("https://127.0.0.1:9899/", None, None).is_ok());
        assert!(matches!(
            AdminClient::new("ftp://example.com", None, None),
            Err(AdminError::Url { .. })
        ));
        assert!(matches!(
            AdminClient::new("not a url", None, None),
            Err(AdminError::Url { .. })
        ));
    }
}
