//! Secrets in configuration: passwords, tokens and the credentials in server URLs.
//!
//! A [`Secret`] prints as `***` however it is formatted, so a config struct can derive
//! `Debug` and a log line or error can never carry the value; only [`Secret::expose`]
//! hands it to the client that needs it. Server URLs are shown through [`redact_url`]:
//! `redis://user:***@host:6379`.

use std::fmt;

use serde::{Deserialize, Deserializer};

/// What a secret looks like wherever it is shown.
pub const MASK: &str = "***";

/// A password, token or key that must never be printed.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The value itself, for the client that authenticates with it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(MASK)
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(MASK)
    }
}

impl<'de> Deserialize<'de> for Secret {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_string(SecretVisitor)
    }
}

/// Takes text only, and names what else it was given without its value: serde's own
/// messages quote the value (`invalid type: integer `123456``).
struct SecretVisitor;

impl serde::de::Visitor<'_> for SecretVisitor {
    type Value = Secret;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string")
    }

    fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<Secret, E> {
        Ok(Secret(text.to_string()))
    }

    fn visit_string<E: serde::de::Error>(self, text: String) -> Result<Secret, E> {
        Ok(Secret(text))
    }

    fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<Secret, E> {
        Err(not_text(&self))
    }

    fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<Secret, E> {
        Err(not_text(&self))
    }

    fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<Secret, E> {
        Err(not_text(&self))
    }

    fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<Secret, E> {
        Err(not_text(&self))
    }
}

fn not_text<E: serde::de::Error>(expected: &SecretVisitor) -> E {
    E::invalid_type(
        serde::de::Unexpected::Other("a value that is not text (not shown)"),
        expected,
    )
}

/// The credentials written into a URL's authority (`scheme://user:password@host`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UrlCredentials {
    pub user: Option<String>,
    pub password: Option<Secret>,
}

/// Splits the credentials out of a URL, or of each URL in a comma-separated list (as
/// NATS takes): the URLs without them, and the first credentials found.
pub fn split_credentials(urls: &str) -> (String, UrlCredentials) {
    let mut found = UrlCredentials::default();
    let stripped: Vec<String> = urls
        .split(',')
        .map(|url| {
            let Some((before, userinfo, after)) = userinfo(url) else {
                return url.to_string();
            };
            if found.user.is_none() && found.password.is_none() {
                let (user, password) = match userinfo.split_once(':') {
                    Some((user, password)) => (user, Some(password)),
                    None => (userinfo, None),
                };
                found = UrlCredentials {
                    user: (!user.is_empty()).then(|| percent_decode(user)),
                    password: password.map(|p| Secret::new(percent_decode(p))),
                };
            }
            format!("{before}{after}")
        })
        .collect();
    (stripped.join(","), found)
}

/// A URL safe to print: any password, or a lone token before the `@`, is replaced by
/// `***`; user names stay, to say who tried to connect. A password may hold `/`, `?`,
/// `#`, `,` or `@` unescaped (clients take them), so everything up to the last `@` of
/// the URL is taken for credentials when the host part holds none.
pub fn redact_url(url: &str) -> String {
    let start = url.find("://").map(|i| i + 3).unwrap_or(0);
    let rest = &url[start..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let Some(at) = rest[..authority_end].rfind('@').or_else(|| rest.rfind('@')) else {
        return url.to_string();
    };
    let shown = match rest[..at].split_once(':') {
        Some((user, _)) => format!("{user}:{MASK}"),
        // `nats://TOKEN@host`: a lone name may be a token.
        None => MASK.to_string(),
    };
    format!("{}{shown}@{}", &url[..start], &rest[at + 1..])
}

/// [`redact_url`] for each URL of a comma-separated list (NATS servers).
pub fn redact_urls(urls: &str) -> String {
    urls.split(',')
        .map(redact_url)
        .collect::<Vec<_>>()
        .join(",")
}

/// `(scheme and "//", userinfo, host and the rest)` of a URL with credentials in it.
fn userinfo(url: &str) -> Option<(&str, &str, &str)> {
    let authority_start = url.find("://").map(|i| i + 3).unwrap_or(0);
    let rest = &url[authority_start..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let at = rest[..authority_end].rfind('@')?;
    Some((&url[..authority_start], &rest[..at], &rest[at + 1..]))
}

/// `%40` → `@` and the like, so a password with reserved characters can be written.
fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            let hex = |b: u8| (b as char).to_digit(16);
            if let (Some(high), Some(low)) = (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                out.push((high * 16 + low) as u8);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Removes every occurrence of each secret from a text (an error from a client library
/// that echoes what it was given), so it can be shown.
pub fn scrub(text: &str, secrets: &[&Secret]) -> String {
    secrets
        .iter()
        .filter(|s| !s.expose().is_empty())
        .fold(text.to_string(), |text, secret| {
            text.replace(secret.expose(), MASK)
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_never_prints() {
        let secret = Secret::new("hunter2");
        assert_eq!(
            format!("{secret} {secret:?} {:?}", Some(&secret)),
            "*** *** Some(***)"
        );
        assert_eq!(secret.expose(), "hunter2");
    }

    #[test]
    fn urls_are_shown_without_their_password() {
        assert_eq!(
            redact_url("redis://user:hunter2@host:6379/0"),
            "redis://user:***@host:6379/0"
        );
        assert_eq!(redact_url("redis://:hunter2@host"), "redis://:***@host");
        assert_eq!(
            redact_url("nats://s3cr3t@host:4222"),
            "nats://***@host:4222"
        );
        assert_eq!(
            redact_urls("nats://a:b@h1:4222,nats://c:d@h2:4222"),
            "nats://a:***@h1:4222,nats://c:***@h2:4222"
        );
        assert_eq!(redact_url("redis://host:6379"), "redis://host:6379");
        // A password holding `@`, `,`, `#`, `/` or `?` is masked whole.
        assert_eq!(redact_url("redis://u:p@ss@host"), "redis://u:***@host");
        assert_eq!(redact_url("redis://u:pa,ss@host:1"), "redis://u:***@host:1");
        assert_eq!(
            redact_url("redis://u:p#s/s?x@host:1/0"),
            "redis://u:***@host:1/0"
        );
        // Rather too much masked than too little: an `@` in a query counts too.
        assert_eq!(redact_url("redis://host/0?x=a@b"), "redis://***@b");
    }

    #[test]
    fn credentials_are_split_from_urls() {
        let (url, creds) = split_credentials("nats://alice:p%40ss@127.0.0.1:4222");
        assert_eq!(url, "nats://127.0.0.1:4222");
        assert_eq!(creds.user.as_deref(), Some("alice"));
        assert_eq!(creds.password.as_ref().map(Secret::expose), Some("p@ss"));

        let (url, creds) = split_credentials("nats://tok@h1:4222,nats://h2:4222");
        assert_eq!(url, "nats://h1:4222,nats://h2:4222");
        assert_eq!(creds.user.as_deref(), Some("tok"));
        assert_eq!(creds.password, None);

        let (url, creds) = split_credentials("nats://h:4222");
        assert_eq!(url, "nats://h:4222");
        assert_eq!(creds, UrlCredentials::default());
    }

    #[test]
    fn broken_percent_escapes_stay_as_written() {
        assert_eq!(percent_decode("a%2"), "a%2");
        assert_eq!(percent_decode("a%zz"), "a%zz");
        assert_eq!(percent_decode("%41%"), "A%");
    }

    #[test]
    fn scrubbing_removes_every_copy() {
        let secret = Secret::new("hunter2");
        assert_eq!(
            scrub("auth hunter2 failed (hunter2)", &[&secret]),
            "auth *** failed (***)"
        );
        assert_eq!(scrub("x", &[&Secret::default()]), "x");
    }
}
