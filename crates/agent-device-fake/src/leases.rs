//! The lease registry of reference §7.3, as plain data: every call takes `now` (epoch
//! milliseconds) and answers what 0.21.5 answers, message for message.
//!
//! * allocate mints a 32-hex id; the same tenant, run, backend, provider and device key refreshes
//!   and returns the same lease; a device key held by another lease is `DEVICE_IN_USE`;
//! * heartbeat moves `heartbeatAt` and `expiresAt`; an unknown or expired lease is 401
//!   `Lease is not active` with `details.reason: LEASE_NOT_FOUND` (0.21.5 prunes expired leases
//!   before it looks, so an expired lease reads as not found, never as `LEASE_EXPIRED`);
//! * a device command naming a lease renews it with the default TTL, as 0.21.5's claim rule
//!   does, whatever TTL it was allocated or last heartbeaten with;
//! * release answers `{released:true}` once and `{released:false}` for a lease it does not hold;
//! * a lease that carries an owner (`leaseProvider`, `clientId` or `deviceKey`) is only touched by
//!   a call that names its tenant, run and every owner field (`LEASE_SCOPE_REQUIRED`), and any
//!   field a call names must match (`LEASE_SCOPE_MISMATCH`).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use crate::ids::{LeaseId, RunId, TenantId, is_device_key};
use crate::wire::{DaemonError, ErrorCode};

const INVALID_TENANT: &str =
    "Invalid tenant id. Use 1-128 chars: letters, numbers, dot, underscore, hyphen.";
const INVALID_RUN: &str =
    "Invalid run id. Use 1-128 chars: letters, numbers, dot, underscore, hyphen.";
const INVALID_LEASE: &str = "Invalid lease id.";
const INVALID_DEVICE_KEY: &str = "Invalid device key. Use 1-256 printable characters.";
const NOT_ACTIVE: &str = "Lease is not active";
const SCOPE_MISMATCH: &str = "Lease does not match tenant/run scope";
const SCOPE_REQUIRED: &str = "Lease owner scope is required";

/// The lease backends 0.21.5 knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LeaseBackend {
    /// An iOS simulator on this host (the default).
    #[default]
    IosSimulator,
    /// A provider's iOS instance.
    IosInstance,
    /// A provider's Android instance.
    AndroidInstance,
    /// A provider's HarmonyOS instance.
    HarmonyosInstance,
}

impl LeaseBackend {
    /// The backend of this name.
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "ios-simulator" => Some(Self::IosSimulator),
            "ios-instance" => Some(Self::IosInstance),
            "android-instance" => Some(Self::AndroidInstance),
            "harmonyos-instance" => Some(Self::HarmonyosInstance),
            _ => None,
        }
    }

    /// The backend's name on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::IosSimulator => "ios-simulator",
            Self::IosInstance => "ios-instance",
            Self::AndroidInstance => "android-instance",
            Self::HarmonyosInstance => "harmonyos-instance",
        }
    }
}

/// The TTL rule: a default, and the bounds a caller's `ttlMs` must lie within.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TtlPolicy {
    /// The TTL when a call names none (60000).
    pub default_ms: u64,
    /// The least TTL a call may name (5000).
    pub min_ms: u64,
    /// The greatest TTL a call may name (600000).
    pub max_ms: u64,
}

impl Default for TtlPolicy {
    fn default() -> Self {
        Self {
            default_ms: 60_000,
            min_ms: 5_000,
            max_ms: 600_000,
        }
    }
}

/// A lease the fake holds, with what the fake counts about it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Lease {
    /// The id.
    pub lease_id: LeaseId,
    /// The tenant.
    pub tenant_id: TenantId,
    /// The run.
    pub run_id: RunId,
    /// The backend.
    pub backend: LeaseBackend,
    /// The provider, for provider leases.
    pub lease_provider: Option<String>,
    /// The device key, when one was named.
    pub device_key: Option<String>,
    /// The client id, when one was named.
    pub client_id: Option<String>,
    /// When it was allocated (epoch ms).
    pub created_at: u64,
    /// The last allocate or heartbeat (epoch ms).
    pub heartbeat_at: u64,
    /// When it expires (epoch ms).
    pub expires_at: u64,
    /// The TTL of the last allocate or heartbeat.
    pub ttl_ms: u64,
    /// The session the allocate named.
    pub session: String,
    /// How many heartbeats it has had.
    pub heartbeats: u32,
    /// How many allocates refreshed it after the first.
    pub refreshes: u32,
}

impl Lease {
    /// The `lease` object of a reply.
    pub(crate) fn wire(&self) -> Value {
        let mut out = Map::new();
        out.insert("leaseId".into(), json!(self.lease_id));
        out.insert("tenantId".into(), json!(self.tenant_id));
        out.insert("runId".into(), json!(self.run_id));
        out.insert("backend".into(), json!(self.backend));
        if let Some(provider) = &self.lease_provider {
            out.insert("leaseProvider".into(), json!(provider));
        }
        if let Some(key) = &self.device_key {
            out.insert("deviceKey".into(), json!(key));
        }
        if let Some(client) = &self.client_id {
            out.insert("clientId".into(), json!(client));
        }
        out.insert("createdAt".into(), json!(self.created_at));
        out.insert("heartbeatAt".into(), json!(self.heartbeat_at));
        out.insert("expiresAt".into(), json!(self.expires_at));
        Value::Object(out)
    }

    fn has_owner(&self) -> bool {
        self.lease_provider.is_some() || self.client_id.is_some() || self.device_key.is_some()
    }
}

/// A scope field of a call: absent (or not a string), or a string that does or does not follow
/// its rule.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Field<T> {
    Absent,
    Invalid,
    Valid(T),
}

impl<T> Field<T> {
    fn valid(&self) -> Option<&T> {
        match self {
            Self::Valid(value) => Some(value),
            _ => None,
        }
    }
}

fn string<'a>(params: &'a Map<String, Value>, key: &str) -> Option<&'a str> {
    params.get(key).and_then(Value::as_str)
}

fn field<T>(value: Option<&str>, parse: impl Fn(&str) -> Option<T>) -> Field<T> {
    match value {
        None => Field::Absent,
        Some(raw) => parse(raw).map_or(Field::Invalid, Field::Valid),
    }
}

/// An integral JSON number (JavaScript's `Number.isInteger`); anything else is ignored.
fn integer(params: &Map<String, Value>, key: &str) -> Option<f64> {
    params
        .get(key)
        .and_then(Value::as_f64)
        .filter(|n| n.is_finite() && n.fract() == 0.0)
}

/// The params of a lease call, read as 0.21.5 reads them.
#[derive(Debug, Clone)]
pub(crate) struct LeaseCall {
    /// `session`, default `default`.
    pub(crate) session: String,
    tenant: Field<TenantId>,
    run: Field<RunId>,
    lease_id: Option<LeaseId>,
    ttl_ms: Option<f64>,
    backend: Option<String>,
    provider: Option<String>,
    device_key: Option<String>,
    client_id: Option<String>,
}

impl LeaseCall {
    /// Reads the params of a lease method (a non-object reads as `{}`).
    pub(crate) fn read(params: &Value) -> Self {
        let empty = Map::new();
        let params = params.as_object().unwrap_or(&empty);
        Self {
            session: string(params, "session").unwrap_or("default").to_owned(),
            tenant: field(
                string(params, "tenantId").or_else(|| string(params, "tenant")),
                TenantId::parse,
            ),
            run: field(string(params, "runId"), RunId::parse),
            lease_id: string(params, "leaseId").and_then(LeaseId::parse),
            ttl_ms: integer(params, "ttlMs"),
            backend: string(params, "backend").map(str::to_owned),
            provider: string(params, "leaseProvider")
                .or_else(|| string(params, "provider"))
                .map(str::to_owned),
            device_key: string(params, "deviceKey").map(str::to_owned),
            client_id: string(params, "clientId").map(str::to_owned),
        }
    }

    /// The failure raised before a request log exists: a tenant named but malformed.
    pub(crate) fn early_failure(&self) -> Option<DaemonError> {
        (self.tenant == Field::Invalid)
            .then(|| DaemonError::invalid_args(INVALID_TENANT).unlogged())
    }

    /// The tenant, when the call names a valid one.
    pub(crate) fn tenant(&self) -> Option<&TenantId> {
        self.tenant.valid()
    }
}

/// What a release did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Released {
    /// The lease was held and is now released.
    Released,
    /// No such lease (or not this tenant's): nothing changed.
    NotHeld,
}

/// The leases of one daemon.
#[derive(Debug, Clone, Default)]
pub struct LeaseRegistry {
    policy: TtlPolicy,
    leases: BTreeMap<LeaseId, Lease>,
}

impl LeaseRegistry {
    /// An empty registry with this TTL rule.
    pub fn new(policy: TtlPolicy) -> Self {
        Self {
            policy,
            leases: BTreeMap::new(),
        }
    }

    /// The leases active at `now`, oldest first.
    pub fn active(&self, now: u64) -> Vec<Lease> {
        let mut active: Vec<Lease> = self
            .leases
            .values()
            .filter(|lease| lease.expires_at > now)
            .cloned()
            .collect();
        active.sort_by_key(|lease| lease.created_at);
        active
    }

    /// Forgets the leases that expired by `now`.
    fn prune(&mut self, now: u64) {
        self.leases.retain(|_, lease| lease.expires_at > now);
    }

    fn ttl(&self, ttl_ms: Option<f64>) -> Result<u64, DaemonError> {
        let Some(ttl) = ttl_ms else {
            return Ok(self.policy.default_ms);
        };
        // Integral by construction; bounds are compared as numbers, as JavaScript does.
        #[allow(clippy::cast_precision_loss)]
        let (min, max) = (self.policy.min_ms as f64, self.policy.max_ms as f64);
        if ttl < min || ttl > max {
            return Err(DaemonError::invalid_args(format!(
                "Lease ttlMs must be between {} and {}.",
                self.policy.min_ms, self.policy.max_ms
            )));
        }
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        Ok(ttl as u64)
    }

    /// `agent_device.lease.allocate`.
    ///
    /// # Errors
    /// The daemon's refusal: a malformed tenant, run, TTL, backend or device key, a device key
    /// another lease holds, or a scope that matches a lease of another client.
    pub(crate) fn allocate(&mut self, call: &LeaseCall, now: u64) -> Result<Lease, DaemonError> {
        if let Some(early) = call.early_failure() {
            return Err(early);
        }
        let tenant = call
            .tenant
            .valid()
            .cloned()
            .ok_or_else(|| DaemonError::invalid_args(INVALID_TENANT))?;
        let run = call
            .run
            .valid()
            .cloned()
            .ok_or_else(|| DaemonError::invalid_args(INVALID_RUN))?;
        let ttl = self.ttl(call.ttl_ms)?;
        let backend = match &call.backend {
            None => LeaseBackend::default(),
            Some(name) => LeaseBackend::parse(name).ok_or_else(|| {
                DaemonError::invalid_args(format!("Unsupported lease backend: {name}"))
            })?,
        };
        if let Some(key) = &call.device_key
            && !is_device_key(key)
        {
            return Err(DaemonError::invalid_args(INVALID_DEVICE_KEY));
        }
        self.prune(now);

        let same_scope = self.leases.values_mut().find(|lease| {
            lease.tenant_id == tenant
                && lease.run_id == run
                && lease.backend == backend
                && lease.lease_provider == call.provider
                && lease.device_key == call.device_key
        });
        if let Some(lease) = same_scope {
            if call.client_id.is_some() && lease.client_id != call.client_id {
                return Err(DaemonError::unauthorized(
                    SCOPE_MISMATCH,
                    "LEASE_SCOPE_MISMATCH",
                ));
            }
            lease.heartbeat_at = now;
            lease.expires_at = now + ttl;
            lease.ttl_ms = ttl;
            lease.refreshes += 1;
            return Ok(lease.clone());
        }
        if let Some(key) = &call.device_key
            && let Some(holder) = self
                .leases
                .values()
                .find(|lease| lease.device_key.as_ref() == Some(key))
        {
            let mut details = Map::new();
            details.insert("reason".into(), json!("DEVICE_LEASE_BUSY"));
            details.insert("deviceKey".into(), json!(key));
            details.insert("backend".into(), json!(holder.backend));
            if let Some(provider) = &holder.lease_provider {
                details.insert("leaseProvider".into(), json!(provider));
            }
            details.insert("expiresAt".into(), json!(holder.expires_at));
            return Err(
                DaemonError::new(ErrorCode::DeviceInUse, "Device is already leased")
                    .with_hint("Retry after the lease expires or close the owning session.")
                    .with_retriable(true)
                    .with_details(Value::Object(details)),
            );
        }
        let lease = Lease {
            lease_id: LeaseId::mint(),
            tenant_id: tenant,
            run_id: run,
            backend,
            lease_provider: call.provider.clone(),
            device_key: call.device_key.clone(),
            client_id: call.client_id.clone(),
            created_at: now,
            heartbeat_at: now,
            expires_at: now + ttl,
            ttl_ms: ttl,
            session: call.session.clone(),
            heartbeats: 0,
            refreshes: 0,
        };
        self.leases.insert(lease.lease_id.clone(), lease.clone());
        Ok(lease)
    }

    /// The owner checks shared by heartbeat and release, after the tenant check release makes.
    fn check_owner(lease: &Lease, call: &LeaseCall) -> Result<(), DaemonError> {
        if lease.has_owner() {
            let named = call.tenant.valid().is_some()
                && call.run.valid().is_some()
                && (lease.lease_provider.is_none() || call.provider.is_some())
                && (lease.client_id.is_none() || call.client_id.is_some())
                && (lease.device_key.is_none() || call.device_key.is_some());
            if !named {
                return Err(DaemonError::unauthorized(
                    SCOPE_REQUIRED,
                    "LEASE_SCOPE_REQUIRED",
                ));
            }
        }
        Ok(())
    }

    fn check_fields(lease: &Lease, call: &LeaseCall) -> Result<(), DaemonError> {
        let differs = call.tenant.valid().is_some_and(|t| *t != lease.tenant_id)
            || call.run.valid().is_some_and(|r| *r != lease.run_id)
            || call.run == Field::Invalid
            || (call.provider.is_some() && call.provider != lease.lease_provider)
            || (call.client_id.is_some() && call.client_id != lease.client_id)
            || (call.device_key.is_some() && call.device_key != lease.device_key);
        if differs {
            return Err(DaemonError::unauthorized(
                SCOPE_MISMATCH,
                "LEASE_SCOPE_MISMATCH",
            ));
        }
        Ok(())
    }

    fn lease_id(call: &LeaseCall) -> Result<LeaseId, DaemonError> {
        call.lease_id
            .clone()
            .ok_or_else(|| DaemonError::invalid_args(INVALID_LEASE))
    }

    /// `agent_device.lease.heartbeat`.
    ///
    /// # Errors
    /// A malformed tenant, lease id or TTL; a lease that is not active; a scope that does not
    /// match.
    pub(crate) fn heartbeat(&mut self, call: &LeaseCall, now: u64) -> Result<Lease, DaemonError> {
        if let Some(early) = call.early_failure() {
            return Err(early);
        }
        let id = Self::lease_id(call)?;
        let ttl = self.ttl(call.ttl_ms)?;
        self.prune(now);
        let lease = self
            .leases
            .get_mut(&id)
            .ok_or_else(|| DaemonError::unauthorized(NOT_ACTIVE, "LEASE_NOT_FOUND"))?;
        Self::check_owner(lease, call)?;
        Self::check_fields(lease, call)?;
        lease.heartbeat_at = now;
        lease.expires_at = now + ttl;
        lease.ttl_ms = ttl;
        lease.heartbeats += 1;
        Ok(lease.clone())
    }

    /// `agent_device.lease.release`.
    ///
    /// # Errors
    /// A malformed tenant or lease id, or an owner scope that is missing or does not match.
    pub(crate) fn release(&mut self, call: &LeaseCall, now: u64) -> Result<Released, DaemonError> {
        if let Some(early) = call.early_failure() {
            return Err(early);
        }
        let id = Self::lease_id(call)?;
        self.prune(now);
        let Some(lease) = self.leases.get(&id) else {
            return Ok(Released::NotHeld);
        };
        Self::check_owner(lease, call)?;
        if call.tenant.valid().is_some_and(|t| *t != lease.tenant_id) {
            return Ok(Released::NotHeld);
        }
        Self::check_fields(lease, call)?;
        self.leases.remove(&id);
        Ok(Released::Released)
    }

    /// The lease check of a command that names a lease under a tenant; the lease is then
    /// renewed with the default TTL, whatever TTL it had, as 0.21.5 renews it on every device
    /// command (its claim rule heartbeats the lease without the TTL).
    ///
    /// # Errors
    /// The lease is not active, or its tenant, run or backend differ from the command's.
    pub(crate) fn admit_command(
        &mut self,
        tenant: &TenantId,
        run: Option<&RunId>,
        lease_id: &LeaseId,
        backend: LeaseBackend,
        now: u64,
    ) -> Result<(), DaemonError> {
        self.prune(now);
        let lease = self
            .leases
            .get(lease_id)
            .ok_or_else(|| DaemonError::unauthorized(NOT_ACTIVE, "LEASE_NOT_FOUND"))?;
        if lease.tenant_id != *tenant
            || run.is_some_and(|r| *r != lease.run_id)
            || lease.backend != backend
        {
            return Err(DaemonError::unauthorized(
                SCOPE_MISMATCH,
                "LEASE_SCOPE_MISMATCH",
            ));
        }
        let ttl = self.policy.default_ms;
        if let Some(lease) = self.leases.get_mut(lease_id) {
            lease.heartbeat_at = now;
            lease.expires_at = now + ttl;
            lease.ttl_ms = ttl;
        }
        Ok(())
    }

    /// Releases a lease by id (a session's `close`); whether it was held.
    pub(crate) fn release_id(&mut self, id: &LeaseId, now: u64) -> bool {
        self.prune(now);
        self.leases.remove(id).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(params: Value) -> LeaseCall {
        LeaseCall::read(&params)
    }

    fn reason(err: &DaemonError) -> Option<&str> {
        err.details
            .as_ref()
            .and_then(|d| d.get("reason"))
            .and_then(Value::as_str)
    }

    fn registry() -> LeaseRegistry {
        LeaseRegistry::new(TtlPolicy::default())
    }

    const T0: u64 = 1_796_133_674_244;

    #[test]
    fn allocate_mints_a_lease_with_the_default_ttl() {
        let mut leases = registry();
        let lease = leases
            .allocate(
                &call(json!({"session":"s1","tenantId":"acme","runId":"run1","backend":"android-instance"})),
                T0,
            )
            .unwrap();
        assert_eq!(lease.lease_id.as_str().len(), 32);
        assert_eq!(lease.backend, LeaseBackend::AndroidInstance);
        assert_eq!(
            (lease.created_at, lease.heartbeat_at, lease.expires_at),
            (T0, T0, T0 + 60_000)
        );
        assert_eq!(
            lease.wire(),
            json!({"leaseId": lease.lease_id, "tenantId":"acme","runId":"run1","backend":"android-instance",
                   "createdAt":T0,"heartbeatAt":T0,"expiresAt":T0 + 60_000})
        );
        assert_eq!(leases.active(T0).len(), 1);
    }

    #[test]
    fn the_same_scope_refreshes_the_same_lease_and_another_run_gets_its_own() {
        let mut leases = registry();
        let scope = json!({"tenantId":"acme","runId":"run1","backend":"android-instance"});
        let first = leases.allocate(&call(scope.clone()), T0).unwrap();
        let again = leases.allocate(&call(scope), T0 + 4).unwrap();
        assert_eq!(again.lease_id, first.lease_id);
        assert_eq!(
            (again.created_at, again.heartbeat_at, again.expires_at),
            (T0, T0 + 4, T0 + 60_004)
        );
        assert_eq!(again.refreshes, 1);
        let other_run = leases
            .allocate(
                &call(json!({"tenantId":"acme","runId":"run2","backend":"android-instance"})),
                T0,
            )
            .unwrap();
        let other_backend = leases
            .allocate(&call(json!({"tenantId":"acme","runId":"run1"})), T0)
            .unwrap();
        assert_ne!(other_run.lease_id, first.lease_id);
        assert_eq!(other_backend.backend, LeaseBackend::IosSimulator);
        assert_ne!(other_backend.lease_id, first.lease_id);
        assert_eq!(leases.active(T0 + 4).len(), 3);
    }

    #[test]
    fn allocate_refuses_bad_scopes_with_the_daemon_messages() {
        let mut leases = registry();
        let cases = [
            (json!({"runId":"r"}), INVALID_TENANT, false),
            (json!({"tenantId":5,"runId":"r"}), INVALID_TENANT, false),
            (json!({"tenantId":"a b","runId":"r"}), INVALID_TENANT, true),
            (json!({"tenantId":"a"}), INVALID_RUN, false),
            (json!({"tenantId":"a","runId":"r b"}), INVALID_RUN, false),
            (
                json!({"tenantId":"a","runId":"r","backend":"bogus"}),
                "Unsupported lease backend: bogus",
                false,
            ),
            (
                json!({"tenantId":"a","runId":"r","deviceKey":""}),
                INVALID_DEVICE_KEY,
                false,
            ),
            (
                json!({"tenantId":"a","runId":"r","deviceKey":"x".repeat(257)}),
                INVALID_DEVICE_KEY,
                false,
            ),
        ];
        for (params, message, unlogged) in cases {
            let err = leases.allocate(&call(params.clone()), T0).unwrap_err();
            assert_eq!(err.code, ErrorCode::InvalidArgs, "{params}");
            assert_eq!(err.message, message, "{params}");
            assert_eq!(err.unlogged, unlogged, "{params}");
        }
        assert!(
            leases.active(T0).is_empty(),
            "a refused allocate holds nothing"
        );
    }

    #[test]
    fn ttl_is_checked_at_both_bounds_and_one_past_each() {
        let mut leases = registry();
        let with_ttl = |ttl: Value, run: &str| json!({"tenantId":"a","runId":run,"ttlMs":ttl});
        for (ttl, ok) in [
            (json!(4_999), false),
            (json!(5_000), true),
            (json!(600_000), true),
            (json!(600_001), false),
            (json!(1), false),
        ] {
            let outcome = leases.allocate(&call(with_ttl(ttl.clone(), &format!("r{ttl}"))), T0);
            assert_eq!(outcome.is_ok(), ok, "ttl {ttl}");
            if let Err(err) = outcome {
                assert_eq!(err.message, "Lease ttlMs must be between 5000 and 600000.");
            }
        }
        // A TTL that is not an integer is ignored, as 0.21.5 ignores it.
        for ttl in [json!(5000.5), json!("6000"), json!(null)] {
            let lease = leases
                .allocate(&call(with_ttl(ttl.clone(), "loose")), T0)
                .unwrap();
            assert_eq!(lease.expires_at - lease.heartbeat_at, 60_000, "ttl {ttl}");
        }
        let short = leases
            .allocate(&call(with_ttl(json!(5_000), "r5000")), T0)
            .unwrap();
        assert_eq!(short.expires_at, T0 + 5_000);
    }

    #[test]
    fn heartbeat_moves_the_expiry_and_counts() {
        let mut leases = registry();
        let lease = leases
            .allocate(
                &call(json!({"tenantId":"t","runId":"run1","ttlMs":5000})),
                T0,
            )
            .unwrap();
        let id = lease.lease_id.as_str();
        let beat = leases
            .heartbeat(
                &call(json!({"tenantId":"t","runId":"run1","leaseId":id,"ttlMs":120_000})),
                T0 + 3,
            )
            .unwrap();
        assert_eq!(
            (beat.heartbeat_at, beat.expires_at, beat.heartbeats),
            (T0 + 3, T0 + 120_003, 1)
        );
        let beat = leases
            .heartbeat(&call(json!({"leaseId": id.to_uppercase()})), T0 + 5)
            .unwrap();
        assert_eq!((beat.expires_at, beat.heartbeats), (T0 + 60_005, 2));
    }

    #[test]
    fn heartbeat_of_an_unknown_or_expired_lease_is_not_active() {
        let mut leases = registry();
        let lease = leases
            .allocate(&call(json!({"tenantId":"t","runId":"r","ttlMs":5000})), T0)
            .unwrap();
        let params = json!({"tenantId":"t","runId":"r","leaseId":lease.lease_id});
        // One millisecond before expiry the lease is alive; at expiry it is gone.
        assert!(leases.heartbeat(&call(params.clone()), T0 + 4_999).is_ok());
        let err = leases
            .heartbeat(&call(params), T0 + 4_999 + 60_000)
            .unwrap_err();
        assert_eq!(
            (err.code, err.message.as_str(), reason(&err)),
            (ErrorCode::Unauthorized, NOT_ACTIVE, Some("LEASE_NOT_FOUND"))
        );
        assert_eq!(err.http_status().as_u16(), 401);
        let unknown = leases
            .heartbeat(&call(json!({"leaseId":"0".repeat(32)})), T0)
            .unwrap_err();
        assert_eq!(reason(&unknown), Some("LEASE_NOT_FOUND"));
        assert!(leases.active(T0 + 70_000).is_empty());
    }

    #[test]
    fn heartbeat_refuses_malformed_ids_and_other_scopes() {
        let mut leases = registry();
        let lease = leases
            .allocate(&call(json!({"tenantId":"t","runId":"r"})), T0)
            .unwrap();
        let id = lease.lease_id.as_str();
        for params in [
            json!({"leaseId":"nothex"}),
            json!({}),
            json!({"leaseId":"0".repeat(15)}),
            json!({"leaseId":"0".repeat(129)}),
        ] {
            let err = leases.heartbeat(&call(params.clone()), T0).unwrap_err();
            assert_eq!(err.message, INVALID_LEASE, "{params}");
            assert_eq!(err.http_status().as_u16(), 400);
        }
        for params in [
            json!({"tenantId":"other","leaseId":id}),
            json!({"runId":"run2","leaseId":id}),
            json!({"leaseProvider":"proxy","leaseId":id}),
            json!({"deviceKey":"zz","leaseId":id}),
        ] {
            let err = leases.heartbeat(&call(params.clone()), T0).unwrap_err();
            assert_eq!(reason(&err), Some("LEASE_SCOPE_MISMATCH"), "{params}");
        }
        let ttl = leases
            .heartbeat(&call(json!({"leaseId":id,"ttlMs":1})), T0)
            .unwrap_err();
        assert_eq!(ttl.code, ErrorCode::InvalidArgs);
        let bad_tenant = leases
            .heartbeat(&call(json!({"tenantId":"a b","leaseId":id})), T0)
            .unwrap_err();
        assert!(bad_tenant.unlogged);
        assert_eq!(
            leases.active(T0)[0].heartbeats,
            0,
            "refused heartbeats change nothing"
        );
    }

    #[test]
    fn release_answers_true_once_then_false() {
        let mut leases = registry();
        let lease = leases
            .allocate(&call(json!({"tenantId":"t","runId":"r"})), T0)
            .unwrap();
        let params = json!({"tenantId":"t","runId":"r","leaseId":lease.lease_id});
        assert_eq!(
            leases.release(
                &call(json!({"tenantId":"other","leaseId":lease.lease_id})),
                T0
            ),
            Ok(Released::NotHeld),
            "another tenant's release is a no"
        );
        let mismatch = leases
            .release(&call(json!({"runId":"zzz","leaseId":lease.lease_id})), T0)
            .unwrap_err();
        assert_eq!(reason(&mismatch), Some("LEASE_SCOPE_MISMATCH"));
        assert_eq!(
            leases.release(&call(params.clone()), T0),
            Ok(Released::Released)
        );
        assert_eq!(
            leases.release(&call(params.clone()), T0),
            Ok(Released::NotHeld)
        );
        let beat = leases.heartbeat(&call(params), T0).unwrap_err();
        assert_eq!(reason(&beat), Some("LEASE_NOT_FOUND"));
        let bad = leases
            .release(&call(json!({"leaseId":"nothex"})), T0)
            .unwrap_err();
        assert_eq!(bad.message, INVALID_LEASE);
        assert_eq!(
            leases.release(&call(json!({"leaseId":"0".repeat(128)})), T0),
            Ok(Released::NotHeld)
        );
    }

    #[test]
    fn an_owned_lease_needs_its_whole_scope() {
        let mut leases = registry();
        let lease = leases
            .allocate(
                &call(
                    json!({"tenantId":"t","runId":"w","backend":"android-instance",
                             "leaseProvider":"proxy","clientId":"c1","deviceKey":"dk7"}),
                ),
                T0,
            )
            .unwrap();
        let full = json!({"leaseId":lease.lease_id,"tenantId":"t","runId":"w",
                          "leaseProvider":"proxy","clientId":"c1","deviceKey":"dk7"});
        for drop in [
            "tenantId",
            "runId",
            "leaseProvider",
            "clientId",
            "deviceKey",
        ] {
            let mut params = full.clone();
            params.as_object_mut().unwrap().remove(drop);
            let err = leases.heartbeat(&call(params.clone()), T0).unwrap_err();
            assert_eq!(reason(&err), Some("LEASE_SCOPE_REQUIRED"), "without {drop}");
            let err = leases.release(&call(params), T0).unwrap_err();
            assert_eq!(reason(&err), Some("LEASE_SCOPE_REQUIRED"), "without {drop}");
        }
        let mut other_client = full.clone();
        other_client["clientId"] = json!("c2");
        let err = leases.heartbeat(&call(other_client), T0).unwrap_err();
        assert_eq!(reason(&err), Some("LEASE_SCOPE_MISMATCH"));
        assert!(leases.heartbeat(&call(full.clone()), T0).is_ok());
        assert_eq!(leases.release(&call(full), T0), Ok(Released::Released));
    }

    #[test]
    fn a_leased_device_key_is_busy_for_another_run() {
        let mut leases = registry();
        let first = leases
            .allocate(
                &call(
                    json!({"tenantId":"a","runId":"r5","deviceKey":"local:linux:none:local",
                             "leaseProvider":"proxy","clientId":"abc"}),
                ),
                T0,
            )
            .unwrap();
        let err = leases
            .allocate(
                &call(
                    json!({"tenantId":"a","runId":"r6","deviceKey":"local:linux:none:local",
                             "leaseProvider":"proxy","clientId":"abd"}),
                ),
                T0,
            )
            .unwrap_err();
        assert_eq!(err.code, ErrorCode::DeviceInUse);
        assert_eq!(err.retriable, Some(true));
        assert_eq!(
            err.details,
            Some(
                json!({"reason":"DEVICE_LEASE_BUSY","deviceKey":"local:linux:none:local",
                        "backend":"ios-simulator","leaseProvider":"proxy","expiresAt":first.expires_at})
            )
        );
        // Once the holder expires, the key is free.
        assert!(
            leases
                .allocate(
                    &call(
                        json!({"tenantId":"a","runId":"r6","deviceKey":"local:linux:none:local"})
                    ),
                    first.expires_at,
                )
                .is_ok()
        );
    }

    #[test]
    fn a_client_id_that_differs_from_the_scope_holder_is_a_mismatch() {
        let mut leases = registry();
        leases
            .allocate(&call(json!({"tenantId":"t","runId":"z"})), T0)
            .unwrap();
        let err = leases
            .allocate(
                &call(json!({"tenantId":"t","runId":"z","clientId":"q"})),
                T0,
            )
            .unwrap_err();
        assert_eq!(reason(&err), Some("LEASE_SCOPE_MISMATCH"));
    }

    #[test]
    fn a_command_checks_tenant_run_and_backend() {
        let mut leases = registry();
        let lease = leases
            .allocate(
                &call(json!({"tenantId":"acme","runId":"r1","backend":"android-instance"})),
                T0,
            )
            .unwrap();
        let acme = TenantId::parse("acme").unwrap();
        let r1 = RunId::parse("r1").unwrap();
        let id = &lease.lease_id;
        assert!(
            leases
                .admit_command(&acme, Some(&r1), id, LeaseBackend::AndroidInstance, T0)
                .is_ok()
        );
        let err = leases
            .admit_command(&acme, Some(&r1), id, LeaseBackend::IosSimulator, T0)
            .unwrap_err();
        assert_eq!(reason(&err), Some("LEASE_SCOPE_MISMATCH"));
        let other = TenantId::parse("other").unwrap();
        assert!(
            leases
                .admit_command(&other, None, id, LeaseBackend::AndroidInstance, T0)
                .is_err()
        );
        let unknown = LeaseId::parse(&"1".repeat(32)).unwrap();
        let err = leases
            .admit_command(&acme, None, &unknown, LeaseBackend::AndroidInstance, T0)
            .unwrap_err();
        assert_eq!(reason(&err), Some("LEASE_NOT_FOUND"));
        assert!(leases.release_id(id, T0));
        assert!(!leases.release_id(id, T0));
    }

    #[test]
    fn a_command_renews_its_lease_with_the_default_ttl_whatever_ttl_it_had() {
        let mut leases = registry();
        let lease = leases
            .allocate(
                &call(json!({"tenantId":"acme","runId":"r1","ttlMs":600_000,"backend":"android-instance"})),
                T0,
            )
            .unwrap();
        assert_eq!(lease.expires_at, T0 + 600_000);
        let acme = TenantId::parse("acme").unwrap();
        let at = T0 + 1_000;
        leases
            .admit_command(
                &acme,
                None,
                &lease.lease_id,
                LeaseBackend::AndroidInstance,
                at,
            )
            .unwrap();
        let renewed = leases.active(at).remove(0);
        assert_eq!(
            (renewed.heartbeat_at, renewed.expires_at, renewed.ttl_ms),
            (at, at + 60_000, 60_000)
        );
        // So a lease left alone after its command ends 60 s later.
        assert!(leases.active(at + 60_000).is_empty());
    }
}
