//! The worker's operation handlers, registered into the daemon's router.
//!
//! Handlers are thin: the pipeline has parsed the input and checked the role; each handler
//! asks the [`Worker`] and answers. Token, event, stop and relay operations are registered by
//! other crates.

use std::sync::Arc;

use simlock_contract::ErrorCode;
use simlock_contract::ops::{
    CatalogGet, ConfigGet, DeviceExec, LeaseCancel, LeaseGet, LeaseList, LeaseRelease,
    LeaseReleaseAll, LeaseRenew, LeaseRequest, ListGet, StatusGet, WorkerList, WorkerListOutput,
};
use simlock_daemon::{CallCtx, Router, StartupGate};

use crate::worker::Worker;

/// The operations a worker answers itself.
pub const OPERATIONS: &[&str] = &[
    "status.get",
    "catalog.get",
    "config.get",
    "list.get",
    "lease.request",
    "lease.renew",
    "lease.release",
    "lease.cancel",
    "lease.list",
    "lease.get",
    "lease.release-all",
    "device.exec",
    "worker.list",
    "worker.drain",
    "worker.undrain",
    "worker.remove",
];

/// The gateway-only operations a worker refuses with `UNSUPPORTED_IN_WORKER_MODE`.
pub const GATEWAY_ONLY: &[&str] = &["worker.drain", "worker.undrain", "worker.remove"];

/// Registers the worker's handlers. `gate` is the pipeline's start-up gate (`status.get` and
/// `worker.list` report it).
pub fn register(router: &mut Router, worker: &Arc<Worker>, gate: StartupGate) {
    let (w, g) = (worker.clone(), gate.clone());
    router.handle::<StatusGet, _, _>(move |ctx, _| {
        let status = w.status(&g, ctx.viewer());
        async move { Ok(status) }
    });
    let w = worker.clone();
    router.handle::<CatalogGet, _, _>(move |_, input| {
        let catalog = w.catalog(input.platform);
        async move { Ok(catalog) }
    });
    let w = worker.clone();
    router.handle::<ConfigGet, _, _>(move |_, _| {
        let view = w.config_view();
        async move { Ok(view) }
    });
    let w = worker.clone();
    router.handle::<ListGet, _, _>(move |_, input| {
        let w = w.clone();
        async move { Ok(w.list(input.kind)) }
    });
    let w = worker.clone();
    router.handle::<LeaseRequest, _, _>(move |ctx: CallCtx, input| {
        let w = w.clone();
        async move { w.request_lease(&ctx, input).await }
    });
    let w = worker.clone();
    router.handle::<LeaseRenew, _, _>(move |ctx: CallCtx, input| {
        let w = w.clone();
        async move { w.renew(&ctx, &input) }
    });
    let w = worker.clone();
    router.handle_authorized::<LeaseRelease, _, _, _>(
        |ctx, input| input.authorize(ctx.role),
        move |ctx, input| {
            let w = w.clone();
            async move { w.release(&ctx, &input.lease_id, input.reason) }
        },
    );
    let (w, auth) = (worker.clone(), worker.clone());
    router.handle_authorized::<LeaseCancel, _, _, _>(
        move |ctx, input| auth.authorize_cancel(ctx, input.requester_id.as_deref()),
        move |ctx: CallCtx, input| {
            let w = w.clone();
            async move { w.cancel(&ctx, input.requester_id.as_deref()) }
        },
    );
    let w = worker.clone();
    router.handle::<LeaseList, _, _>(move |ctx: CallCtx, _| {
        let w = w.clone();
        async move { Ok(w.lease_list(&ctx)) }
    });
    let w = worker.clone();
    router.handle::<LeaseGet, _, _>(move |ctx: CallCtx, input| {
        let answer = w.lease_get(&ctx, &input.lease_id);
        async move { answer }
    });
    let w = worker.clone();
    router.handle::<LeaseReleaseAll, _, _>(move |ctx: CallCtx, _| {
        let w = w.clone();
        async move { w.release_all(&ctx) }
    });
    let w = worker.clone();
    router.handle_authorized::<DeviceExec, _, _, _>(Worker::authorize_exec, move |ctx, input| {
        let w = w.clone();
        async move { w.exec(&ctx, input).await }
    });
    let (w, g) = (worker.clone(), gate);
    router.handle::<WorkerList, _, _>(move |ctx, _| {
        let view = w.worker_view(&g, ctx.viewer());
        async move {
            Ok(WorkerListOutput {
                workers: vec![view],
            })
        }
    });
    router.unsupported(GATEWAY_ONLY, ErrorCode::UnsupportedInWorkerMode);
}
