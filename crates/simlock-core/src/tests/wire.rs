//! Calls over real wire sessions (an in-memory duplex): the gateway uplink's `owner`, and
//! `lease-lost` reaching an owner's other connections but not the releasing one.

use std::sync::Arc;
use std::time::Duration;

use simlock_contract::model::LeaseEndReason;
use simlock_contract::ops::LeaseIdInput;
use simlock_contract::{ErrorCode, Hello};
use simlock_wire::{Origin, Service, Transport, Unsolicited, WireClient, serve};

use super::*;
use simlock_contract::ops::LeaseRelease;

async fn connect(h: &Harness, origin: Origin, principal: &str) -> (WireClient, Unsolicited) {
    let (server, client) = tokio::io::duplex(256 * 1024);
    let (r, w) = tokio::io::split(server);
    let service: Arc<dyn Service> = h.pipeline.clone();
    tokio::spawn(serve(
        Transport::server_io(r, w),
        origin,
        service,
        h.pipeline.session_config(),
    ));
    let (r, w) = tokio::io::split(client);
    let (client, unsolicited) = WireClient::new(Transport::client_io(r, w));
    client
        .hello(&Hello {
            client_version: None,
            protocol_version: Some(2),
            protocol_range: None,
            principal: Some(principal.to_owned()),
            credential: None,
        })
        .await
        .unwrap();
    (client, unsolicited)
}

async fn next_unsolicited(rx: &mut Unsolicited) -> Push {
    let frame = within(Duration::from_secs(600), rx.recv()).await.unwrap();
    Push::from_frame(frame).unwrap()
}

#[tokio::test(start_paused = true)]
async fn the_gateway_uplink_names_the_owner_and_a_socket_may_not() {
    let h = Harness::new();
    let (uplink, _u) = connect(&h, Origin::GatewayUplink, "gw:9a0c").await;
    let mut input = ios();
    input.requester_id = Some("gw:9a0c:tok_abc".into());
    input.owner = Some("tok_abc".into());
    input.no_wait = Some(true);
    let grant = uplink.call::<LeaseRequest>(&input).await.unwrap();
    assert_eq!(grant.lease.owner_id, "tok_abc");
    assert_eq!(grant.lease.requester_id, "gw:9a0c:tok_abc");

    let (socket, _s) = connect(&h, Origin::Socket, "agent-1").await;
    let mut input = android();
    input.owner = Some("tok_abc".into());
    let err = socket.call::<LeaseRequest>(&input).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::Forbidden);
    assert_eq!(h.worker.leases().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn lease_lost_reaches_the_owners_other_connections_not_the_releasing_one() {
    let h = Harness::new();
    let (a, mut a_pushes) = connect(&h, Origin::Socket, "agent-a").await;
    let (b, mut b_pushes) = connect(&h, Origin::Socket, "agent-a").await;
    let first = a.call::<LeaseRequest>(&ios()).await.unwrap();
    let mut other = android();
    other.requester_id = Some("job-2".into());
    let second = a.call::<LeaseRequest>(&other).await.unwrap();

    // Released on A: B hears of it, A does not.
    a.call::<LeaseRelease>(&LeaseIdInput {
        reason: None,
        lease_id: first.lease.id.to_string(),
    })
    .await
    .unwrap();
    let Push::LeaseLost {
        lease_id, reason, ..
    } = next_unsolicited(&mut b_pushes).await
    else {
        panic!("expected lease-lost");
    };
    assert_eq!(
        (lease_id.as_str(), reason),
        (first.lease.id.as_str(), LeaseEndReason::Explicit)
    );

    // Released on B: A hears of this one, and it is the first notice A gets.
    b.call::<LeaseRelease>(&LeaseIdInput {
        reason: None,
        lease_id: second.lease.id.to_string(),
    })
    .await
    .unwrap();
    let Push::LeaseLost { lease_id, .. } = next_unsolicited(&mut a_pushes).await else {
        panic!("expected lease-lost");
    };
    assert_eq!(
        lease_id,
        second.lease.id.as_str(),
        "A got no notice for its own release"
    );
}
