//! Fuzzes the relay's header filter and its bounds: arbitrary header lists (names and values
//! split from the fuzzer's bytes) are filtered without a panic; nothing hop-by-hop, nothing a
//! `connection` header named and nothing in the extra list survives; the rest keeps its order;
//! filtering twice changes nothing more; the bounds check answers and never panics.
#![no_main]

use libfuzzer_sys::fuzz_target;
use simlock_contract::bounds::{
    RELAY_GATEWAY_CREDENTIAL_HEADERS, RELAY_HOP_BY_HOP_HEADERS, filter_relay_headers, relay_headers,
};

fuzz_target!(|data: &[u8]| {
    // `name:value` pairs separated by newlines; names are ASCII-folded by the filter itself.
    let text = String::from_utf8_lossy(data);
    let headers: Vec<(String, String)> = text
        .split('\n')
        .filter_map(|line| line.split_once(':'))
        .map(|(name, value)| (name.to_owned(), value.to_owned()))
        .collect();
    let named: Vec<String> = headers
        .iter()
        .filter(|(name, _)| name.eq_ignore_ascii_case("connection"))
        .flat_map(|(_, value)| value.split(','))
        .map(|token| token.trim().to_ascii_lowercase())
        .filter(|token| !token.is_empty())
        .collect();
    let also = if data.first().is_some_and(|b| b % 2 == 0) {
        RELAY_GATEWAY_CREDENTIAL_HEADERS
    } else {
        &[]
    };
    let kept = filter_relay_headers(headers.clone(), also);
    for (name, _) in &kept {
        let lower = name.to_ascii_lowercase();
        assert!(
            !RELAY_HOP_BY_HOP_HEADERS.contains(&lower.as_str()),
            "{name} kept"
        );
        assert!(!also.contains(&lower.as_str()), "{name} kept");
        assert!(!named.contains(&lower), "{name} was named by connection");
    }
    // The kept headers are a subsequence of the input, in order.
    let mut input = headers.iter();
    for header in &kept {
        assert!(
            input.any(|h| h == header),
            "order changed or a header was invented"
        );
    }
    assert_eq!(
        filter_relay_headers(kept.clone(), also),
        kept,
        "not idempotent"
    );
    let _ = relay_headers(&kept, &());
});
