//! Connections to servers with their security turned on, each started by the test on a
//! spare port with certificates it made: NATS with `--user/--pass`, `--auth`, an NKey
//! user and TLS verifying client certificates; Redis with `--requirepass`, an ACL user
//! and TLS; Kafka (Tansu) over TLS and with SASL; the admin API over TLS. Wrong
//! credentials make `weir run` exit 1 naming the server and the cause, and no secret
//! appears in anything weir printed, nor in what it logs and answers at debug level
//! through its servers' restarts.
#![cfg(feature = "it")]

mod common;

use std::io::Write;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::certs::Certs;
use common::servers::Server;
use common::services::unique;
use weir::secret::Secret;
use weir::store::redis::{RedisSettings, RedisStore};
use weir::store::Backend;
use weir::transport::kafka::{KafkaBroker, KafkaSettings};
use weir::transport::nats::{NatsAuth, NatsBroker, NatsSettings};
use weir::transport::{Broker, Outbound, Subscription, TransportError};

/// Longest `weir run` may take to give up on a server refusing it: the connect timeouts
/// (seconds) with room for a slow machine.
const GIVE_UP_WITHIN: Duration = Duration::from_secs(40);

async fn round_trip(broker: &dyn Broker) {
    let topic = unique("secured");
    let mut source = broker
        .subscribe(&Subscription::new(topic.clone(), unique("group")))
        .await
        .expect("subscribed");
    broker
        .sink()
        .publish(Outbound::new(
            topic.clone(),
            Bytes::from_static(b"{\"n\":1}"),
        ))
        .await
        .expect("published");
    let message = tokio::time::timeout(Duration::from_secs(30), source.next())
        .await
        .expect("a message within 30 s")
        .expect("a message");
    assert_eq!(&message.payload[..], b"{\"n\":1}");
}

async fn nats(url: String, auth: NatsAuth) -> Result<NatsBroker, TransportError> {
    NatsBroker::connect(NatsSettings {
        url,
        auth,
        ..Default::default()
    })
    .await
}

fn refused(result: Result<NatsBroker, TransportError>, secret: &str) -> String {
    let error = result.err().expect("the server refuses").to_string();
    assert!(!error.contains(secret), "the secret leaked: {error}");
    error
}

struct Run {
    code: Option<i32>,
    output: String,
    took: Duration,
}

/// `weir run` with a config of one graph and `sections` (broker, store).
fn weir_run(sections: &str) -> Run {
    let mut file = tempfile::NamedTempFile::new().unwrap();
    write!(
        file,
        "{sections}\n[[graph]]\nname = \"g\"\noutput = \"g.out\"\n[[graph.accumulator]]\nname = \"a\"\n"
    )
    .unwrap();
    let started = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_weir"))
        .args(["run", "--config"])
        .arg(file.path())
        .env("WEIR_LOG", "debug")
        .output()
        .expect("weir runs");
    Run {
        code: out.status.code(),
        output: format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
        took: started.elapsed(),
    }
}

/// Exit 1, in time, with a last word naming the server and the cause, and never the
/// secret anywhere.
fn assert_refused(run: &Run, server: &str, cause: &str, secret: &str) {
    assert_eq!(run.code, Some(1), "{}", run.output);
    assert!(run.took < GIVE_UP_WITHIN, "took {:?}", run.took);
    let verdict = run
        .output
        .lines()
        .rfind(|l| l.starts_with("weir: "))
        .unwrap_or_else(|| panic!("no error line: {}", run.output));
    assert!(verdict.contains(server), "names {server}: {verdict}");
    assert!(
        verdict.to_lowercase().contains(&cause.to_lowercase()),
        "names the cause {cause:?}: {verdict}"
    );
    assert!(
        !run.output.contains(secret),
        "the secret leaked: {}",
        run.output
    );
}

#[tokio::test]
async fn nats_with_user_and_password_from_the_config_or_the_url() {
    let password = "nats-pw-5f1c";
    let server = Server::nats_with_args("", &["--user", "alice", "--pass", password]);
    let url = server.nats_url();
    let auth = NatsAuth {
        user: Some("alice".into()),
        password: Some(Secret::new(password)),
        ..Default::default()
    };
    round_trip(
        &nats(url.clone(), auth)
            .await
            .expect("configured credentials"),
    )
    .await;
    let in_url = format!("nats://alice:{password}@127.0.0.1:{}", server.port);
    round_trip(
        &nats(in_url, NatsAuth::default())
            .await
            .expect("URL credentials"),
    )
    .await;

    let error = refused(nats(url.clone(), NatsAuth::default()).await, password);
    assert!(error.contains("authentication failed"), "{error}");

    let wrong = "not-the-nats-pw-93a";
    let run = weir_run(&format!(
        "[broker]\nkind = \"nats\"\nurl = \"{url}\"\nuser = \"alice\"\npassword = \"{wrong}\""
    ));
    assert_refused(&run, &url, "authentication failed", wrong);
    let run = weir_run(&format!(
        "[broker]\nkind = \"nats\"\nurl = \"nats://alice:{wrong}@127.0.0.1:{}\"",
        server.port
    ));
    assert_refused(
        &run,
        "nats://alice:***@127.0.0.1",
        "authentication failed",
        wrong,
    );
}

#[tokio::test]
async fn nats_with_a_token_from_the_config_or_the_url() {
    let token = "nats-token-77ad";
    let server = Server::nats_with_args("", &["--auth", token]);
    let url = server.nats_url();
    let auth = NatsAuth {
        token: Some(Secret::new(token)),
        ..Default::default()
    };
    round_trip(&nats(url.clone(), auth).await.expect("configured token")).await;
    let in_url = format!("nats://{token}@127.0.0.1:{}", server.port);
    round_trip(&nats(in_url, NatsAuth::default()).await.expect("URL token")).await;

    let wrong = "wrong-token-0b1";
    let run = weir_run(&format!(
        "[broker]\nkind = \"nats\"\nurl = \"nats://{wrong}@127.0.0.1:{}\"",
        server.port
    ));
    assert_refused(&run, "nats://***@127.0.0.1", "authentication failed", wrong);
    let run = weir_run(&format!(
        "[broker]\nkind = \"nats\"\nurl = \"{url}\"\ntoken = \"{wrong}\""
    ));
    assert_refused(&run, &url, "authentication failed", wrong);
}

#[tokio::test]
async fn nats_with_an_nkey_seed_file() {
    let user = nkeys::KeyPair::new_user();
    let other = nkeys::KeyPair::new_user();
    let server = Server::nats(&format!(
        "authorization {{ users: [ {{ nkey: {} }} ] }}",
        user.public_key()
    ));
    let dir = tempfile::tempdir().unwrap();
    let seed_file = |name: &str, pair: &nkeys::KeyPair| {
        let path = dir.path().join(name);
        std::fs::write(&path, pair.seed().unwrap()).unwrap();
        path
    };
    let auth = NatsAuth {
        nkey_seed_file: Some(seed_file("user.nk", &user)),
        ..Default::default()
    };
    round_trip(&nats(server.nats_url(), auth).await.expect("nkey accepted")).await;

    let stranger = seed_file("other.nk", &other);
    let run = weir_run(&format!(
        "[broker]\nkind = \"nats\"\nurl = \"{}\"\nnkey_seed_file = {:?}",
        server.nats_url(),
        stranger.display().to_string()
    ));
    assert_refused(
        &run,
        &server.nats_url(),
        "authentication failed",
        &other.seed().unwrap(),
    );
}

#[tokio::test]
async fn nats_over_tls_verifying_client_certificates() {
    let certs = Certs::make();
    let server = Server::nats(&format!(
        "tls {{ cert_file: {:?}, key_file: {:?}, ca_file: {:?}, verify: true, timeout: 5 }}",
        certs.server_cert().display().to_string(),
        certs.server_key().display().to_string(),
        certs.ca().display().to_string(),
    ));
    let url = format!("tls://127.0.0.1:{}", server.port);
    let auth = NatsAuth {
        tls_ca_file: Some(certs.ca()),
        tls_cert_file: Some(certs.client_cert()),
        tls_key_file: Some(certs.client_key()),
        tls_required: true,
        ..Default::default()
    };
    round_trip(
        &nats(url.clone(), auth)
            .await
            .expect("TLS with a client certificate"),
    )
    .await;

    let without_certificate = NatsAuth {
        tls_ca_file: Some(certs.ca()),
        tls_required: true,
        ..Default::default()
    };
    assert!(
        nats(url.clone(), without_certificate).await.is_err(),
        "the server verifies clients"
    );
    // A CA that did not sign the server's certificate.
    let strangers = Certs::make();
    let run = weir_run(&format!(
        "[broker]\nkind = \"nats\"\nurl = \"{url}\"\ntls_ca_file = {:?}\ntls_cert_file = {:?}\ntls_key_file = {:?}",
        strangers.ca().display().to_string(),
        certs.client_cert().display().to_string(),
        certs.client_key().display().to_string(),
    ));
    assert_eq!(run.code, Some(1), "{}", run.output);
    assert!(run.output.contains(&url), "{}", run.output);
}

async fn redis_works(settings: &RedisSettings) -> Result<(), String> {
    let store = RedisStore::connect_with(settings, &unique("secured"))
        .await
        .map_err(|e| e.to_string())?;
    store.ping().await.map_err(|e| e.to_string())
}

#[tokio::test]
async fn redis_with_requirepass_and_an_acl_user() {
    let password = "redis-pw-2c9e";
    let acl_password = "redis-acl-pw-41f";
    let server = Server::redis_with(|port| {
        vec![
            "--port".into(),
            port.to_string(),
            "--requirepass".into(),
            password.into(),
            // One directive, its words as separate arguments.
            "--user".into(),
            "weir".into(),
            "on".into(),
            format!(">{acl_password}"),
            "~*".into(),
            "&*".into(),
            "+@all".into(),
        ]
    });
    let url = server.redis_url();
    let with = |url: String, username: Option<&str>, password: Option<&str>| RedisSettings {
        url,
        username: username.map(String::from),
        password: password.map(Secret::new),
        ..Default::default()
    };
    redis_works(&with(url.clone(), None, Some(password)))
        .await
        .expect("requirepass");
    redis_works(&with(url.clone(), Some("weir"), Some(acl_password)))
        .await
        .expect("ACL user");
    let in_url = format!("redis://weir:{acl_password}@127.0.0.1:{}", server.port);
    redis_works(&with(in_url, None, None))
        .await
        .expect("ACL user in the URL");
    // The settings' credentials take precedence over the URL's, wrong ones included.
    let stale = format!("redis://weir:stale-pw-0b1@127.0.0.1:{}", server.port);
    redis_works(&with(stale.clone(), Some("weir"), Some(acl_password)))
        .await
        .expect("the settings' credentials over the URL's");
    redis_works(&with(stale, None, Some(acl_password)))
        .await
        .expect("the settings' password, with the URL's user");

    let error = redis_works(&with(url.clone(), Some("weir"), Some("nope-pw-1")))
        .await
        .expect_err("a wrong password is refused");
    assert!(!error.contains("nope-pw-1"), "{error}");

    let wrong = "wrong-redis-pw-8d0";
    let run = weir_run(&format!(
        "[store]\nkind = \"redis\"\nurl = \"redis://weir:{wrong}@127.0.0.1:{}\"",
        server.port
    ));
    assert_refused(
        &run,
        "redis://weir:***@127.0.0.1",
        "authentication failed",
        wrong,
    );
    let run = weir_run(&format!(
        "[store]\nkind = \"redis\"\nurl = \"{url}\"\nusername = \"weir\"\npassword = \"{wrong}\""
    ));
    assert_refused(&run, &url, "authentication failed", wrong);
}

#[tokio::test]
async fn redis_over_tls_with_a_client_certificate() {
    let certs = Certs::make();
    let (cert, key, ca) = (certs.server_cert(), certs.server_key(), certs.ca());
    let server = Server::redis_with(|port| {
        [
            "--port",
            "0",
            "--tls-port",
            &port.to_string(),
            "--tls-cert-file",
            &cert.display().to_string(),
            "--tls-key-file",
            &key.display().to_string(),
            "--tls-ca-cert-file",
            &ca.display().to_string(),
            "--tls-auth-clients",
            "yes",
        ]
        .map(String::from)
        .to_vec()
    });
    let url = format!("rediss://127.0.0.1:{}", server.port);
    let settings = RedisSettings {
        url: url.clone(),
        tls_ca_file: Some(certs.ca()),
        tls_cert_file: Some(certs.client_cert()),
        tls_key_file: Some(certs.client_key()),
        ..Default::default()
    };
    redis_works(&settings)
        .await
        .expect("TLS with a client certificate");
    let without_certificate = RedisSettings {
        url: url.clone(),
        tls_ca_file: Some(certs.ca()),
        ..Default::default()
    };
    assert!(
        redis_works(&without_certificate).await.is_err(),
        "the server verifies clients"
    );
    let plain = RedisSettings {
        url: format!("redis://127.0.0.1:{}", server.port),
        ..Default::default()
    };
    assert!(
        redis_works(&plain).await.is_err(),
        "no plain text on the TLS port"
    );
}

/// Terminates TLS on a spare port and passes the bytes on to `upstream` in the clear: a
/// TLS listener in front of a broker that has none of its own.
async fn tls_terminator(
    certs: &Certs,
) -> (
    tokio::net::TcpListener,
    Arc<tokio_rustls::rustls::ServerConfig>,
) {
    let config = weir::admin::tls::server_config(&certs.server_cert(), &certs.server_key())
        .expect("server TLS config");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    (listener, config)
}

fn forward_tls(
    listener: tokio::net::TcpListener,
    config: Arc<tokio_rustls::rustls::ServerConfig>,
    upstream: u16,
) {
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    tokio::spawn(async move {
        while let Ok((inbound, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(inbound).await else {
                    return;
                };
                let Ok(mut plain) = tokio::net::TcpStream::connect(("127.0.0.1", upstream)).await
                else {
                    return;
                };
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
            });
        }
    });
}

fn kafka_options(pairs: &[(&str, &str)]) -> std::collections::BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .chain([
            ("session.timeout.ms".to_string(), "6000".to_string()),
            ("group.protocol".to_string(), "classic".to_string()),
        ])
        .collect()
}

fn kafka_section(brokers: &str, options: &[(&str, &str)]) -> String {
    let mut section =
        format!("[broker]\nkind = \"kafka\"\nbrokers = \"{brokers}\"\n[broker.options]\n");
    for (k, v) in options {
        section.push_str(&format!("{k:?} = {v:?}\n"));
    }
    section
}

fn path(p: &Path) -> String {
    p.display().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_over_tls() {
    let certs = Certs::make();
    let (listener, config) = tls_terminator(&certs).await;
    let tls_port = listener.local_addr().unwrap().port();
    // Tansu tells clients to come back through the TLS port.
    let tansu = Server::tansu(Some(tls_port), &[]);
    forward_tls(listener, config, tansu.port);
    let brokers = format!("127.0.0.1:{tls_port}");
    let ca = path(&certs.ca());
    let broker = KafkaBroker::connect(KafkaSettings {
        brokers: brokers.clone(),
        options: kafka_options(&[("security.protocol", "ssl"), ("ssl.ca.location", &ca)]),
        ..Default::default()
    })
    .expect("a TLS client");
    broker.ping().await.expect("TLS handshake and metadata");
    round_trip(&broker).await;

    let strangers = Certs::make();
    let run = weir_run(&kafka_section(
        &brokers,
        &[
            ("security.protocol", "ssl"),
            ("ssl.ca.location", &path(&strangers.ca())),
        ],
    ));
    assert_refused(
        &run,
        &brokers,
        "certificate verify failed",
        "no secret here",
    );
}

#[tokio::test]
async fn kafka_with_sasl_refuses_wrong_credentials() {
    let tansu = Server::tansu(None, &["--authentication"]);
    let brokers = format!("127.0.0.1:{}", tansu.port);
    for mechanism in ["SCRAM-SHA-256", "SCRAM-SHA-512"] {
        let wrong = "kafka-pw-not-this-6e2";
        let run = weir_run(&kafka_section(
            &brokers,
            &[
                ("security.protocol", "sasl_plaintext"),
                ("sasl.mechanism", mechanism),
                ("sasl.username", "alice"),
                ("sasl.password", wrong),
            ],
        ));
        assert_refused(&run, &brokers, "authentication", wrong);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_over_tls() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_rustls::rustls;

    let certs = Certs::make();
    let listen = weir::admin::Listen {
        admin: Some("127.0.0.1:0".parse().unwrap()),
        admin_tls: Some(weir::admin::TlsFiles {
            cert: certs.server_cert(),
            key: certs.server_key(),
        }),
        ..Default::default()
    };
    let cancel = tokio_util::sync::CancellationToken::new();
    let servers = weir::admin::serve(weir::admin::AdminState::new(), &listen, cancel.clone())
        .await
        .expect("admin over TLS");
    let addr = servers.admin.unwrap();

    // A client that opens a connection and says nothing holds up no one.
    let _silent = tokio::net::TcpStream::connect(addr).await.unwrap();

    let mut roots = rustls::RootCertStore::empty();
    use rustls_pki_types::pem::PemObject;
    for cert in rustls_pki_types::CertificateDer::pem_file_iter(certs.ca()).unwrap() {
        roots.add(cert.unwrap()).unwrap();
    }
    let client = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(client));
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = rustls_pki_types::ServerName::try_from("localhost").unwrap();
    let mut tls = tokio::time::timeout(Duration::from_secs(10), connector.connect(name, tcp))
        .await
        .expect("handshake in time")
        .expect("handshake");
    tls.write_all(b"GET /healthz HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut answer = String::new();
    tls.read_to_string(&mut answer).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");

    // Plain HTTP gets no answer from a TLS listener.
    let mut plain = tokio::net::TcpStream::connect(addr).await.unwrap();
    plain
        .write_all(b"GET /healthz HTTP/1.1\r\nhost: localhost\r\n\r\n")
        .await
        .unwrap();
    let mut reply = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), plain.read_to_end(&mut reply)).await;
    assert!(
        !String::from_utf8_lossy(&reply).contains("200"),
        "answered in the clear"
    );

    // `weir graph` trusts the private CA it is given, and nothing else.
    let url = format!("https://127.0.0.1:{}", addr.port());
    let ca = certs.ca();
    let (with_ca, without) = tokio::task::spawn_blocking(move || {
        let graph_list = |ca: Option<&std::path::Path>| {
            let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_weir"));
            command
                .args(["graph", "list", "--admin", &url])
                .env_remove("WEIR_ADMIN_CA")
                .env_remove("WEIR_ADMIN_TOKEN");
            if let Some(ca) = ca {
                command.arg("--admin-ca").arg(ca);
            }
            command.output().unwrap()
        };
        (graph_list(Some(&ca)), graph_list(None))
    })
    .await
    .unwrap();
    assert!(with_ca.status.success(), "{with_ca:?}");
    assert_eq!(String::from_utf8_lossy(&with_ca.stdout).trim(), "[]");
    assert_eq!(without.status.code(), Some(1), "{without:?}");
    cancel.cancel();
}

/// A NATS JWT (v2) of `claims`, signed by `issuer`.
fn nats_jwt(issuer: &nkeys::KeyPair, subject: &str, name: &str, nats: serde_json::Value) -> String {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let header = b64.encode(r#"{"typ":"JWT","alg":"ed25519-nkey"}"#);
    let claims = serde_json::json!({
        "jti": unique("jwt"),
        "iat": chrono::Utc::now().timestamp(),
        "iss": issuer.public_key(),
        "name": name,
        "sub": subject,
        "nats": nats,
    });
    let claims = b64.encode(claims.to_string());
    let signed = format!("{header}.{claims}");
    let signature = b64.encode(issuer.sign(signed.as_bytes()).unwrap());
    format!("{signed}.{signature}")
}

/// A `.creds` file: a user JWT and the user's seed, as `nsc` writes it.
fn creds_file(dir: &Path, name: &str, jwt: &str, user: &nkeys::KeyPair) -> std::path::PathBuf {
    let path = dir.join(name);
    std::fs::write(
        &path,
        format!(
            "-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n\n\
             ************************* IMPORTANT *************************\n\n\
             -----BEGIN USER NKEY SEED-----\n{}\n------END USER NKEY SEED------\n",
            user.seed().unwrap()
        ),
    )
    .unwrap();
    path
}

#[tokio::test]
async fn nats_with_a_credentials_file() {
    let operator = nkeys::KeyPair::new_operator();
    let account = nkeys::KeyPair::new_account();
    let user = nkeys::KeyPair::new_user();
    let no_limit = serde_json::json!({
        "subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1,
        "wildcards": true, "conn": -1, "leaf": -1,
    });
    let operator_jwt = nats_jwt(
        &operator,
        &operator.public_key(),
        "weir-test",
        serde_json::json!({"type": "operator", "version": 2}),
    );
    let account_jwt = nats_jwt(
        &operator,
        &account.public_key(),
        "A",
        serde_json::json!({"type": "account", "version": 2, "limits": no_limit}),
    );
    let user_claims = serde_json::json!({
        "type": "user", "version": 2, "pub": {}, "sub": {},
        "subs": -1, "data": -1, "payload": -1,
    });
    let user_jwt = nats_jwt(&account, &user.public_key(), "weir", user_claims.clone());
    // JetStream (which the test server runs) wants a system account in operator mode.
    let system = nkeys::KeyPair::new_account();
    let system_jwt = nats_jwt(
        &operator,
        &system.public_key(),
        "SYS",
        serde_json::json!({"type": "account", "version": 2, "limits": no_limit}),
    );
    let server = Server::nats_with_args(
        &format!(
            "operator: {operator_jwt}\nsystem_account: {sys}\nresolver: MEMORY\n\
             resolver_preload: {{ {acc}: {account_jwt}, {sys}: {system_jwt} }}",
            acc = account.public_key(),
            sys = system.public_key(),
        ),
        &[],
    );
    let dir = tempfile::tempdir().unwrap();
    let creds = creds_file(dir.path(), "weir.creds", &user_jwt, &user);
    let broker = NatsBroker::connect(NatsSettings {
        url: server.nats_url(),
        jetstream: false,
        auth: NatsAuth {
            credentials_file: Some(creds),
            ..Default::default()
        },
        ..Default::default()
    })
    .await
    .expect("the credentials are accepted");
    round_trip(&broker).await;

    // A user signed by an account the operator never vouched for.
    let stranger = nkeys::KeyPair::new_account();
    let outsider = nkeys::KeyPair::new_user();
    let forged = nats_jwt(&stranger, &outsider.public_key(), "outsider", user_claims);
    let forged = creds_file(dir.path(), "forged.creds", &forged, &outsider);
    let run = weir_run(&format!(
        "[broker]\nkind = \"nats\"\njetstream = false\nurl = \"{}\"\ncredentials_file = {:?}",
        server.nats_url(),
        forged.display().to_string()
    ));
    assert_refused(
        &run,
        &server.nats_url(),
        "authentication failed",
        &outsider.seed().unwrap(),
    );
}

/// An HTTP/1.1 GET on loopback, its whole answer (status line, headers, body) as text.
async fn http_get(address: &str, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(address)
        .await
        .expect("the admin API answers");
    let request = format!("GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer))
        .await
        .expect("an answer within 10 s")
        .unwrap();
    String::from_utf8_lossy(&answer).into_owned()
}

/// Waits until an output of a new event comes out on `topic`, publishing the event to
/// `input` every second meanwhile (a restarted server may drop what came while it was
/// away). The event carries a mark of its own, so an output from before does not count.
async fn await_an_output(broker: &NatsBroker, input: &str, topic: &str) {
    let mark = unique("mark");
    let event = serde_json::json!({ "mark": mark }).to_string();
    let mut source = broker
        .subscribe(&Subscription::new(topic, unique("reader")))
        .await
        .expect("subscribed");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        assert!(
            Instant::now() < deadline,
            "no output of {mark} on {topic} within 60 s"
        );
        let _ = broker
            .sink()
            .publish(Outbound::new(input, event.clone()))
            .await;
        let pause = tokio::time::sleep(Duration::from_secs(1));
        tokio::pin!(pause);
        loop {
            tokio::select! {
                _ = &mut pause => break,
                next = source.next() => match next {
                    Ok(m) if String::from_utf8_lossy(&m.payload).contains(&mark) => return,
                    Ok(_) => {}
                    // The server away: wait out the second before asking again.
                    Err(_) => {
                        (&mut pause).await;
                        break;
                    }
                },
            }
        }
    }
}

/// `weir run` at debug level, with the passwords of its NATS and its Redis in their
/// URLs, through both servers restarting: nothing it logs, nor its admin API's
/// `/graphs`, `/readyz` and `/metrics`, nor the CLI, shows either password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_password_shows_in_logs_or_answers_through_server_restarts() {
    let nats_password = "nats-pw-restart-7e2";
    let redis_password = "redis-pw-restart-3a9";
    let mut nats_server = Server::nats_with_args("", &["--user", "alice", "--pass", nats_password]);
    let mut redis_server = Server::redis_with(|port| {
        vec![
            "--port".into(),
            port.to_string(),
            "--requirepass".into(),
            redis_password.into(),
        ]
    });
    let nats_url = format!(
        "nats://alice:{nats_password}@127.0.0.1:{}",
        nats_server.port
    );
    let prefix = unique("masked");
    let (input, output) = (format!("{prefix}.in"), format!("{prefix}.out"));
    let admin = format!("127.0.0.1:{}", common::servers::spare_port());
    let mut config = tempfile::NamedTempFile::new().unwrap();
    write!(
        config,
        r#"[broker]
kind = "nats"
url = "{nats_url}"
[store]
kind = "redis"
url = "redis://:{redis_password}@127.0.0.1:{redis_port}"
prefix = "{prefix}"
[admin]
listen = "{admin}"
{graph}"#,
        redis_port = redis_server.port,
        graph = common::passthrough_graph_toml("g", &input, &output),
    )
    .unwrap();
    let log = tempfile::NamedTempFile::new().unwrap();
    let mut weir = Command::new(env!("CARGO_BIN_EXE_weir"))
        .args(["run", "--config"])
        .arg(config.path())
        .env("WEIR_LOG", "debug")
        .stdout(log.reopen().unwrap())
        .stderr(log.reopen().unwrap())
        .spawn()
        .expect("weir runs");
    let broker = NatsBroker::connect(NatsSettings {
        url: nats_url.clone(),
        jetstream: true,
        ..Default::default()
    })
    .await
    .expect("NATS reachable");
    await_an_output(&broker, &input, &output).await;
    redis_server.restart();
    nats_server.restart();
    await_an_output(&broker, &input, &output).await;

    let mut answers = Vec::new();
    for path in ["/graphs", "/readyz", "/metrics", "/graphs/g"] {
        answers.push(http_get(&admin, path).await);
    }
    let cli = Command::new(env!("CARGO_BIN_EXE_weir"))
        .args(["graph", "state", "g", "--admin"])
        .arg(format!("http://{admin}"))
        .output()
        .expect("weir graph list runs");
    answers.push(String::from_utf8_lossy(&cli.stdout).into_owned());
    answers.push(String::from_utf8_lossy(&cli.stderr).into_owned());
    common::servers::signal(&weir, "TERM");
    let deadline = Instant::now() + Duration::from_secs(30);
    while weir.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "weir did not stop within 30 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let logged = std::fs::read_to_string(log.path()).unwrap();
    // The answers are the real ones, not refusals.
    assert!(
        answers[0].starts_with("HTTP/1.1 200") && answers[0].contains("\"g\""),
        "{}",
        answers[0]
    );
    assert!(cli.status.success(), "{cli:?}");
    for secret in [nats_password, redis_password] {
        assert!(!logged.contains(secret), "{secret} logged:\n{logged}");
        for answer in &answers {
            assert!(!answer.contains(secret), "{secret} answered:\n{answer}");
        }
    }
}
