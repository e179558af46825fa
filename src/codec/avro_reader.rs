//! Reads an Avro datum straight into a serde type, guided by the schema, without first
//! building apache-avro's `Value` tree (an allocation per field and per field name).
//! Covers the schema types weir's own records use; [`supports`] tells whether a schema
//! stays within them, and the codec falls back to the `Value` path when it does not.

use apache_avro::Schema;
use serde::de::{self, DeserializeSeed, IntoDeserializer, MapAccess, SeqAccess, Visitor};

/// Whether every type in `schema` is one [`read`] handles.
pub(crate) fn supports(schema: &Schema) -> bool {
    match schema {
        Schema::Null
        | Schema::Boolean
        | Schema::Int
        | Schema::Long
        | Schema::Float
        | Schema::Double
        | Schema::Bytes
        | Schema::String => true,
        Schema::Record(record) => record.fields.iter().all(|f| supports(&f.schema)),
        Schema::Array(array) => supports(&array.items),
        Schema::Map(map) => supports(&map.types),
        Schema::Union(union) => union.variants().iter().all(supports),
        _ => false,
    }
}

/// Decodes one datum of `schema` (which [`supports`] accepts) from the front of `input`.
pub(crate) fn read<'de, T: de::Deserialize<'de>>(
    schema: &Schema,
    input: &mut &'de [u8],
) -> Result<T, ReadError> {
    T::deserialize(Datum { schema, input })
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub(crate) struct ReadError(String);

impl de::Error for ReadError {
    fn custom<T: std::fmt::Display>(msg: T) -> Self {
        Self(msg.to_string())
    }
}

fn truncated() -> ReadError {
    ReadError("datum ends early".into())
}

fn take<'de>(input: &mut &'de [u8], len: usize) -> Result<&'de [u8], ReadError> {
    if input.len() < len {
        return Err(truncated());
    }
    let (head, rest) = input.split_at(len);
    *input = rest;
    Ok(head)
}

/// A zig-zag varint, as Avro writes `int` and `long`.
fn read_long(input: &mut &[u8]) -> Result<i64, ReadError> {
    let mut raw: u64 = 0;
    for shift in (0..64).step_by(7) {
        let [byte, rest @ ..] = *input else {
            return Err(truncated());
        };
        *input = rest;
        raw |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Ok((raw >> 1) as i64 ^ -((raw & 1) as i64));
        }
    }
    Err(ReadError("varint longer than 10 bytes".into()))
}

fn read_int(input: &mut &[u8]) -> Result<i32, ReadError> {
    let long = read_long(input)?;
    i32::try_from(long).map_err(|_| ReadError(format!("int out of range: {long}")))
}

fn read_len(input: &mut &[u8]) -> Result<usize, ReadError> {
    let len = read_long(input)?;
    usize::try_from(len).map_err(|_| ReadError(format!("negative length {len}")))
}

fn read_bytes<'de>(input: &mut &'de [u8]) -> Result<&'de [u8], ReadError> {
    let len = read_len(input)?;
    take(input, len)
}

fn read_str<'de>(input: &mut &'de [u8]) -> Result<&'de str, ReadError> {
    std::str::from_utf8(read_bytes(input)?)
        .map_err(|e| ReadError(format!("string is not UTF-8: {e}")))
}

/// The item count of the next block of an array or map; 0 ends it. A negative count
/// is followed by the block's size in bytes, which a reader going item by item skips.
fn block_len(input: &mut &[u8]) -> Result<usize, ReadError> {
    let count = read_long(input)?;
    if count < 0 {
        read_long(input)?;
    }
    usize::try_from(count.unsigned_abs()).map_err(|_| ReadError("block too large".into()))
}

struct Datum<'a, 'de> {
    schema: &'a Schema,
    input: &'a mut &'de [u8],
}

impl<'a, 'de> Datum<'a, 'de> {
    /// The branch a union's index selects, with the input past the index.
    fn branch(self) -> Result<Datum<'a, 'de>, ReadError> {
        let Schema::Union(union) = self.schema else {
            return Ok(self);
        };
        let index = read_long(self.input)?;
        let schema = usize::try_from(index)
            .ok()
            .and_then(|i| union.variants().get(i))
            .ok_or_else(|| ReadError(format!("union index {index} out of range")))?;
        Ok(Datum {
            schema,
            input: self.input,
        })
    }
}

impl<'de> de::Deserializer<'de> for Datum<'_, 'de> {
    type Error = ReadError;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ReadError> {
        match self.schema {
            Schema::Null => visitor.visit_unit(),
            Schema::Boolean => match take(self.input, 1)?[0] {
                0 => visitor.visit_bool(false),
                1 => visitor.visit_bool(true),
                b => Err(ReadError(format!("invalid boolean byte {b}"))),
            },
            Schema::Int => visitor.visit_i32(read_int(self.input)?),
            Schema::Long => visitor.visit_i64(read_long(self.input)?),
            Schema::Float => {
                let raw = take(self.input, 4)?;
                visitor.visit_f32(f32::from_le_bytes([raw[0], raw[1], raw[2], raw[3]]))
            }
            Schema::Double => {
                let mut raw = [0u8; 8];
                raw.copy_from_slice(take(self.input, 8)?);
                visitor.visit_f64(f64::from_le_bytes(raw))
            }
            Schema::Bytes => visitor.visit_borrowed_bytes(read_bytes(self.input)?),
            Schema::String => visitor.visit_borrowed_str(read_str(self.input)?),
            Schema::Union(_) => self.branch()?.deserialize_any(visitor),
            Schema::Record(record) => visitor.visit_map(Fields {
                fields: &record.fields,
                next: 0,
                input: self.input,
            }),
            Schema::Array(array) => visitor.visit_seq(Blocks::new(&array.items, self.input)),
            Schema::Map(map) => visitor.visit_map(Blocks::new(&map.types, self.input)),
            other => Err(ReadError(format!(
                "schema type {other:?} is not read directly"
            ))),
        }
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ReadError> {
        let datum = self.branch()?;
        match datum.schema {
            Schema::Null => visitor.visit_none(),
            _ => visitor.visit_some(datum),
        }
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, ReadError> {
        // A unit variant written as its name.
        let datum = self.branch()?;
        match datum.schema {
            Schema::String => visitor.visit_enum(read_str(datum.input)?.into_deserializer()),
            _ => datum.deserialize_any(visitor),
        }
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string
        bytes byte_buf unit unit_struct newtype_struct seq tuple
        tuple_struct map struct identifier ignored_any
    }
}

struct Fields<'a, 'de> {
    fields: &'a [apache_avro::schema::RecordField],
    next: usize,
    input: &'a mut &'de [u8],
}

impl<'de> MapAccess<'de> for Fields<'_, 'de> {
    type Error = ReadError;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, ReadError> {
        let Some(field) = self.fields.get(self.next) else {
            return Ok(None);
        };
        seed.deserialize(field.name.as_str().into_deserializer())
            .map(Some)
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, ReadError> {
        let field = &self.fields[self.next];
        self.next += 1;
        seed.deserialize(Datum {
            schema: &field.schema,
            input: self.input,
        })
    }
}

/// The items of an array, or the entries of a map, read block by block.
struct Blocks<'a, 'de> {
    /// Of the items, or of the map's values.
    schema: &'a Schema,
    left_in_block: usize,
    done: bool,
    input: &'a mut &'de [u8],
}

impl<'a, 'de> Blocks<'a, 'de> {
    fn new(schema: &'a Schema, input: &'a mut &'de [u8]) -> Self {
        Self {
            schema,
            left_in_block: 0,
            done: false,
            input,
        }
    }

    /// Steps to the next item, reading block headers as they come; false at the end.
    fn advance(&mut self) -> Result<bool, ReadError> {
        if self.done {
            return Ok(false);
        }
        if self.left_in_block == 0 {
            self.left_in_block = block_len(self.input)?;
            if self.left_in_block == 0 {
                self.done = true;
                return Ok(false);
            }
        }
        self.left_in_block -= 1;
        Ok(true)
    }

    fn item(&mut self) -> Datum<'_, 'de> {
        Datum {
            schema: self.schema,
            input: self.input,
        }
    }
}

impl<'de> SeqAccess<'de> for Blocks<'_, 'de> {
    type Error = ReadError;

    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, ReadError> {
        if !self.advance()? {
            return Ok(None);
        }
        seed.deserialize(self.item()).map(Some)
    }
}

impl<'de> MapAccess<'de> for Blocks<'_, 'de> {
    type Error = ReadError;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, ReadError> {
        if !self.advance()? {
            return Ok(None);
        }
        let key = read_str(self.input)?;
        seed.deserialize(de::value::BorrowedStrDeserializer::new(key))
            .map(Some)
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, ReadError> {
        seed.deserialize(self.item())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct Everything {
        flag: bool,
        small: i32,
        big: i64,
        ratio: f32,
        precise: f64,
        #[serde(deserialize_with = "byte_slice")]
        raw: Vec<u8>,
        name: String,
        maybe: Option<String>,
        absent: Option<i64>,
        tags: Vec<String>,
        counts: BTreeMap<String, i64>,
    }

    /// Avro bytes arrive as a byte slice, which `Vec<u8>` alone does not accept.
    fn byte_slice<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        struct Bytes;
        impl Visitor<'_> for Bytes {
            type Value = Vec<u8>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("bytes")
            }
            fn visit_bytes<E>(self, v: &[u8]) -> Result<Vec<u8>, E> {
                Ok(v.to_vec())
            }
        }
        d.deserialize_bytes(Bytes)
    }

    const SCHEMA: &str = r#"{"type": "record", "name": "Everything", "fields": [
        {"name": "flag", "type": "boolean"},
        {"name": "small", "type": "int"},
        {"name": "big", "type": "long"},
        {"name": "ratio", "type": "float"},
        {"name": "precise", "type": "double"},
        {"name": "raw", "type": "bytes"},
        {"name": "name", "type": "string"},
        {"name": "maybe", "type": ["null", "string"]},
        {"name": "absent", "type": ["null", "long"]},
        {"name": "tags", "type": {"type": "array", "items": "string"}},
        {"name": "counts", "type": {"type": "map", "values": "long"}},
        {"name": "unknown_to_rust", "type": ["null", "string"], "default": null}
    ]}"#;

    fn sample() -> Everything {
        Everything {
            flag: true,
            small: -7,
            big: i64::MIN + 1,
            ratio: 0.5,
            precise: -1.25e300,
            raw: vec![0, 255, 7],
            name: "naïve".into(),
            maybe: Some("here".into()),
            absent: None,
            tags: (0..300).map(|i| format!("t{i}")).collect(),
            counts: [("a".to_string(), 1), ("b".to_string(), -2)].into(),
        }
    }

    /// Written by apache-avro through a `Value`, with a field the Rust type lacks.
    fn written(record: &Everything, schema: &Schema) -> Vec<u8> {
        let apache_avro::types::Value::Record(mut fields) = apache_avro::to_value(record).unwrap()
        else {
            unreachable!("a struct becomes a record")
        };
        // Rust's byte vector serializes as an array; the schema says bytes.
        for (name, value) in &mut fields {
            if name == "raw" {
                *value = apache_avro::types::Value::Bytes(record.raw.clone());
            }
        }
        fields.push((
            "unknown_to_rust".into(),
            apache_avro::types::Value::Union(1, Box::new("extra".into())),
        ));
        let value = apache_avro::types::Value::Record(fields)
            .resolve(schema)
            .unwrap();
        apache_avro::to_avro_datum(schema, value).unwrap()
    }

    #[test]
    fn reads_what_apache_avro_writes() {
        let schema = Schema::parse_str(SCHEMA).unwrap();
        assert!(supports(&schema));
        let bytes = written(&sample(), &schema);
        let mut input = bytes.as_slice();
        let read_back: Everything = read(&schema, &mut input).unwrap();
        assert_eq!(read_back, sample());
        assert!(
            input.is_empty(),
            "the field unknown to Rust is read past too"
        );
    }

    #[test]
    fn unit_variants_are_read_from_their_names() {
        #[derive(Debug, PartialEq, serde::Deserialize)]
        #[serde(rename_all = "snake_case")]
        enum Status {
            Completed,
            Failed,
        }
        let schema = Schema::parse_str(r#""string""#).unwrap();
        let bytes = [12, b'f', b'a', b'i', b'l', b'e', b'd'];
        let status: Status = read(&schema, &mut bytes.as_slice()).unwrap();
        assert_eq!(status, Status::Failed);
        let bytes = [6, b'n', b'o', b'p'];
        assert!(read::<Status>(&schema, &mut bytes.as_slice()).is_err());
    }

    #[test]
    fn arrays_written_in_sized_blocks_are_read() {
        let schema = Schema::parse_str(r#"{"type": "array", "items": "long"}"#).unwrap();
        // Two blocks: a count of -2 followed by the block's byte size, then 1 item.
        let bytes = [3, 2, 2, 4, 2, 6, 0];
        let items: Vec<i64> = read(&schema, &mut bytes.as_slice()).unwrap();
        assert_eq!(items, vec![1, 2, 3]);
    }

    #[test]
    fn damaged_datums_are_errors() {
        let schema = Schema::parse_str(SCHEMA).unwrap();
        let bytes = written(&sample(), &schema);
        for cut in [0, 1, 5, bytes.len() / 2, bytes.len() - 1] {
            let mut input = &bytes[..cut];
            assert!(
                read::<Everything>(&schema, &mut input).is_err(),
                "cut at {cut}"
            );
        }
        let union = Schema::parse_str(r#"["null", "string"]"#).unwrap();
        let err = read::<Option<String>>(&union, &mut [4u8].as_slice()).unwrap_err();
        assert!(err.to_string().contains("union index 2"), "{err}");
        let string = Schema::parse_str(r#""string""#).unwrap();
        let err = read::<String>(&string, &mut [4u8, 0xff, 0xfe].as_slice()).unwrap_err();
        assert!(err.to_string().contains("UTF-8"), "{err}");
        let long = Schema::parse_str(r#""long""#).unwrap();
        let err = read::<i64>(&long, &mut [0xffu8; 11].as_slice()).unwrap_err();
        assert!(err.to_string().contains("varint"), "{err}");
    }

    #[test]
    fn schemas_outside_the_covered_types_are_not_read_directly() {
        let with_enum = Schema::parse_str(
            r#"{"type": "record", "name": "R", "fields": [
                {"name": "e", "type": {"type": "enum", "name": "E", "symbols": ["A"]}}]}"#,
        )
        .unwrap();
        assert!(!supports(&with_enum));
        let with_logical =
            Schema::parse_str(r#"{"type": "long", "logicalType": "timestamp-millis"}"#).unwrap();
        assert!(!supports(&with_logical));
    }
}
