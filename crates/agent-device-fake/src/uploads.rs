//! Uploads (reference §5) as plain data taking `now`: preflight tickets keyed for idempotence,
//! the resumable PUT's offset rules, finalize's size and SHA-256 checks, and the legacy one-shot
//! upload. The bytes themselves are never kept: each PUT feeds a running SHA-256 that is
//! committed with the offset, so an upload of any size costs a few hundred bytes of state.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::ids::{TenantId, hex, uuid};
use crate::wire::{DaemonError, ErrorCode};

/// The largest upload a preflight may announce (2 GiB).
pub const MAX_UPLOAD_BYTES: u64 = 2_147_483_648;
/// An upload is forgotten this long after its last chunk (or its preflight).
pub const UPLOAD_IDLE_MS: u64 = 300_000;
/// The largest safe integer of JavaScript.
const MAX_SAFE_INTEGER: f64 = 9_007_199_254_740_991.0;

/// What an upload holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ArtifactType {
    /// One file (an `.apk`, an `.ipa`, …).
    File,
    /// A tar of an app bundle directory.
    AppBundle,
}

impl ArtifactType {
    fn parse(name: &str) -> Option<Self> {
        match name {
            "file" => Some(Self::File),
            "app-bundle" => Some(Self::AppBundle),
            _ => None,
        }
    }
}

/// How an upload reached the fake.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum UploadRoute {
    /// Preflight, PUT, finalize.
    Direct,
    /// The legacy `POST /upload`.
    Legacy,
}

/// An upload that was finalized: what a later command may name as `meta.uploadedArtifactId`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FinalizedUpload {
    /// The artifact id finalize answered (a fresh UUID).
    pub id: String,
    /// The resumable upload's id (the preflight's `uploadId`); `None` for a legacy upload.
    pub upload_id: Option<String>,
    /// The file name (sanitised: its last path component).
    pub file_name: String,
    /// Its size in bytes.
    pub size: u64,
    /// The SHA-256 of the bytes received, lower-case hex.
    pub sha256: String,
    /// File or app bundle.
    pub artifact_type: ArtifactType,
    /// The platform the preflight named.
    pub platform: Option<String>,
    /// The tenant of the preflight (`x-agent-device-tenant`).
    pub tenant: Option<TenantId>,
    /// Direct or legacy.
    pub route: UploadRoute,
    /// When it was finalized (epoch ms).
    pub finalized_at: u64,
}

/// A preflight body, checked as 0.21.5 checks it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Preflight {
    attempt: String,
    sha256: String,
    raw_file_name: String,
    size: u64,
    artifact_type: ArtifactType,
    platform: Option<String>,
    /// The ticket's `content-type`.
    pub(crate) content_type: String,
}

fn required(body: &serde_json::Map<String, Value>, key: &str) -> Result<String, DaemonError> {
    match body.get(key).and_then(Value::as_str) {
        Some(value) if !value.is_empty() => Ok(value.to_owned()),
        _ => Err(DaemonError::invalid_args(format!("{key} is required"))),
    }
}

impl Preflight {
    /// Reads a preflight body.
    ///
    /// # Errors
    /// `INVALID_ARGS` naming the first field that is missing or malformed.
    pub(crate) fn read(body: &[u8]) -> Result<Self, DaemonError> {
        let parsed: Value = serde_json::from_slice(body)
            .map_err(|_| DaemonError::invalid_args("Invalid JSON request body"))?;
        let Some(body) = parsed.as_object() else {
            return Err(DaemonError::invalid_args("Invalid JSON request body"));
        };
        let attempt = required(body, "uploadAttemptId")?;
        let sha256 = required(body, "sha256")?;
        if sha256.len() != 64 || !sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(DaemonError::invalid_args("Invalid upload sha256"));
        }
        let raw_file_name = required(body, "fileName")?;
        let size = body
            .get("sizeBytes")
            .and_then(Value::as_f64)
            .filter(|n| n.fract() == 0.0 && n.abs() <= MAX_SAFE_INTEGER)
            .ok_or_else(|| DaemonError::invalid_args("sizeBytes must be an integer"))?;
        if size < 0.0 {
            return Err(DaemonError::invalid_args("Invalid upload sizeBytes"));
        }
        // A safe, non-negative integer.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let size = size as u64;
        if size > MAX_UPLOAD_BYTES {
            return Err(DaemonError::invalid_args(format!(
                "Upload exceeds maximum size of {MAX_UPLOAD_BYTES} bytes"
            )));
        }
        let artifact_type = required(body, "artifactType")?;
        let artifact_type = ArtifactType::parse(&artifact_type).ok_or_else(|| {
            DaemonError::invalid_args("artifactType must be \"file\" or \"app-bundle\"")
        })?;
        let text = |key: &str| body.get(key).and_then(Value::as_str).map(str::to_owned);
        Ok(Self {
            attempt,
            sha256: sha256.to_ascii_lowercase(),
            raw_file_name,
            size,
            artifact_type,
            platform: text("platform"),
            content_type: text("contentType")
                .unwrap_or_else(|| "application/octet-stream".to_owned()),
        })
    }
}

/// The last path component of a client's file name (never empty).
pub(crate) fn sanitize_file_name(name: &str) -> String {
    let base = name.rsplit(['/', '\\']).next().unwrap_or_default();
    if base.is_empty() || base == "." || base == ".." {
        "upload".to_owned()
    } else {
        base.to_owned()
    }
}

/// What makes two preflights the same upload.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Key {
    tenant: Option<TenantId>,
    attempt: String,
    sha256: String,
    size: u64,
    file_name: String,
    artifact_type: ArtifactType,
    platform: Option<String>,
}

#[derive(Debug, Clone)]
struct Pending {
    key: Key,
    tenant: Option<TenantId>,
    file_name: String,
    size: u64,
    sha256: String,
    artifact_type: ArtifactType,
    platform: Option<String>,
    received: u64,
    hasher: Sha256,
    /// A PUT is streaming into it.
    busy: bool,
    last_activity: u64,
}

/// What to do with a PUT's body.
#[derive(Debug, Clone)]
pub(crate) enum PutPlan {
    /// The PUT does not start at the current offset: answer 308 with it and take nothing.
    Resume {
        /// The bytes held so far.
        offset: u64,
    },
    /// Take the body, starting at the current offset.
    Accept {
        /// At most this many bytes (the rest of the upload, or the content-range's length).
        limit: u64,
        /// Whether exactly `limit` bytes must arrive (a content-range named the length).
        exact: bool,
        /// The running hash to continue.
        hasher: Sha256,
    },
}

/// Where an upload stands after a PUT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PutOutcome {
    /// Every byte is in: `200 ok`.
    Complete,
    /// `308` with `range: bytes=0-<offset-1>` and `x-upload-offset: <offset>`.
    Partial {
        /// The bytes held so far.
        offset: u64,
    },
}

/// Parses `bytes <start>-<end>/<total>`.
fn content_range(header: &str) -> Option<(u64, u64, u64)> {
    let rest = header.trim().strip_prefix("bytes ")?;
    let (range, total) = rest.split_once('/')?;
    let (start, end) = range.split_once('-')?;
    let number = |s: &str| {
        (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
            .then(|| s.parse::<u64>().ok())
            .flatten()
    };
    Some((number(start)?, number(end)?, number(total)?))
}

fn not_found(id: &str) -> DaemonError {
    DaemonError::new(
        ErrorCode::CommandFailed,
        format!("Upload not found or expired: {id}"),
    )
}

fn other_tenant() -> DaemonError {
    DaemonError::new(
        ErrorCode::Unauthorized,
        "Upload belongs to a different tenant",
    )
}

/// The uploads of one daemon.
#[derive(Debug, Default)]
pub(crate) struct Uploads {
    pending: BTreeMap<String, Pending>,
    by_key: BTreeMap<Key, String>,
    finalized: Vec<FinalizedUpload>,
}

impl Uploads {
    fn prune(&mut self, now: u64) {
        let stale: Vec<String> = self
            .pending
            .iter()
            .filter(|(_, p)| !p.busy && p.last_activity + UPLOAD_IDLE_MS <= now)
            .map(|(id, _)| id.clone())
            .collect();
        for id in stale {
            self.remove(&id);
        }
    }

    fn remove(&mut self, id: &str) {
        if let Some(pending) = self.pending.remove(id) {
            self.by_key.remove(&pending.key);
        }
    }

    /// A preflight: the upload id (the same one for the same key while it is pending).
    pub(crate) fn preflight(
        &mut self,
        preflight: &Preflight,
        tenant: Option<TenantId>,
        now: u64,
    ) -> String {
        self.prune(now);
        let key = Key {
            tenant: tenant.clone(),
            attempt: preflight.attempt.clone(),
            sha256: preflight.sha256.clone(),
            size: preflight.size,
            file_name: preflight.raw_file_name.clone(),
            artifact_type: preflight.artifact_type,
            platform: preflight.platform.clone(),
        };
        if let Some(id) = self.by_key.get(&key) {
            if let Some(pending) = self.pending.get_mut(id) {
                pending.last_activity = now;
            }
            return id.clone();
        }
        let id = uuid();
        self.by_key.insert(key.clone(), id.clone());
        self.pending.insert(
            id.clone(),
            Pending {
                key,
                tenant,
                file_name: sanitize_file_name(&preflight.raw_file_name),
                size: preflight.size,
                sha256: preflight.sha256.clone(),
                artifact_type: preflight.artifact_type,
                platform: preflight.platform.clone(),
                received: 0,
                hasher: Sha256::new(),
                busy: false,
                last_activity: now,
            },
        );
        id
    }

    fn pending_for(
        &mut self,
        id: &str,
        tenant: Option<&TenantId>,
    ) -> Result<&mut Pending, DaemonError> {
        let pending = self.pending.get_mut(id).ok_or_else(|| not_found(id))?;
        if pending.tenant.is_some() && pending.tenant.as_ref() != tenant {
            return Err(other_tenant());
        }
        Ok(pending)
    }

    /// The start of a PUT.
    ///
    /// # Errors
    /// An unknown upload, another tenant's upload, or a malformed `content-range`.
    pub(crate) fn begin_put(
        &mut self,
        id: &str,
        tenant: Option<&TenantId>,
        range: Option<&str>,
        now: u64,
    ) -> Result<PutPlan, DaemonError> {
        self.prune(now);
        let pending = self.pending_for(id, tenant)?;
        let (start, exact_len) = match range {
            None => (0, None),
            Some(header) => {
                let (start, end, _) = content_range(header)
                    .filter(|&(start, end, total)| {
                        total == pending.size && start <= end && end < total
                    })
                    .ok_or_else(|| DaemonError::invalid_args("Invalid content-range header"))?;
                (start, Some(end - start + 1))
            }
        };
        if pending.busy || start != pending.received {
            return Ok(PutPlan::Resume {
                offset: pending.received,
            });
        }
        pending.busy = true;
        pending.last_activity = now;
        Ok(PutPlan::Accept {
            limit: exact_len.unwrap_or(pending.size - start),
            exact: exact_len.is_some(),
            hasher: pending.hasher.clone(),
        })
    }

    /// The end of an accepted PUT: `taken` more bytes hashed into `hasher`, or `None` when the
    /// PUT was refused and nothing it carried is kept.
    pub(crate) fn end_put(
        &mut self,
        id: &str,
        taken: Option<(u64, Sha256)>,
        now: u64,
    ) -> PutOutcome {
        let Some(pending) = self.pending.get_mut(id) else {
            return PutOutcome::Partial { offset: 0 };
        };
        pending.busy = false;
        pending.last_activity = now;
        if let Some((taken, hasher)) = taken {
            pending.received += taken;
            pending.hasher = hasher;
        }
        if pending.received == pending.size {
            PutOutcome::Complete
        } else {
            PutOutcome::Partial {
                offset: pending.received,
            }
        }
    }

    /// Finalize: a fresh artifact id once every byte is in and the hash matches.
    ///
    /// # Errors
    /// An unknown or other tenant's upload, an incomplete one (kept), or a hash mismatch (the
    /// upload is dropped).
    pub(crate) fn finalize(
        &mut self,
        id: &str,
        tenant: Option<&TenantId>,
        now: u64,
    ) -> Result<FinalizedUpload, DaemonError> {
        self.prune(now);
        let pending = self.pending_for(id, tenant)?;
        if pending.busy || pending.received < pending.size {
            return Err(DaemonError::invalid_args("Upload is incomplete"));
        }
        let digest = hex(&pending.hasher.clone().finalize());
        if digest != pending.sha256 {
            self.remove(id);
            return Err(DaemonError::invalid_args("Upload hash mismatch"));
        }
        let done = FinalizedUpload {
            id: uuid(),
            upload_id: Some(id.to_owned()),
            file_name: pending.file_name.clone(),
            size: pending.size,
            sha256: digest,
            artifact_type: pending.artifact_type,
            platform: pending.platform.clone(),
            tenant: pending.tenant.clone(),
            route: UploadRoute::Direct,
            finalized_at: now,
        };
        self.remove(id);
        self.finalized.push(done.clone());
        Ok(done)
    }

    /// A legacy upload that arrived whole (0.21.5 does not check its announced hash).
    pub(crate) fn legacy(
        &mut self,
        file_name: &str,
        artifact_type: ArtifactType,
        size: u64,
        sha256: String,
        tenant: Option<TenantId>,
        now: u64,
    ) -> FinalizedUpload {
        let done = FinalizedUpload {
            id: uuid(),
            upload_id: None,
            file_name: sanitize_file_name(file_name),
            size,
            sha256,
            artifact_type,
            platform: None,
            tenant,
            route: UploadRoute::Legacy,
            finalized_at: now,
        };
        self.finalized.push(done.clone());
        done
    }

    /// Every finalized upload, oldest first.
    pub(crate) fn finalized(&self) -> &[FinalizedUpload] {
        &self.finalized
    }
}

/// Reads a legacy upload's headers: the artifact type and file name.
///
/// # Errors
/// A missing header, or a type that is neither `file` nor `app-bundle`.
pub(crate) fn legacy_headers(
    artifact_type: Option<&str>,
    file_name: Option<&str>,
) -> Result<(ArtifactType, String), DaemonError> {
    let (Some(kind), Some(name)) = (
        artifact_type.filter(|s| !s.is_empty()),
        file_name.filter(|s| !s.is_empty()),
    ) else {
        return Err(DaemonError::invalid_args(
            "Missing required headers: x-artifact-type and x-artifact-filename",
        ));
    };
    let kind = ArtifactType::parse(kind).ok_or_else(|| {
        DaemonError::invalid_args(format!(
            "Invalid x-artifact-type: {kind}. Must be \"file\" or \"app-bundle\"."
        ))
    })?;
    Ok((kind, name.to_owned()))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    const DATA: &[u8] = b"hello world 14";

    fn sha(bytes: &[u8]) -> String {
        hex(&Sha256::digest(bytes))
    }

    fn preflight_of(bytes: &[u8], attempt: &str) -> Preflight {
        let body = json!({"uploadAttemptId":attempt,"sha256":sha(bytes),"fileName":"f.apk",
                          "sizeBytes":bytes.len(),"artifactType":"file"});
        Preflight::read(body.to_string().as_bytes()).unwrap()
    }

    /// Feeds `bytes` through an accepted PUT.
    fn put(uploads: &mut Uploads, id: &str, range: Option<&str>, bytes: &[u8]) -> PutOutcome {
        match uploads.begin_put(id, None, range, 0).unwrap() {
            PutPlan::Resume { offset } => PutOutcome::Partial { offset },
            PutPlan::Accept {
                limit,
                exact,
                mut hasher,
            } => {
                let len = bytes.len() as u64;
                if len > limit || (exact && len != limit) {
                    return uploads.end_put(id, None, 0);
                }
                hasher.update(bytes);
                uploads.end_put(id, Some((len, hasher)), 0)
            }
        }
    }

    #[test]
    fn preflight_names_the_first_bad_field() {
        let good = json!({"uploadAttemptId":"a","sha256":"0".repeat(64),"fileName":"f",
                          "sizeBytes":1,"artifactType":"file"});
        let cases: [(&str, Value, &str); 12] = [
            (
                "uploadAttemptId",
                Value::Null,
                "uploadAttemptId is required",
            ),
            ("uploadAttemptId", json!(""), "uploadAttemptId is required"),
            ("uploadAttemptId", json!(5), "uploadAttemptId is required"),
            ("sha256", Value::Null, "sha256 is required"),
            ("sha256", json!("XYZ"), "Invalid upload sha256"),
            ("fileName", json!(7), "fileName is required"),
            ("sizeBytes", Value::Null, "sizeBytes must be an integer"),
            ("sizeBytes", json!(1.5), "sizeBytes must be an integer"),
            ("sizeBytes", json!("14"), "sizeBytes must be an integer"),
            ("sizeBytes", json!(-1), "Invalid upload sizeBytes"),
            ("artifactType", Value::Null, "artifactType is required"),
            (
                "artifactType",
                json!("zip"),
                "artifactType must be \"file\" or \"app-bundle\"",
            ),
        ];
        for (key, value, message) in cases {
            let mut body = good.clone();
            if value.is_null() {
                body.as_object_mut().unwrap().remove(key);
            } else {
                body[key] = value;
            }
            let err = Preflight::read(body.to_string().as_bytes()).unwrap_err();
            assert_eq!(
                (err.code, err.message.as_str()),
                (ErrorCode::InvalidArgs, message),
                "{key}"
            );
        }
        assert_eq!(
            Preflight::read(b"{bad").unwrap_err().message,
            "Invalid JSON request body"
        );
        assert_eq!(
            Preflight::read(b"[]").unwrap_err().message,
            "Invalid JSON request body"
        );
    }

    #[test]
    fn the_size_bound_is_two_gib() {
        let body = |size: Value| {
            json!({"uploadAttemptId":"a","sha256":"0".repeat(64),"fileName":"f",
                   "sizeBytes":size,"artifactType":"file"})
            .to_string()
        };
        assert!(Preflight::read(body(json!(MAX_UPLOAD_BYTES)).as_bytes()).is_ok());
        assert_eq!(
            Preflight::read(body(json!(MAX_UPLOAD_BYTES + 1)).as_bytes())
                .unwrap_err()
                .message,
            "Upload exceeds maximum size of 2147483648 bytes"
        );
        assert_eq!(
            Preflight::read(body(json!(9_007_199_254_740_992_u64)).as_bytes())
                .unwrap_err()
                .message,
            "sizeBytes must be an integer"
        );
    }

    #[test]
    fn the_same_key_gets_the_same_ticket_until_it_is_finalized() {
        let mut uploads = Uploads::default();
        let pre = preflight_of(DATA, "p1");
        let id = uploads.preflight(&pre, None, 0);
        assert_eq!(uploads.preflight(&pre, None, 1), id);
        let acme = TenantId::parse("acme");
        assert_ne!(
            uploads.preflight(&pre, acme, 1),
            id,
            "the tenant is part of the key"
        );
        assert_ne!(uploads.preflight(&preflight_of(DATA, "p2"), None, 1), id);
        assert_eq!(put(&mut uploads, &id, None, DATA), PutOutcome::Complete);
        uploads.finalize(&id, None, 2).unwrap();
        assert_ne!(uploads.preflight(&pre, None, 3), id);
    }

    #[test]
    fn a_partial_put_resumes_from_its_offset() {
        let mut uploads = Uploads::default();
        let id = uploads.preflight(&preflight_of(DATA, "p"), None, 0);
        assert_eq!(
            put(&mut uploads, &id, None, &DATA[..5]),
            PutOutcome::Partial { offset: 5 }
        );
        // A PUT that does not start at the offset takes nothing.
        assert_eq!(
            put(&mut uploads, &id, None, &DATA[5..]),
            PutOutcome::Partial { offset: 5 }
        );
        assert_eq!(
            put(&mut uploads, &id, Some("bytes 0-8/14"), &DATA[..9]),
            PutOutcome::Partial { offset: 5 }
        );
        assert_eq!(
            put(&mut uploads, &id, Some("bytes 5-7/14"), &DATA[5..8]),
            PutOutcome::Partial { offset: 8 }
        );
        assert_eq!(
            put(&mut uploads, &id, Some("bytes 8-13/14"), &DATA[8..]),
            PutOutcome::Complete
        );
        assert_eq!(
            put(&mut uploads, &id, Some("bytes 5-12/14"), &DATA[5..13]),
            PutOutcome::Partial { offset: 14 }
        );
        let done = uploads.finalize(&id, None, 1).unwrap();
        assert_eq!((done.size, done.sha256.as_str()), (14, sha(DATA).as_str()));
        assert_ne!(done.id, id, "finalize answers a new id");
        assert_eq!(uploads.finalized().len(), 1);
    }

    #[test]
    fn malformed_ranges_are_refused() {
        let mut uploads = Uploads::default();
        let id = uploads.preflight(&preflight_of(DATA, "p"), None, 0);
        for header in [
            "bytes 5-13/15",
            "garbage",
            "bytes */14",
            "bytes 14-22/14",
            "bytes 9-5/14",
            "bytes 0-13/14 extra",
            "bytes -1-3/14",
        ] {
            let err = uploads.begin_put(&id, None, Some(header), 0).unwrap_err();
            assert_eq!(err.message, "Invalid content-range header", "{header}");
            assert_eq!(err.http_status().as_u16(), 400);
        }
    }

    #[test]
    fn finalize_checks_completeness_then_the_hash() {
        let mut uploads = Uploads::default();
        let id = uploads.preflight(&preflight_of(DATA, "p"), None, 0);
        put(&mut uploads, &id, None, &DATA[..5]);
        assert_eq!(
            uploads.finalize(&id, None, 0).unwrap_err().message,
            "Upload is incomplete"
        );
        // An incomplete upload is kept.
        assert_eq!(
            put(&mut uploads, &id, Some("bytes 5-13/14"), &DATA[5..]),
            PutOutcome::Complete
        );
        assert!(uploads.finalize(&id, None, 0).is_ok());
        assert_eq!(
            uploads.finalize(&id, None, 0).unwrap_err().message,
            format!("Upload not found or expired: {id}")
        );

        let mut wrong = preflight_of(DATA, "q");
        wrong.sha256 = "0".repeat(64);
        let id = uploads.preflight(&wrong, None, 0);
        put(&mut uploads, &id, None, DATA);
        let err = uploads.finalize(&id, None, 0).unwrap_err();
        assert_eq!(err.message, "Upload hash mismatch");
        assert!(
            uploads.finalize(&id, None, 0).is_err(),
            "a mismatched upload is dropped"
        );
        assert_eq!(uploads.finalized().len(), 1);
    }

    #[test]
    fn an_empty_upload_finalizes_without_a_put() {
        let mut uploads = Uploads::default();
        let id = uploads.preflight(&preflight_of(b"", "e"), None, 0);
        assert_eq!(uploads.finalize(&id, None, 0).unwrap().size, 0);
    }

    #[test]
    fn a_tenants_upload_is_refused_to_others() {
        let mut uploads = Uploads::default();
        let acme = TenantId::parse("acme");
        let other = TenantId::parse("other");
        let id = uploads.preflight(&preflight_of(DATA, "t"), acme.clone(), 0);
        for tenant in [other.as_ref(), None] {
            assert_eq!(
                uploads.begin_put(&id, tenant, None, 0).unwrap_err().message,
                "Upload belongs to a different tenant"
            );
            assert_eq!(
                uploads
                    .finalize(&id, tenant, 0)
                    .unwrap_err()
                    .http_status()
                    .as_u16(),
                401
            );
        }
        // An untenanted upload takes a PUT that names a tenant.
        let open = uploads.preflight(&preflight_of(DATA, "u"), None, 0);
        assert!(uploads.begin_put(&open, acme.as_ref(), None, 0).is_ok());
    }

    #[test]
    fn an_idle_upload_expires_after_five_minutes() {
        let mut uploads = Uploads::default();
        let id = uploads.preflight(&preflight_of(DATA, "x"), None, 0);
        assert!(
            uploads
                .begin_put(&id, None, None, UPLOAD_IDLE_MS - 1)
                .is_ok()
        );
        uploads.end_put(&id, None, UPLOAD_IDLE_MS - 1);
        assert!(
            uploads
                .begin_put(&id, None, None, 2 * UPLOAD_IDLE_MS - 2)
                .is_ok()
        );
        uploads.end_put(&id, None, 2 * UPLOAD_IDLE_MS - 2);
        let err = uploads
            .begin_put(&id, None, None, 3 * UPLOAD_IDLE_MS)
            .unwrap_err();
        assert_eq!(err.code, ErrorCode::CommandFailed);
    }

    #[test]
    fn a_second_put_while_one_streams_is_told_the_offset() {
        let mut uploads = Uploads::default();
        let id = uploads.preflight(&preflight_of(DATA, "c"), None, 0);
        assert!(matches!(
            uploads.begin_put(&id, None, None, 0).unwrap(),
            PutPlan::Accept { .. }
        ));
        assert!(matches!(
            uploads.begin_put(&id, None, None, 0).unwrap(),
            PutPlan::Resume { offset: 0 }
        ));
    }

    #[test]
    fn file_names_lose_their_directories() {
        assert_eq!(sanitize_file_name("../../etc/passwd"), "passwd");
        assert_eq!(sanitize_file_name("C:\\x\\app.apk"), "app.apk");
        assert_eq!(sanitize_file_name("dir/"), "upload");
        assert_eq!(sanitize_file_name(".."), "upload");
    }

    #[test]
    fn legacy_headers_are_required() {
        assert!(legacy_headers(Some("file"), Some("f.apk")).is_ok());
        assert_eq!(
            legacy_headers(None, Some("f.apk")).unwrap_err().message,
            "Missing required headers: x-artifact-type and x-artifact-filename"
        );
        assert_eq!(
            legacy_headers(Some("zip"), Some("f")).unwrap_err().message,
            "Invalid x-artifact-type: zip. Must be \"file\" or \"app-bundle\"."
        );
    }
}
