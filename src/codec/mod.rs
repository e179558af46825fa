//! Wire formats.
//!
//! weir's own records travel as Avro single-object encoding ([`avro`]): the two marker
//! bytes `C3 01`, the schema's 8-byte CRC-64-AVRO fingerprint (little endian), then the
//! Avro binary body. User events are JSON ([`json`]).

pub mod avro;
mod avro_check;
mod avro_reader;
pub mod json;
pub mod records;

pub use avro::{AvroCodec, AvroRecord};
pub use records::{
    BoundaryRecord, CronTick, ExecutionResult, ExecutionResultBatch, JobMessage, PreparedTick,
    RecoveryEventRecord, TaskReadyBatch, TaskReadyEvent,
};

/// Why a message could not be encoded or decoded. Decoding errors are about the message,
/// so retrying the same bytes never helps; they go to a dead-letter topic instead.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    #[error("message too short for Avro single-object encoding ({len} bytes)")]
    Truncated { len: usize },
    #[error("message does not start with the Avro single-object marker C3 01")]
    BadMarker,
    #[error(
        "schema fingerprint mismatch for {record}: expected {expected:016x}, found {found:016x}"
    )]
    FingerprintMismatch {
        record: &'static str,
        expected: u64,
        found: u64,
    },
    #[error("Avro body of {record} is invalid: {reason}")]
    Avro {
        record: &'static str,
        reason: String,
    },
    #[error("schema {record} failed to parse: {reason}")]
    Schema {
        record: &'static str,
        reason: String,
    },
    #[error("invalid JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("arrays and objects nested deeper than {limit} levels, more than weir keeps")]
    TooDeep { limit: usize },
}

impl CodecError {
    /// Codec errors describe the bytes, not the environment: a retry cannot help.
    pub fn is_retryable(&self) -> bool {
        false
    }
}
