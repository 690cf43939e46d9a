//! The gateway's handlers: the contract's operations answered for the whole fleet.

use std::sync::Arc;

use simlock_contract::ops::ConfigView;
use simlock_contract::ops::{
    CatalogGet, ConfigGet, DeviceExec, LeaseCancel, LeaseCancelOutput, LeaseGet, LeaseGetOutput,
    LeaseList, LeaseRelease, LeaseReleaseAll, LeaseRenew, LeaseRequest, ListGet, ListKind,
    ListOutput, ReleaseAllOutput, StatusGet, WorkerDrain, WorkerDrainOutput, WorkerList,
    WorkerListOutput, WorkerRemove, WorkerRemoveOutput, WorkerUndrain,
};
use simlock_contract::{ContractError, ErrorCode, Role};
use simlock_daemon::pipeline::{Router, StartupGate};

use crate::fleet::Fleet;

/// Registers every fleet operation on the gateway's router.
pub fn register(
    router: &mut Router,
    fleet: &Arc<Fleet>,
    gate: &StartupGate,
    config_view: ConfigView,
    version: &str,
) {
    let (f, g, v) = (fleet.clone(), gate.clone(), version.to_owned());
    router.handle::<StatusGet, _, _>(move |ctx, _| {
        let out = f.status(&ctx, g.health(), &v);
        async move { Ok(out) }
    });
    let f = fleet.clone();
    router.handle::<CatalogGet, _, _>(move |_, input| {
        let out = f.catalog(input.platform);
        async move { Ok(out) }
    });
    let view = config_view;
    router.handle::<ConfigGet, _, _>(move |_, _| {
        let out = view.clone();
        async move { Ok(out) }
    });
    let f = fleet.clone();
    router.handle::<ListGet, _, _>(move |ctx, input| {
        let out = match input.kind {
            ListKind::Devices => ListOutput::Devices(f.devices()),
            ListKind::Leases => ListOutput::Leases(f.leases(&ctx)),
            ListKind::Requests => ListOutput::Requests(f.all_waiting(ctx.viewer())),
            ListKind::Rules => ListOutput::Rules(Vec::new()),
        };
        async move { Ok(out) }
    });
    let f = fleet.clone();
    router.handle::<LeaseRequest, _, _>(move |ctx, input| {
        let f = f.clone();
        async move { f.request_lease(&ctx, input).await }
    });
    let f = fleet.clone();
    router.handle::<LeaseRenew, _, _>(move |ctx, input| {
        let f = f.clone();
        async move { f.renew(&ctx, input).await }
    });
    let f = fleet.clone();
    router.handle_authorized::<LeaseRelease, _, _, _>(
        |ctx, input| input.authorize(ctx.role),
        move |ctx, input| {
            let f = f.clone();
            async move { f.release(&ctx, &input.lease_id, input.reason).await }
        },
    );
    let (f, authorize) = (fleet.clone(), fleet.clone());
    router.handle_authorized::<LeaseCancel, _, _, _>(
        move |ctx, input| {
            let requester = input
                .requester_id
                .clone()
                .unwrap_or_else(|| ctx.principal.clone());
            match authorize.pending_owner(&requester) {
                Some(owner) if owner != ctx.principal && ctx.role != Role::Admin => Err(
                    ContractError::forbidden("That pending request belongs to another principal"),
                ),
                _ => Ok(()),
            }
        },
        move |ctx, input| {
            let requester = input.requester_id.unwrap_or_else(|| ctx.principal.clone());
            let outcome = f
                .cancel_request(&ctx, &requester)
                .map(|result| LeaseCancelOutput { result });
            async move { outcome }
        },
    );
    let f = fleet.clone();
    router.handle::<LeaseList, _, _>(move |ctx, _| {
        let output = f.lease_list(&ctx);
        async move { Ok(output) }
    });
    let f = fleet.clone();
    router.handle::<LeaseGet, _, _>(move |ctx, input| {
        let answer = f
            .lease_seen(&ctx, &input.lease_id)
            .map(|lease| LeaseGetOutput { lease });
        async move { answer }
    });
    let f = fleet.clone();
    router.handle::<LeaseReleaseAll, _, _>(move |ctx, _| {
        let f = f.clone();
        async move {
            f.release_all(&ctx)
                .await
                .map(|lease_ids| ReleaseAllOutput { lease_ids })
        }
    });
    let f = fleet.clone();
    router.handle::<DeviceExec, _, _>(move |ctx, input| {
        let f = f.clone();
        async move { f.exec(&ctx, input).await }
    });
    let f = fleet.clone();
    router.handle::<WorkerList, _, _>(move |ctx, _| {
        let workers = f.views_seen_by(ctx.viewer());
        async move { Ok(WorkerListOutput { workers }) }
    });
    let f = fleet.clone();
    router.handle::<WorkerDrain, _, _>(move |_, input| {
        std::future::ready(set_drained(&f, input.worker_id, true))
    });
    let f = fleet.clone();
    router.handle::<WorkerUndrain, _, _>(move |_, input| {
        std::future::ready(set_drained(&f, input.worker_id, false))
    });
    let f = fleet.clone();
    router.handle::<WorkerRemove, _, _>(move |_, input| {
        let out = f.resolve_worker(&input.worker_id).and_then(|worker_id| {
            f.remove(&worker_id)
                .map(|removed| WorkerRemoveOutput { worker_id, removed })
        });
        async move { out }
    });
    router.unsupported(
        &["relay.request", "relay.cancel"],
        ErrorCode::UnsupportedInGatewayMode,
    );
}

/// `worker.drain` and `worker.undrain`, naming the worker by id or unique label: its id, and
/// whether it is drained afterwards.
fn set_drained(
    fleet: &Fleet,
    name: String,
    drained: bool,
) -> Result<WorkerDrainOutput, ContractError> {
    let worker_id = fleet.resolve_worker(&name)?;
    fleet
        .set_drained(&worker_id, drained)
        .map(|changed| WorkerDrainOutput {
            worker_id,
            drained,
            changed,
        })
}
