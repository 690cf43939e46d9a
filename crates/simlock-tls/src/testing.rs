//! Certificates made at test time (rcgen): a CA, leaves it signs for the names a test dials,
//! and the PEM files a daemon or client is configured with.

#![allow(
    clippy::expect_used,
    clippy::missing_panics_doc,
    reason = "test support fails the test by panicking"
)]

use std::path::{Path, PathBuf};

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};

/// A certificate authority made for one test.
pub struct TestCa {
    issuer: Issuer<'static, KeyPair>,
    pem: String,
}

impl std::fmt::Debug for TestCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestCa").finish_non_exhaustive()
    }
}

/// A leaf certificate and its key, in PEM.
#[derive(Debug, Clone)]
pub struct TestLeaf {
    /// The certificate, then the CA's (the chain a server sends).
    pub cert_pem: String,
    /// The private key (PKCS#8).
    pub key_pem: String,
}

/// Where [`TestLeaf::write`] put a leaf's files.
#[derive(Debug, Clone)]
pub struct LeafFiles {
    /// The certificate chain.
    pub cert: PathBuf,
    /// The key.
    pub key: PathBuf,
}

impl TestCa {
    /// A new CA named `name`.
    pub fn new(name: &str) -> Self {
        let key = KeyPair::generate().expect("a CA key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let cert = params.self_signed(&key).expect("a self-signed CA");
        Self {
            pem: cert.pem(),
            issuer: Issuer::new(params, key),
        }
    }

    /// The CA's certificate in PEM (what a client's CA file holds).
    pub fn pem(&self) -> &str {
        &self.pem
    }

    /// Writes the CA's certificate to `path` and returns it.
    pub fn write(&self, path: &Path) -> PathBuf {
        std::fs::write(path, &self.pem).expect("the CA file is written");
        path.to_owned()
    }

    /// A leaf for `names` (DNS names or IP addresses), signed by this CA.
    pub fn leaf(&self, names: &[&str]) -> TestLeaf {
        self.signed(leaf_params(names))
    }

    /// A leaf for `names` signed by this CA, valid from `not_before` to `not_after` (seconds
    /// after the UNIX epoch).
    pub fn leaf_valid(&self, names: &[&str], not_before: i64, not_after: i64) -> TestLeaf {
        let mut params = leaf_params(names);
        params.not_before = date(not_before);
        params.not_after = date(not_after);
        self.signed(params)
    }

    fn signed(&self, params: CertificateParams) -> TestLeaf {
        let key = KeyPair::generate().expect("a leaf key");
        let cert = params.signed_by(&key, &self.issuer).expect("a signed leaf");
        TestLeaf {
            cert_pem: format!("{}{}", cert.pem(), self.pem),
            key_pem: key.serialize_pem(),
        }
    }
}

fn leaf_params(names: &[&str]) -> CertificateParams {
    let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
    let mut params = CertificateParams::new(names).expect("leaf parameters");
    params
        .distinguished_name
        .push(DnType::CommonName, "simlock test leaf");
    params
}

fn date(unix_secs: i64) -> time::OffsetDateTime {
    time::OffsetDateTime::from_unix_timestamp(unix_secs).expect("a date rcgen can write")
}

impl TestLeaf {
    /// A self-signed certificate for `names`, its own CA file. With `ca` it says
    /// basicConstraints CA:TRUE, as one made by `openssl req -x509` with openssl's defaults
    /// does; without, CA:FALSE, as the recipe in docs/CONFIGURATION.md (TLS) makes it.
    pub fn self_signed(names: &[&str], ca: bool) -> Self {
        let key = KeyPair::generate().expect("a key");
        let mut params = leaf_params(names);
        params.is_ca = if ca {
            IsCa::Ca(BasicConstraints::Unconstrained)
        } else {
            IsCa::ExplicitNoCa
        };
        let cert = params.self_signed(&key).expect("a self-signed certificate");
        Self {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        }
    }

    /// Writes `cert.pem` and `key.pem` into `dir` (replacing what is there).
    pub fn write(&self, dir: &Path) -> LeafFiles {
        let files = LeafFiles {
            cert: dir.join("cert.pem"),
            key: dir.join("key.pem"),
        };
        std::fs::write(&files.cert, &self.cert_pem).expect("the certificate is written");
        std::fs::write(&files.key, &self.key_pem).expect("the key is written");
        files
    }

    /// The leaf certificate in DER (to compare with what a server presents).
    pub fn leaf_der(&self) -> Vec<u8> {
        use rustls::pki_types::CertificateDer;
        use rustls::pki_types::pem::PemObject;
        CertificateDer::pem_slice_iter(self.cert_pem.as_bytes())
            .next()
            .expect("a certificate")
            .expect("PEM")
            .to_vec()
    }
}
