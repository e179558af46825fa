//! The single-object Avro decoder for user events (apache-avro's reader behind weir's
//! header check), on a schema with every kind of type an event schema may use.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use weir::codec::AvroCodec;

const SCHEMA: &str = r#"{
  "type": "record", "name": "Order", "namespace": "fuzz",
  "fields": [
    {"name": "id", "type": "long"},
    {"name": "side", "type": {"type": "enum", "name": "Side", "symbols": ["BUY", "SELL"]}},
    {"name": "digest", "type": {"type": "fixed", "name": "Digest", "size": 4}},
    {"name": "price", "type": ["null", "double", "string"]},
    {"name": "tags", "type": {"type": "array", "items": "string"}},
    {"name": "attrs", "type": {"type": "map", "values": ["null", "int", "boolean", "bytes"]}},
    {"name": "lines", "type": {"type": "array", "items": {
      "type": "record", "name": "Line",
      "fields": [{"name": "qty", "type": "float"}, {"name": "next", "type": ["null", "Line"]}]
    }}}
  ]
}"#;

fn codec() -> &'static AvroCodec {
    static CODEC: OnceLock<AvroCodec> = OnceLock::new();
    CODEC.get_or_init(|| AvroCodec::new("Order", SCHEMA).expect("the fuzz schema parses"))
}

fuzz_target!(|data: &[u8]| {
    let codec = codec();
    // As sent (often with a wrong header), and behind the right header, so the body
    // reader sees every input too.
    let _ = codec.decode_json(data);
    let mut framed = vec![0xC3, 0x01];
    framed.extend_from_slice(&codec.fingerprint().to_le_bytes());
    framed.extend_from_slice(data);
    let _ = codec.decode_json(&framed);
});
