//! Certificates a test makes for itself with `openssl`: a CA, a server certificate for
//! 127.0.0.1 and localhost, and a client certificate, all signed by that CA.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

pub struct Certs {
    pub dir: tempfile::TempDir,
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .expect("openssl runs");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Certs {
    pub fn make() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let d = dir.path();
        openssl(
            d,
            &[
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                "ca.key",
                "-out",
                "ca.pem",
                "-days",
                "2",
                "-subj",
                "/CN=weir test CA",
            ],
        );
        std::fs::write(
            d.join("server.ext"),
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n",
        )
        .unwrap();
        std::fs::write(d.join("client.ext"), "extendedKeyUsage=clientAuth\n").unwrap();
        for who in ["server", "client"] {
            openssl(
                d,
                &[
                    "req",
                    "-newkey",
                    "rsa:2048",
                    "-nodes",
                    "-keyout",
                    &format!("{who}.key"),
                    "-out",
                    &format!("{who}.csr"),
                    "-subj",
                    &format!("/CN={who}"),
                ],
            );
            openssl(
                d,
                &[
                    "x509",
                    "-req",
                    "-in",
                    &format!("{who}.csr"),
                    "-CA",
                    "ca.pem",
                    "-CAkey",
                    "ca.key",
                    "-CAcreateserial",
                    "-out",
                    &format!("{who}.pem"),
                    "-days",
                    "2",
                    "-extfile",
                    &format!("{who}.ext"),
                ],
            );
        }
        Self { dir }
    }

    fn file(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    pub fn ca(&self) -> PathBuf {
        self.file("ca.pem")
    }

    pub fn server_cert(&self) -> PathBuf {
        self.file("server.pem")
    }

    pub fn server_key(&self) -> PathBuf {
        self.file("server.key")
    }

    pub fn client_cert(&self) -> PathBuf {
        self.file("client.pem")
    }

    pub fn client_key(&self) -> PathBuf {
        self.file("client.key")
    }
}
