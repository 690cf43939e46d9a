//! Fuzzes the agent-device front's request parsing: an `/rpc` body, a daemon's answer, a lease
//! id and the tenants made from arbitrary principals. Nothing panics; a parsed call serialises to
//! a body that parses to the same call; a lease id it names is agent-device's form; an answer
//! reads as one of its shapes; every tenant is one agent-device accepts.
#![no_main]

use agent_device_front::LeaseId;
use agent_device_front::rpc::{Answer, RpcCall};
use agent_device_front::tenant::{self, Tenant};
use libfuzzer_sys::fuzz_target;
use simlock_contract::model::Platform;

fn agent_device_form(id: &str) -> bool {
    id.len() == 32 && id.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

fuzz_target!(|data: &[u8]| {
    if let Ok(mut call) = RpcCall::parse(data) {
        let again = RpcCall::parse(&call.to_bytes()).expect("a parsed call serialises to a call");
        assert_eq!(again, call, "the round trip changed the call");
        if let Ok(Some(lease)) = call.lease() {
            assert!(agent_device_form(lease.as_str()), "{lease}");
        }
        let _ = (call.command(), call.names_a_device(), call.allocate_model());
        let _ = call.allocate_platform();
        // The rewrites the front makes keep it a call.
        call.pin_device(Platform::Android, "emulator-5554");
        call.set_lease(&LeaseId::mint());
        call.set_ttl(60_000);
        RpcCall::parse(&call.to_bytes()).expect("a rewritten call is still a call");
    }
    let answer = Answer::read(data);
    let _ = answer.lease_gone();

    let text = String::from_utf8_lossy(data);
    if let Some(lease) = LeaseId::parse(&text) {
        assert!(agent_device_form(lease.as_str()));
        assert_eq!(lease.as_str(), text, "a parsed id is the text itself");
    } else {
        assert!(!agent_device_form(&text), "{text:?} refused");
    }
    let middle = text
        .char_indices()
        .nth(text.chars().count() / 2)
        .map_or(text.len(), |(at, _)| at);
    let (gateway, principal) = text.split_at(middle);
    for made in [
        Tenant::on_worker(&text),
        Tenant::through_gateway(gateway, principal),
    ] {
        assert!(tenant::is_valid(made.as_str()), "{made:?}");
    }
});
