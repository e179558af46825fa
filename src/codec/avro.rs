//! Avro single-object encoding for weir's own records.

use apache_avro::rabin::Rabin;
use apache_avro::Schema;
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::CodecError;

const MARKER: [u8; 2] = [0xC3, 0x01];
const HEADER_LEN: usize = 10;

/// A record with a schema in `schemas/`.
pub trait AvroRecord: Serialize + DeserializeOwned {
    /// Record name, as in the schema.
    const NAME: &'static str;
    /// The `.avsc` text.
    const SCHEMA: &'static str;
    /// The parsed schema and its fingerprint, parsed once per process.
    fn codec() -> &'static AvroCodec;
}

/// A parsed schema with its CRC-64-AVRO fingerprint.
pub struct AvroCodec {
    name: &'static str,
    schema: Schema,
    fingerprint: u64,
    /// No named type is referred to by name, so decoding needs no table of names (which
    /// the decoder would otherwise build again for every message).
    self_contained: bool,
    /// Every type in the schema is one records can be read as directly.
    direct: bool,
}

impl AvroCodec {
    pub fn new(name: &'static str, schema_text: &str) -> Result<Self, CodecError> {
        let schema = Schema::parse_str(schema_text).map_err(|e| CodecError::Schema {
            record: name,
            reason: e.to_string(),
        })?;
        let fp = schema.fingerprint::<Rabin>();
        let mut bytes = [0u8; 8];
        bytes.copy_from_slice(&fp.bytes[..8]);
        Ok(Self {
            name,
            self_contained: !refers_by_name(&schema),
            direct: super::avro_reader::supports(&schema),
            schema,
            fingerprint: u64::from_le_bytes(bytes),
        })
    }

    /// The record name, as in errors.
    pub fn name(&self) -> &'static str {
        self.name
    }

    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    pub fn schema(&self) -> &Schema {
        &self.schema
    }

    pub fn encode<T: Serialize>(&self, record: &T) -> Result<Vec<u8>, CodecError> {
        let mut out = Vec::with_capacity(HEADER_LEN + 128);
        self.write_header(&mut out);
        self.write_body(record, &mut out)?;
        Ok(out)
    }

    /// The Avro binary body of `record` alone, without the single-object header: what
    /// [`frame_single`] or [`frame_batch`] puts in a message.
    pub fn encode_body<T: Serialize>(&self, record: &T) -> Result<Vec<u8>, CodecError> {
        let mut out = Vec::with_capacity(128);
        self.write_body(record, &mut out)?;
        Ok(out)
    }

    fn write_header(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&MARKER);
        out.extend_from_slice(&self.fingerprint.to_le_bytes());
    }

    fn write_body<T: Serialize>(&self, record: &T, out: &mut Vec<u8>) -> Result<(), CodecError> {
        // Serializes straight against the schema, without an intermediate `Value`.
        apache_avro::write_avro_datum_ref(&self.schema, record, out)
            .map(drop)
            .map_err(|e| CodecError::Avro {
                record: self.name,
                reason: e.to_string(),
            })
    }

    pub fn decode<T: DeserializeOwned>(&self, bytes: &[u8]) -> Result<T, CodecError> {
        if self.direct {
            self.check_header(bytes)?;
            let mut body = &bytes[HEADER_LEN..];
            return super::avro_reader::read(&self.schema, &mut body).map_err(|e| {
                CodecError::Avro {
                    record: self.name,
                    reason: e.to_string(),
                }
            });
        }
        let value = self.decode_value(bytes)?;
        apache_avro::from_value(&value).map_err(|e| CodecError::Avro {
            record: self.name,
            reason: e.to_string(),
        })
    }
}

impl AvroCodec {
    /// Decodes a single-object encoded record of this schema into JSON, for user events.
    pub fn decode_json(&self, bytes: &[u8]) -> Result<serde_json::Value, CodecError> {
        let value: apache_avro::types::Value = self.decode_value(bytes)?;
        let value = serde_json::Value::try_from(value).map_err(|e| CodecError::Avro {
            record: self.name,
            reason: e.to_string(),
        })?;
        super::json::check_depth(&value)?;
        Ok(value)
    }

    fn decode_value(&self, bytes: &[u8]) -> Result<apache_avro::types::Value, CodecError> {
        self.check_header(bytes)?;
        let mut body = &bytes[HEADER_LEN..];
        super::avro_check::check(&self.schema, body).map_err(|reason| CodecError::Avro {
            record: self.name,
            reason,
        })?;
        let decoded = if self.self_contained {
            apache_avro::from_avro_datum_schemata(&self.schema, Vec::new(), &mut body, None)
        } else {
            apache_avro::from_avro_datum(&self.schema, &mut body, None)
        };
        decoded.map_err(|e| CodecError::Avro {
            record: self.name,
            reason: e.to_string(),
        })
    }

    fn check_header(&self, bytes: &[u8]) -> Result<(), CodecError> {
        if bytes.len() < HEADER_LEN {
            return Err(CodecError::Truncated { len: bytes.len() });
        }
        if bytes[..2] != MARKER {
            return Err(CodecError::BadMarker);
        }
        let found = fingerprint_of(bytes).unwrap_or_default();
        if found != self.fingerprint {
            return Err(CodecError::FingerprintMismatch {
                record: self.name,
                expected: self.fingerprint,
                found,
            });
        }
        Ok(())
    }
}

/// Whether a schema names an earlier-defined type instead of defining it in place.
fn refers_by_name(schema: &Schema) -> bool {
    match schema {
        Schema::Ref { .. } => true,
        Schema::Record(record) => record.fields.iter().any(|f| refers_by_name(&f.schema)),
        Schema::Array(array) => refers_by_name(&array.items),
        Schema::Map(map) => refers_by_name(&map.types),
        Schema::Union(union) => union.variants().iter().any(refers_by_name),
        _ => false,
    }
}

/// The fingerprint in a single-object encoded message, if it has the marker.
pub fn fingerprint_of(bytes: &[u8]) -> Option<u64> {
    if bytes.len() < HEADER_LEN || bytes[..2] != MARKER {
        return None;
    }
    let mut fp = [0u8; 8];
    fp.copy_from_slice(&bytes[2..HEADER_LEN]);
    Some(u64::from_le_bytes(fp))
}

pub fn encode<T: AvroRecord>(record: &T) -> Result<Vec<u8>, CodecError> {
    T::codec().encode(record)
}

pub fn decode<T: AvroRecord>(bytes: &[u8]) -> Result<T, CodecError> {
    T::codec().decode(bytes)
}

/// A record that may also travel several to a message, as a batch record whose only
/// field is an array of it (`schemas/*_batch.avsc`). Each record in a batch is encoded
/// exactly as it is alone, so a batch costs no second encoding, and a record taken out
/// of one can be sent on by itself.
pub trait BatchOf: AvroRecord {
    type Batch: AvroRecord;
    fn unbatch(batch: Self::Batch) -> Vec<Self>;
}

/// A message holding one record, from its body ([`AvroCodec::encode_body`]).
pub fn frame_single<T: AvroRecord>(body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + body.len());
    T::codec().write_header(&mut out);
    out.extend_from_slice(body);
    out
}

/// A message holding the records whose bodies are given, as one `T::Batch`: the batch
/// header, then the array as Avro writes it (one block: its count, the items, and the
/// empty block that ends it).
pub fn frame_batch<'a, T: BatchOf>(bodies: impl ExactSizeIterator<Item = &'a [u8]>) -> Vec<u8> {
    let count = bodies.len();
    let mut out = Vec::with_capacity(HEADER_LEN + 11);
    T::Batch::codec().write_header(&mut out);
    if count > 0 {
        write_long(&mut out, count as i64);
        for body in bodies {
            out.extend_from_slice(body);
        }
    }
    write_long(&mut out, 0);
    out
}

/// The records of a message that holds one `T` or one `T::Batch`, told apart by the
/// fingerprint.
pub fn decode_one_or_batch<T: BatchOf>(bytes: &[u8]) -> Result<Vec<T>, CodecError> {
    if fingerprint_of(bytes) == Some(T::Batch::codec().fingerprint()) {
        return decode::<T::Batch>(bytes).map(T::unbatch);
    }
    decode::<T>(bytes).map(|record| vec![record])
}

/// Avro's zig-zag variable-length encoding of a long.
pub(crate) fn write_long(out: &mut Vec<u8>, value: i64) {
    let mut n = ((value << 1) ^ (value >> 63)) as u64;
    while n >= 0x80 {
        out.push((n as u8) | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
}

/// Declares the codec of a record type whose schema lives in `schemas/`.
macro_rules! avro_record {
    ($ty:ty, $name:literal, $file:literal) => {
        impl $crate::codec::avro::AvroRecord for $ty {
            const NAME: &'static str = $name;
            const SCHEMA: &'static str = include_str!(concat!("../../schemas/", $file));
            fn codec() -> &'static $crate::codec::avro::AvroCodec {
                static CODEC: std::sync::OnceLock<$crate::codec::avro::AvroCodec> =
                    std::sync::OnceLock::new();
                CODEC.get_or_init(|| {
                    // The schemas ship inside the binary and are checked by the tests, so a
                    // parse failure here is a build defect, not bad input.
                    $crate::codec::avro::AvroCodec::new($name, Self::SCHEMA)
                        .expect("bundled schema parses")
                })
            }
        }
    };
}
pub(crate) use avro_record;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_count_larger_than_the_message_is_an_error_not_an_abort() {
        // Found by fuzzing: apache-avro reserves room for a block's items before reading
        // them, so a few bytes claiming half a billion items asked for 30 GB.
        let codec = AvroCodec::new(
            "Order",
            r#"{"type": "record", "name": "Order", "fields": [
                {"name": "tags", "type": {"type": "array", "items": "string"}}]}"#,
        )
        .unwrap();
        let mut message = vec![0xC3, 0x01];
        message.extend_from_slice(&codec.fingerprint().to_le_bytes());
        message.extend_from_slice(&[0xfe, 0xff, 0xff, 0xff, 0x03, 0x02, b'x', 0x00]);
        let err = codec.decode_json(&message).unwrap_err().to_string();
        assert!(err.contains("items where"), "{err}");
    }

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct Point {
        x: i64,
    }

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct Pair {
        first: Point,
        second: Point,
    }

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct Flat {
        x: i64,
        tags: Vec<String>,
    }

    #[test]
    fn schemas_that_refer_to_named_types_decode_as_well_as_self_contained_ones() {
        let nested = r#"{"type": "record", "name": "Pair", "fields": [
            {"name": "first", "type": {"type": "record", "name": "Point", "fields": [
                {"name": "x", "type": "long"}]}},
            {"name": "second", "type": "Point"}]}"#;
        let flat = r#"{"type": "record", "name": "Flat", "fields": [
            {"name": "x", "type": "long"},
            {"name": "tags", "type": {"type": "array", "items": "string"}}]}"#;
        let nested = AvroCodec::new("Pair", nested).unwrap();
        let flat = AvroCodec::new("Flat", flat).unwrap();
        assert!(!nested.self_contained);
        assert!(flat.self_contained);

        let pair = Pair {
            first: Point { x: 1 },
            second: Point { x: 2 },
        };
        // Written through a `Value`, as the direct writer does not follow references.
        let mut bytes = MARKER.to_vec();
        bytes.extend_from_slice(&nested.fingerprint().to_le_bytes());
        let value = apache_avro::to_value(&pair).unwrap();
        bytes.extend(apache_avro::to_avro_datum(nested.schema(), value).unwrap());
        assert_eq!(nested.decode::<Pair>(&bytes).unwrap(), pair);
        let record = Flat {
            x: 7,
            tags: vec!["a".into(), "b".into()],
        };
        let bytes = flat.encode(&record).unwrap();
        assert_eq!(flat.decode::<Flat>(&bytes).unwrap(), record);
    }
}
