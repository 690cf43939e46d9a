//! What the gateway answers about the whole fleet: status summed over connected workers, the
//! union of their catalogs, and lists across every view.

use std::collections::BTreeMap;

use simlock_contract::model::{
    Capacity, Connection, DaemonInfo, Device, GlobalCapacity, Health, Mode, Platform,
    PlatformCapacity, PlatformCatalog, WaitingRequest, WorkerView,
};
use simlock_contract::ops::{CatalogOutput, StatusOutput};
use simlock_daemon::context::{CallCtx, Viewer};

use crate::fleet::Fleet;

fn add(a: &mut PlatformCapacity, b: &PlatformCapacity) {
    a.running += b.running;
    a.max_running += b.max_running;
    a.reserved += b.reserved;
    a.warm += b.warm;
    a.over_limit |= b.over_limit;
}

impl Fleet {
    /// `status.get` on a gateway; while starting only `daemon` and `host`.
    pub fn status(&self, ctx: &CallCtx, health: Health, version: &str) -> StatusOutput {
        let daemon = DaemonInfo {
            health,
            mode: Mode::Gateway,
            version: version.to_owned(),
            instance_id: self.gateway_id().to_owned(),
        };
        if health != Health::Running {
            let host = simlock_daemon::host::facts(simlock_daemon::host::os_version());
            return StatusOutput::bare(daemon, host);
        }
        let views = self.views_seen_by(ctx.viewer());
        let mut capacity = Capacity::default();
        let mut ram_ios = true;
        let mut ram_android = true;
        let mut any = false;
        for view in views
            .iter()
            .filter(|v| v.connection == Connection::Connected)
        {
            let Some(c) = view.capacity else { continue };
            any = true;
            add(&mut capacity.ios, &c.ios);
            add(&mut capacity.android, &c.android);
            ram_ios &= c.ios.at_ram_budget;
            ram_android &= c.android.at_ram_budget;
            let g: &mut GlobalCapacity = &mut capacity.global;
            g.running += c.global.running;
            g.max_running += c.global.max_running;
            g.reserved += c.global.reserved;
            g.warm += c.global.warm;
            g.over_limit |= c.global.over_limit;
        }
        capacity.ios.at_ram_budget = any && ram_ios;
        capacity.android.at_ram_budget = any && ram_android;
        StatusOutput {
            daemon,
            host: simlock_daemon::host::facts(simlock_daemon::host::os_version()),
            capacity: Some(capacity),
            devices: Some(self.devices()),
            leases: Some(self.leases(ctx)),
            queue_depth: Some(self.queue_depth()),
            waiting: Some(self.all_waiting(ctx.viewer())),
            capabilities: None,
            drivers: None,
            lease: Some(self.limits),
            workers: Some(views),
            uplink: None,
        }
    }

    /// Every device of every worker, with its worker (the core's [`crate::state::Core::devices`]).
    pub fn devices(&self) -> Vec<Device> {
        self.shared.lock().core.devices()
    }

    /// The fleet queue's waiting requests, then each worker's own, as far as `viewer` may see
    /// them (the core's [`crate::state::Core::all_waiting`]): an agent its own pending requests,
    /// an admin all.
    pub fn all_waiting(&self, viewer: Viewer<'_>) -> Vec<WaitingRequest> {
        self.shared.lock().core.all_waiting(viewer)
    }

    /// Every view, with the nested leases and waiting requests `viewer` may see (the core's
    /// [`crate::state::Core::views_seen_by`]): an admin the views as the workers report them,
    /// an agent only its own leases (the rule of the lease list, `Core::seen`) and requests.
    pub fn views_seen_by(&self, viewer: Viewer<'_>) -> Vec<WorkerView> {
        self.shared.lock().core.views_seen_by(viewer)
    }

    /// `catalog.get` on a gateway: the union of the connected workers' catalogs, with which
    /// workers serve each model and runtime.
    pub fn catalog(&self, platform: Option<Platform>) -> CatalogOutput {
        let mut merged: BTreeMap<Platform, PlatformCatalog> = BTreeMap::new();
        let mut defaults: BTreeMap<Platform, Vec<Option<String>>> = BTreeMap::new();
        for view in self
            .views()
            .into_iter()
            .filter(|v| v.connection == Connection::Connected)
        {
            for catalog in view.catalog.unwrap_or_default() {
                // A worker whose driver cannot serve the platform adds nothing to it.
                if platform.is_some_and(|p| p != catalog.platform) || catalog.unavailable.is_some()
                {
                    continue;
                }
                defaults
                    .entry(catalog.platform)
                    .or_default()
                    .push(catalog.default_runtime.clone());
                let entry = merged
                    .entry(catalog.platform)
                    .or_insert_with(|| PlatformCatalog {
                        platform: catalog.platform,
                        models: Vec::new(),
                        runtimes: Vec::new(),
                        default_runtime: None,
                        model_runtimes: BTreeMap::new(),
                        model_aliases: BTreeMap::new(),
                        model_workers: Some(BTreeMap::new()),
                        runtime_workers: Some(BTreeMap::new()),
                        unavailable: None,
                    });
                for model in &catalog.models {
                    if !entry.models.contains(model) {
                        entry.models.push(model.clone());
                    }
                    let runtimes = entry.model_runtimes.entry(model.clone()).or_default();
                    for r in catalog.model_runtimes.get(model).into_iter().flatten() {
                        if !runtimes.contains(r) {
                            runtimes.push(r.clone());
                        }
                    }
                    let aliases = entry.model_aliases.entry(model.clone()).or_default();
                    for a in catalog.model_aliases.get(model).into_iter().flatten() {
                        if !aliases.contains(a) {
                            aliases.push(a.clone());
                        }
                    }
                    if let Some(workers) = entry.model_workers.as_mut() {
                        workers
                            .entry(model.clone())
                            .or_default()
                            .push(view.id.clone());
                    }
                }
                for runtime in &catalog.runtimes {
                    if !entry.runtimes.contains(runtime) {
                        entry.runtimes.push(runtime.clone());
                    }
                    if let Some(workers) = entry.runtime_workers.as_mut() {
                        workers
                            .entry(runtime.clone())
                            .or_default()
                            .push(view.id.clone());
                    }
                }
            }
        }
        for (platform, entry) in &mut merged {
            let all = defaults.get(platform).cloned().unwrap_or_default();
            if let Some(first) = all.first()
                && all.iter().all(|d| d == first)
            {
                entry.default_runtime.clone_from(first);
            }
        }
        CatalogOutput {
            platforms: merged.into_values().collect(),
        }
    }
}
