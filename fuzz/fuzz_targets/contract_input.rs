//! Fuzzes the contract's input decoding: any JSON value, given to every operation, decodes to
//! an input or a `BAD_REQUEST`, never a panic; whatever decodes re-encodes to a value that
//! decodes again to the same thing (the typed input is the whole truth).
#![no_main]

use libfuzzer_sys::fuzz_target;
use simlock_contract::ErrorCode;
use simlock_contract::OPERATIONS;
use simlock_contract::ops::decode_named;

fuzz_target!(|data: &[u8]| {
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    for op in OPERATIONS {
        let decoded = decode_named(op.name, Some(value.clone())).expect("every operation decodes");
        match decoded {
            Ok(input) => {
                let again = decode_named(op.name, Some(input.clone()))
                    .expect("every operation decodes")
                    .unwrap_or_else(|e| panic!("{}: its own output refused: {e}", op.name));
                assert_eq!(again, input, "{}: decoding is not stable", op.name);
            }
            Err(error) => assert_eq!(error.code, ErrorCode::BadRequest, "{}: {error}", op.name),
        }
    }
});
