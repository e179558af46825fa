//! Rust shapes of the records in `schemas/`, one per file.

use serde::{Deserialize, Serialize};

use super::avro::avro_record;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BoundaryRecord {
    pub source: String,
    pub sequence: i64,
    pub partition: Option<i32>,
    pub offset: Option<i64>,
    pub event_time_ms: i64,
    pub emit_time_ms: i64,
    pub payload: String,
}
avro_record!(BoundaryRecord, "Boundary", "boundary.avsc");

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CronTick {
    pub schedule_id: String,
    pub tick_id: String,
    pub scheduled_time_ms: i64,
    pub emitted_time_ms: i64,
    pub fencing_token: i64,
    pub delivery: String,
    pub attempt: i32,
    pub payload: String,
    pub node_id: String,
    pub tenant: Option<String>,
}
avro_record!(CronTick, "CronTick", "cron_tick.avsc");

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskReadyEvent {
    pub execution_id: String,
    pub task_execution_id: String,
    pub namespace: String,
    pub attempt: i32,
    pub max_attempts: i32,
    pub ready_at_ms: i64,
}
avro_record!(TaskReadyEvent, "TaskReadyEvent", "task_ready_event.avsc");

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExecutionResult {
    pub execution_id: String,
    pub task_execution_id: String,
    pub namespace: String,
    pub attempt: i32,
    pub status: String,
    pub error: Option<String>,
    pub duration_ms: i64,
    pub worker_id: String,
    pub finished_at_ms: i64,
}
avro_record!(ExecutionResult, "ExecutionResult", "execution_result.avsc");

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReactorCommandRecord {
    pub graph: String,
    pub command: String,
    pub cache: Option<String>,
    pub request_id: Option<String>,
}
avro_record!(
    ReactorCommandRecord,
    "ReactorCommand",
    "reactor_command.avsc"
);

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobMessage {
    pub job_id: String,
    pub kind: String,
    pub payload: String,
    pub sent_at_ms: i64,
}
avro_record!(JobMessage, "JobMessage", "job_message.avsc");

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecoveryEventRecord {
    pub graph: String,
    pub component: String,
    pub action: String,
    pub attempt: i32,
    pub error: String,
    pub at_ms: i64,
    pub node_id: String,
}
avro_record!(RecoveryEventRecord, "RecoveryEvent", "recovery_event.avsc");

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::avro::{decode, encode, fingerprint_of, AvroRecord};
    use crate::codec::CodecError;

    fn round_trip<T: AvroRecord + PartialEq + std::fmt::Debug>(record: T) {
        let bytes = encode(&record).unwrap();
        assert_eq!(&bytes[..2], &[0xC3, 0x01]);
        assert_eq!(fingerprint_of(&bytes), Some(T::codec().fingerprint()));
        assert_eq!(decode::<T>(&bytes).unwrap(), record);
    }

    fn tick() -> CronTick {
        CronTick {
            schedule_id: "nightly".into(),
            tick_id: "nightly@1700000000000".into(),
            scheduled_time_ms: 1_700_000_000_000,
            emitted_time_ms: 1_700_000_000_003,
            fencing_token: 7,
            delivery: "at_most_once".into(),
            attempt: 1,
            payload: "{}".into(),
            node_id: "n1".into(),
            tenant: None,
        }
    }

    #[test]
    fn every_schema_round_trips() {
        round_trip(BoundaryRecord {
            source: "orderbook".into(),
            sequence: 42,
            partition: Some(3),
            offset: Some(1001),
            event_time_ms: 1,
            emit_time_ms: 2,
            payload: r#"{"bid":1.0}"#.into(),
        });
        round_trip(tick());
        round_trip(CronTick {
            tenant: Some("acme".into()),
            ..tick()
        });
        round_trip(TaskReadyEvent {
            execution_id: "e1".into(),
            task_execution_id: "e1/t1/1".into(),
            namespace: "public::etl::daily::extract".into(),
            attempt: 1,
            max_attempts: 3,
            ready_at_ms: 5,
        });
        round_trip(ExecutionResult {
            execution_id: "e1".into(),
            task_execution_id: "e1/t1/1".into(),
            namespace: "public::etl::daily::extract".into(),
            attempt: 2,
            status: "failed".into(),
            error: Some("boom".into()),
            duration_ms: 12,
            worker_id: "w1".into(),
            finished_at_ms: 9,
        });
        round_trip(ReactorCommandRecord {
            graph: "prices".into(),
            command: "fire_with".into(),
            cache: Some(r#"{"a":1}"#.into()),
            request_id: None,
        });
        round_trip(JobMessage {
            job_id: "j1".into(),
            kind: "start".into(),
            payload: "{}".into(),
            sent_at_ms: 3,
        });
        round_trip(RecoveryEventRecord {
            graph: "prices".into(),
            component: "reactor".into(),
            action: "graph_respawned".into(),
            attempt: 1,
            error: "panicked".into(),
            at_ms: 4,
            node_id: "n1".into(),
        });
    }

    #[test]
    fn fingerprints_differ_between_records() {
        assert_ne!(
            CronTick::codec().fingerprint(),
            TaskReadyEvent::codec().fingerprint()
        );
    }

    #[test]
    fn a_record_of_another_schema_is_rejected() {
        let bytes = encode(&tick()).unwrap();
        let err = decode::<TaskReadyEvent>(&bytes).unwrap_err();
        assert!(
            matches!(
                err,
                CodecError::FingerprintMismatch {
                    record: "TaskReadyEvent",
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("fingerprint mismatch"));
    }

    #[test]
    fn bad_framing_is_rejected() {
        assert!(matches!(
            decode::<CronTick>(b"short"),
            Err(CodecError::Truncated { len: 5 })
        ));
        assert!(matches!(
            decode::<CronTick>(b"{\"json\": \"not avro\"}"),
            Err(CodecError::BadMarker)
        ));
        let mut bytes = encode(&tick()).unwrap();
        bytes.truncate(14);
        assert!(matches!(
            decode::<CronTick>(&bytes),
            Err(CodecError::Avro { .. })
        ));
    }

    #[test]
    fn fingerprint_matches_the_avro_specification() {
        // CRC-64-AVRO of the canonical form of "int" is published in the Avro spec's
        // reference implementation tests.
        let codec = crate::codec::AvroCodec::new("Int", r#""int""#).unwrap();
        assert_eq!(codec.fingerprint(), 0x7275d51a3f395c8f_u64);
    }
}
