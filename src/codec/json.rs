//! JSON codec for user events and graph outputs.

use serde_json::Value;

use super::CodecError;

/// The deepest nesting of arrays and objects weir takes in an event. The store wraps
/// what it keeps (a cache snapshot, a job's state) in a few levels of its own and reads
/// it back with serde_json, which stops at 128 levels: an event nested deeper could be
/// taken in and then never read back, stopping its graph or partition for good.
pub const MAX_DEPTH: usize = 100;

/// Decodes one user event. Empty payloads are rejected rather than read as `null`, so a
/// producer bug is visible in the dead-letter topic instead of flowing as data.
pub fn decode(bytes: &[u8]) -> Result<Value, CodecError> {
    let value = serde_json::from_slice(bytes)?;
    // Each level of nesting is at least its two brackets in the text: most events are
    // too short to be too deep, and are not walked again.
    if bytes.len() > 2 * MAX_DEPTH {
        check_depth(&value)?;
    }
    Ok(value)
}

/// Refuses a value nested deeper than [`MAX_DEPTH`].
pub fn check_depth(value: &Value) -> Result<(), CodecError> {
    if deeper_than(value, MAX_DEPTH) {
        return Err(CodecError::TooDeep { limit: MAX_DEPTH });
    }
    Ok(())
}

/// Whether `value` nests arrays and objects more than `levels` deep. Stops as soon as
/// it knows, so it recurses at most `levels` calls deep whatever the value.
fn deeper_than(value: &Value, levels: usize) -> bool {
    let left = levels.checked_sub(1);
    match (value, left) {
        (Value::Array(_) | Value::Object(_), None) => true,
        (Value::Array(items), Some(left)) => items.iter().any(|v| deeper_than(v, left)),
        (Value::Object(fields), Some(left)) => fields.values().any(|v| deeper_than(v, left)),
        _ => false,
    }
}

pub fn encode<T: serde::Serialize + ?Sized>(value: &T) -> Vec<u8> {
    // For JSON values and weir's records, whose serialization to a Vec cannot fail:
    // every map key is a string.
    serde_json::to_vec(value).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let v = serde_json::json!({"bid": 1.5, "sym": "EURUSD"});
        assert_eq!(decode(&encode(&v)).unwrap(), v);
    }

    #[test]
    fn numbers_come_out_as_they_went_in() {
        // Found by fuzzing: without correctly rounded parsing this number changed its
        // last digit on the way through.
        let text = b"444444444444444444444466";
        let once = decode(text).unwrap();
        assert_eq!(decode(&encode(&once)).unwrap(), once);
    }

    #[test]
    fn nesting_is_refused_past_the_limit() {
        let nested = |levels: usize| format!("{}1{}", "[".repeat(levels), "]".repeat(levels));
        assert!(decode(nested(MAX_DEPTH).as_bytes()).is_ok());
        let err = decode(nested(MAX_DEPTH + 1).as_bytes()).unwrap_err();
        assert!(
            matches!(err, CodecError::TooDeep { limit: MAX_DEPTH }),
            "{err}"
        );
        let objects = format!(
            "{}1{}",
            "{\"a\":".repeat(MAX_DEPTH + 1),
            "}".repeat(MAX_DEPTH + 1)
        );
        assert!(decode(objects.as_bytes()).is_err());
        // What the store wraps it in still reads back.
        let kept = serde_json::json!({"sources": {"a": {"current": {"value": decode(nested(MAX_DEPTH).as_bytes()).unwrap()}}}});
        let text = serde_json::to_string(&kept).unwrap();
        assert!(serde_json::from_str::<Value>(&text).is_ok());
    }

    #[test]
    fn malformed_is_an_error() {
        let err = decode(b"{not json").unwrap_err();
        assert!(err.to_string().starts_with("invalid JSON"), "{err}");
        assert!(decode(b"").is_err());
    }
}
