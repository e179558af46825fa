//! JSON event decoding, as accumulators read user events.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(value) = weir::codec::json::decode(data) {
        let again = weir::codec::json::encode(&value);
        assert_eq!(
            weir::codec::json::decode(&again).expect("re-encoded JSON decodes"),
            value
        );
    }
});
