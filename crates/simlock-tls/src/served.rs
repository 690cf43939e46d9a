//! What a server's own certificate says about itself, read when the certificate is loaded and
//! watched while it is served: a CA certificate (which clients refuse as a server's own), and
//! its validity against the clock (expired, not valid yet, or expiring soon). These are warnings,
//! not refusals: a server starts with such a certificate, and a renewed one written over the
//! files is served from the next connection (ADR 0024).

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use x509_parser::prelude::{FromDer, X509Certificate};

use crate::failure::CA_CERTIFICATE;
use crate::{LEAF_REMEDY, PemFile, utc};

/// How long before its end a served certificate is warned about: 7 days.
pub(crate) const EXPIRY_NOTICE_SECS: i64 = 7 * 24 * 3600;

/// Where a server reads the time its certificate is checked against.
#[derive(Clone)]
pub(crate) struct Clock(Arc<dyn Fn() -> SystemTime + Send + Sync>);

impl std::fmt::Debug for Clock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Clock")
    }
}

impl Clock {
    pub(crate) fn new(now: impl Fn() -> SystemTime + Send + Sync + 'static) -> Self {
        Self(Arc::new(now))
    }

    /// Now, in seconds after the UNIX epoch (negative before it).
    pub(crate) fn unix_now(&self) -> i64 {
        match (self.0)().duration_since(UNIX_EPOCH) {
            Ok(after) => i64::try_from(after.as_secs()).unwrap_or(i64::MAX),
            Err(before) => i64::try_from(before.duration().as_secs()).map_or(i64::MIN, |s| -s),
        }
    }
}

/// A certificate's validity, in seconds after the UNIX epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Validity {
    pub(crate) not_before: i64,
    pub(crate) not_after: i64,
}

/// How a served certificate stands against the clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Standing {
    Valid,
    ExpiresSoon,
    Expired,
    NotValidYet,
}

impl Validity {
    pub(crate) fn standing(self, now: i64) -> Standing {
        if now < self.not_before {
            Standing::NotValidYet
        } else if now > self.not_after {
            Standing::Expired
        } else if self.not_after.saturating_sub(now) <= EXPIRY_NOTICE_SECS {
            Standing::ExpiresSoon
        } else {
            Standing::Valid
        }
    }

    /// The warning for a certificate in `file` standing as it does at `now`, or `None` when it
    /// is valid for more than [`EXPIRY_NOTICE_SECS`].
    pub(crate) fn warning(self, file: &PemFile, now: i64) -> Option<String> {
        let named = format!("{} ({})", file.key, file.path.display());
        let here = utc(now);
        let rotate = "write a renewed certificate and key over the files: the next connection is \
                      served them, without a restart";
        match self.standing(now) {
            Standing::Valid => None,
            Standing::Expired => Some(format!(
                "{named}: the certificate expired at {} (valid from {}; the time here is {here}), \
                 so clients refuse it: {rotate}",
                utc(self.not_after),
                utc(self.not_before),
            )),
            Standing::NotValidYet => Some(format!(
                "{named}: the certificate is not valid before {} (the time here is {here}), so \
                 clients refuse it until then: check this machine's clock, or the certificate's \
                 dates",
                utc(self.not_before),
            )),
            Standing::ExpiresSoon => Some(format!(
                "{named}: the certificate expires at {}, in {} (the time here is {here}): {rotate} \
                 before then",
                utc(self.not_after),
                span(self.not_after.saturating_sub(now)),
            )),
        }
    }
}

/// A span of seconds in the largest whole unit that says it well.
fn span(secs: i64) -> String {
    let (count, unit) = match secs {
        s if s >= 2 * 86_400 => (s / 86_400, "days"),
        s if s >= 2 * 3_600 => (s / 3_600, "hours"),
        s if s >= 120 => (s / 60, "minutes"),
        s => (s.max(0), "seconds"),
    };
    format!("{count} {unit}")
}

/// What a leaf certificate says about itself, as far as the server warns about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Inspected {
    pub(crate) validity: Validity,
    /// It says basicConstraints CA:TRUE.
    pub(crate) ca: bool,
}

/// Reads a leaf certificate (DER); a description when it cannot be read.
pub(crate) fn inspect(der: &[u8]) -> Result<Inspected, String> {
    let (_, certificate) = X509Certificate::from_der(der).map_err(|e| e.to_string())?;
    let validity = certificate.validity();
    // A malformed extension says nothing of CA:TRUE; the dates are still watched.
    let ca = certificate
        .basic_constraints()
        .ok()
        .flatten()
        .is_some_and(|constraints| constraints.value.ca);
    Ok(Inspected {
        validity: Validity {
            not_before: validity.not_before.timestamp(),
            not_after: validity.not_after.timestamp(),
        },
        ca,
    })
}

/// The warning for a CA certificate in `file` served as a server's own.
pub(crate) fn ca_warning(file: &PemFile) -> String {
    format!(
        "{} ({}): {CA_CERTIFICATE}, which TLS clients (simlock's workers and CLI among them) \
         refuse as a server's own: {LEAF_REMEDY}",
        file.key,
        file.path.display()
    )
}
