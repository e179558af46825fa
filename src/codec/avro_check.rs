//! A pass over an Avro datum before apache-avro decodes it, reading no value and
//! allocating nothing, that rejects what the library would turn into an abort instead of
//! an error: a block count it reserves room for up front (a few bytes claiming a billion
//! items ask for tens of gigabytes), and nesting deep enough to exhaust the stack.

use std::collections::HashMap;

use apache_avro::schema::{Name, Schema};

/// Items that take no bytes (nulls) one datum may hold in all.
const MAX_EMPTY_ITEMS: u64 = 1 << 16;
/// Deepest nesting a datum may have, counting every record, union, reference, array and
/// map (apache-avro recurses once for each): a linked list of some 170 nodes, far above
/// any event's. Decoding that deep takes between 0.5 and 1 MiB of stack in an optimised
/// build (the fuzz target's, at those stack limits), half a 2 MiB runtime thread's; an
/// unoptimised build takes some 30 KB per level.
const MAX_DEPTH: usize = 512;

/// Checks that every length and block count in `bytes` fits what remains of them.
pub(crate) fn check(schema: &Schema, bytes: &[u8]) -> Result<(), String> {
    let mut names = HashMap::new();
    collect_names(schema, &mut names);
    let mut walk = Walk {
        names,
        input: bytes,
        empty_items_left: MAX_EMPTY_ITEMS,
    };
    walk.datum(schema, 0)
}

fn collect_names<'s>(schema: &'s Schema, names: &mut HashMap<&'s Name, &'s Schema>) {
    match schema {
        Schema::Record(record) => {
            names.insert(&record.name, schema);
            for field in &record.fields {
                collect_names(&field.schema, names);
            }
        }
        Schema::Enum(e) => {
            names.insert(&e.name, schema);
        }
        Schema::Fixed(f) => {
            names.insert(&f.name, schema);
        }
        Schema::Array(a) => collect_names(&a.items, names),
        Schema::Map(m) => collect_names(&m.types, names),
        Schema::Union(u) => u.variants().iter().for_each(|v| collect_names(v, names)),
        Schema::Decimal(d) => collect_names(&d.inner, names),
        _ => {}
    }
}

struct Walk<'s, 'b> {
    names: HashMap<&'s Name, &'s Schema>,
    input: &'b [u8],
    empty_items_left: u64,
}

impl<'s> Walk<'s, '_> {
    fn resolve(&self, name: &Name) -> Result<&'s Schema, String> {
        self.names
            .get(name)
            .or_else(|| {
                // A reference written without its namespace.
                self.names
                    .iter()
                    .find(|(known, _)| known.name == name.name)
                    .map(|(_, s)| s)
            })
            .copied()
            .ok_or_else(|| format!("the schema refers to an unknown type {}", name.name))
    }

    fn skip(&mut self, n: usize) -> Result<(), String> {
        if n > self.input.len() {
            return Err(format!(
                "{n} bytes wanted where {} remain",
                self.input.len()
            ));
        }
        self.input = &self.input[n..];
        Ok(())
    }

    /// A zig-zag varint (Avro's int and long).
    fn long(&mut self) -> Result<i64, String> {
        let mut value: u64 = 0;
        for shift in (0..64).step_by(7) {
            let (&byte, rest) = self.input.split_first().ok_or("truncated number")?;
            self.input = rest;
            value |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return Ok((value >> 1) as i64 ^ -((value & 1) as i64));
            }
        }
        Err("a number longer than 10 bytes".into())
    }

    fn length(&mut self) -> Result<usize, String> {
        let len = self.long()?;
        let len = usize::try_from(len).map_err(|_| format!("negative length {len}"))?;
        if len > self.input.len() {
            return Err(format!(
                "a length of {len} where {} bytes remain",
                self.input.len()
            ));
        }
        Ok(len)
    }

    /// The fewest bytes one datum of `schema` takes.
    fn min_size(&self, schema: &Schema, depth: usize) -> Result<usize, String> {
        if depth > MAX_DEPTH {
            return Err("the schema nests too deep".into());
        }
        Ok(match schema {
            Schema::Null => 0,
            Schema::Float => 4,
            Schema::Double => 8,
            Schema::Fixed(f) => f.size,
            Schema::Duration => 12,
            Schema::Decimal(d) => self.min_size(&d.inner, depth + 1)?,
            Schema::Record(r) => {
                let mut total = 0usize;
                for field in &r.fields {
                    total = total.saturating_add(self.min_size(&field.schema, depth + 1)?);
                }
                total
            }
            Schema::Ref { name } => self.min_size(self.resolve(name)?, depth + 1)?,
            // A boolean, a number, a length, a union index or a block's end: a byte.
            _ => 1,
        })
    }

    /// The blocks of an array or map: counts, each with an optional byte size, ended by 0.
    fn blocks(
        &mut self,
        item_min: usize,
        mut item: impl FnMut(&mut Self) -> Result<(), String>,
    ) -> Result<(), String> {
        loop {
            let count = self.long()?;
            if count == 0 {
                return Ok(());
            }
            if count < 0 {
                self.long()?; // the block's size in bytes
            }
            let count = count.unsigned_abs();
            if item_min == 0 {
                self.empty_items_left = self
                    .empty_items_left
                    .checked_sub(count)
                    .ok_or_else(|| format!("more than {MAX_EMPTY_ITEMS} empty items"))?;
            } else if count > (self.input.len() / item_min) as u64 {
                return Err(format!(
                    "a block of {count} items where {} bytes remain",
                    self.input.len()
                ));
            }
            for _ in 0..count {
                item(self)?;
            }
        }
    }

    fn datum(&mut self, schema: &'s Schema, depth: usize) -> Result<(), String> {
        if depth > MAX_DEPTH {
            return Err(format!("nested deeper than {MAX_DEPTH} levels"));
        }
        match schema {
            Schema::Null => Ok(()),
            Schema::Boolean => self.skip(1),
            Schema::Int
            | Schema::Long
            | Schema::Enum(_)
            | Schema::Date
            | Schema::TimeMillis
            | Schema::TimeMicros
            | Schema::TimestampMillis
            | Schema::TimestampMicros
            | Schema::TimestampNanos
            | Schema::LocalTimestampMillis
            | Schema::LocalTimestampMicros
            | Schema::LocalTimestampNanos => self.long().map(drop),
            Schema::Float => self.skip(4),
            Schema::Double => self.skip(8),
            Schema::Bytes | Schema::String | Schema::BigDecimal | Schema::Uuid => {
                let len = self.length()?;
                self.skip(len)
            }
            Schema::Fixed(f) => self.skip(f.size),
            Schema::Duration => self.skip(12),
            Schema::Decimal(d) => self.datum(&d.inner, depth + 1),
            Schema::Union(u) => {
                let index = self.long()?;
                let variant = usize::try_from(index)
                    .ok()
                    .and_then(|i| u.variants().get(i))
                    .ok_or_else(|| format!("union index {index} out of range"))?;
                self.datum(variant, depth + 1)
            }
            Schema::Record(r) => {
                for field in &r.fields {
                    self.datum(&field.schema, depth + 1)?;
                }
                Ok(())
            }
            Schema::Array(a) => {
                let min = self.min_size(&a.items, depth + 1)?;
                self.blocks(min, |walk| walk.datum(&a.items, depth + 1))
            }
            Schema::Map(m) => {
                // A key takes at least its length byte.
                let min = 1 + self.min_size(&m.types, depth + 1)?;
                self.blocks(min, |walk| {
                    let len = walk.length()?;
                    walk.skip(len)?;
                    walk.datum(&m.types, depth + 1)
                })
            }
            Schema::Ref { name } => {
                let resolved = self.resolve(name)?;
                self.datum(resolved, depth + 1)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schema(text: &str) -> Schema {
        Schema::parse_str(text).unwrap()
    }

    #[test]
    fn a_block_claiming_more_items_than_bytes_is_refused() {
        let s = schema(r#"{"type": "array", "items": "long"}"#);
        // Count 3 (zig-zag 6), three longs, end.
        assert!(check(&s, &[6, 2, 4, 6, 0]).is_ok());
        // Zig-zag of 2^29 items in two bytes: apache-avro would reserve gigabytes.
        assert!(check(&s, &[0x80, 0x80, 0x80, 0x80, 0x04, 2, 0]).is_err());
        // A negative count carries a byte size after it.
        assert!(check(&s, &[5, 6, 2, 4, 6, 0]).is_ok());
    }

    #[test]
    fn empty_items_are_capped_over_the_whole_datum() {
        let s = schema(r#"{"type": "array", "items": "null"}"#);
        assert!(check(&s, &[20, 0]).is_ok());
        // 2^20 nulls in one block.
        assert!(check(&s, &[0x80, 0x80, 0x80, 0x01, 0]).is_err());
        // Many small blocks add up.
        let many: Vec<u8> = std::iter::repeat_n([0xfe, 0x03], 600)
            .flatten()
            .chain([0])
            .collect();
        assert!(check(&s, &many).is_err());
    }

    #[test]
    fn lengths_past_the_end_and_bad_union_indexes_are_refused() {
        let s = schema(r#"["null", "string"]"#);
        assert!(check(&s, &[2, 4, b'h', b'i']).is_ok());
        assert!(check(&s, &[2, 200, b'h']).is_err());
        assert!(check(&s, &[4]).is_err());
        assert!(check(&s, &[2]).is_err());
    }

    #[test]
    fn recursion_is_bounded() {
        let s = schema(
            r#"{"type": "record", "name": "Node",
                "fields": [{"name": "next", "type": ["null", "Node"]}]}"#,
        );
        assert!(check(&s, &[2, 2, 0]).is_ok());
        let long_list: Vec<u8> = std::iter::repeat_n(2, 100).chain([0]).collect();
        assert!(check(&s, &long_list).is_ok(), "a list of 100 nodes is fine");
        let deep: Vec<u8> = std::iter::repeat_n(2, 10_000).chain([0]).collect();
        assert!(check(&s, &deep).unwrap_err().contains("deeper"));
    }

    #[test]
    fn a_map_counts_its_keys() {
        let s = schema(r#"{"type": "map", "values": "null"}"#);
        assert!(check(&s, &[2, 2, b'k', 0]).is_ok());
        assert!(check(&s, &[0x80, 0x80, 0x04, 2, b'k', 0]).is_err());
    }
}
