//! JSON codec for user events and graph outputs.

use serde_json::Value;

use super::CodecError;

/// Decodes one user event. Empty payloads are rejected rather than read as `null`, so a
/// producer bug is visible in the dead-letter topic instead of flowing as data.
pub fn decode(bytes: &[u8]) -> Result<Value, CodecError> {
    Ok(serde_json::from_slice(bytes)?)
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
    fn malformed_is_an_error() {
        let err = decode(b"{not json").unwrap_err();
        assert!(err.to_string().starts_with("invalid JSON"), "{err}");
        assert!(decode(b"").is_err());
    }
}
