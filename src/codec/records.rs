//! Rust shapes of the records in `schemas/`, one per file.

use serde::{Deserialize, Serialize};

use super::avro::{avro_record, write_long};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BoundaryRecord {
    pub source: String,
    pub sequence: i64,
    pub positions: Vec<crate::transport::Position>,
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

/// A [`CronTick`] encoded ahead of its time with every field but the emission time, so
/// that at the due instant only that one field is written: ticks go out at their
/// instant without paying for Avro encoding there.
#[derive(Debug, Clone)]
pub struct PreparedTick {
    /// Marker, fingerprint and the fields before `emitted_time_ms`.
    head: Vec<u8>,
    /// The fields after it.
    tail: Vec<u8>,
}

fn long_len(value: i64) -> usize {
    let mut buf = Vec::with_capacity(10);
    write_long(&mut buf, value);
    buf.len()
}

impl PreparedTick {
    pub fn new(tick: &CronTick) -> Result<Self, super::CodecError> {
        let placeholder = CronTick {
            emitted_time_ms: 0,
            ..tick.clone()
        };
        let bytes = super::avro::encode(&placeholder)?;
        // Single-object header (2 + 8 bytes), then the fields in schema order.
        let split = 10
            + long_len(tick.schedule_id.len() as i64)
            + tick.schedule_id.len()
            + long_len(tick.tick_id.len() as i64)
            + tick.tick_id.len()
            + long_len(tick.scheduled_time_ms);
        // The placeholder 0 is the single byte 0x00.
        if bytes.get(split) != Some(&0) {
            return Err(super::CodecError::Avro {
                record: "CronTick",
                reason: "unexpected layout of the encoded tick".into(),
            });
        }
        Ok(Self {
            head: bytes[..split].to_vec(),
            tail: bytes[split + 1..].to_vec(),
        })
    }

    /// The complete record, emitted at `emitted_ms`.
    pub fn finish(&self, emitted_ms: i64) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.head.len() + 10 + self.tail.len());
        out.extend_from_slice(&self.head);
        write_long(&mut out, emitted_ms);
        out.extend_from_slice(&self.tail);
        out
    }
}

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
    pub output: Option<String>,
}
avro_record!(ExecutionResult, "ExecutionResult", "execution_result.avsc");

/// Several [`TaskReadyEvent`]s in one message (see [`super::avro::BatchOf`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskReadyBatch {
    pub events: Vec<TaskReadyEvent>,
}
avro_record!(TaskReadyBatch, "TaskReadyBatch", "task_ready_batch.avsc");

impl super::avro::BatchOf for TaskReadyEvent {
    type Batch = TaskReadyBatch;
    fn unbatch(batch: TaskReadyBatch) -> Vec<Self> {
        batch.events
    }
}

/// Several [`ExecutionResult`]s in one message (see [`super::avro::BatchOf`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExecutionResultBatch {
    pub results: Vec<ExecutionResult>,
}
avro_record!(
    ExecutionResultBatch,
    "ExecutionResultBatch",
    "execution_result_batch.avsc"
);

impl super::avro::BatchOf for ExecutionResult {
    type Batch = ExecutionResultBatch;
    fn unbatch(batch: ExecutionResultBatch) -> Vec<Self> {
        batch.results
    }
}

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

/// The codecs of every record above, for tools that meet them on a topic.
pub fn codecs() -> [&'static super::AvroCodec; 8] {
    use super::avro::AvroRecord;
    [
        BoundaryRecord::codec(),
        CronTick::codec(),
        TaskReadyEvent::codec(),
        TaskReadyBatch::codec(),
        ExecutionResult::codec(),
        ExecutionResultBatch::codec(),
        JobMessage::codec(),
        RecoveryEventRecord::codec(),
    ]
}

/// Decodes a message holding one of weir's records, recognised by the schema fingerprint
/// of its single-object encoding: the record's name and fields. `None` when the bytes
/// carry no known fingerprint.
pub fn decode_known(
    bytes: &[u8],
) -> Option<Result<(&'static str, serde_json::Value), super::CodecError>> {
    let fingerprint = super::avro::fingerprint_of(bytes)?;
    let codec = codecs()
        .into_iter()
        .find(|c| c.fingerprint() == fingerprint)?;
    Some(codec.decode_json(bytes).map(|v| (codec.name(), v)))
}

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
            positions: vec![
                crate::transport::Position {
                    partition: -1,
                    offset: 7,
                },
                crate::transport::Position {
                    partition: 3,
                    offset: 1001,
                },
            ],
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
            output: Some(r#"{"rows":3}"#.into()),
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
    fn a_prepared_tick_encodes_like_the_codec() {
        for (emitted, tenant) in [(1_700_000_000_003, None), (-5, Some("acme")), (0, None)] {
            let t = CronTick {
                emitted_time_ms: emitted,
                tenant: tenant.map(String::from),
                payload: r#"{"x":"é"}"#.into(),
                ..tick()
            };
            let prepared = PreparedTick::new(&t).unwrap();
            assert_eq!(prepared.finish(emitted), encode(&t).unwrap());
            assert_eq!(decode::<CronTick>(&prepared.finish(emitted)).unwrap(), t);
        }
    }

    #[test]
    fn known_records_decode_to_json_by_fingerprint() {
        let bytes = encode(&tick()).unwrap();
        let (name, value) = decode_known(&bytes).unwrap().unwrap();
        assert_eq!(name, "CronTick");
        assert_eq!(value["schedule_id"], "nightly");
        assert_eq!(value["fencing_token"], 7);
        assert!(decode_known(br#"{"json": true}"#).is_none());
        let mut unknown = bytes.clone();
        unknown[2] ^= 0xff;
        assert!(decode_known(&unknown).is_none());
    }

    fn ready(n: i64) -> TaskReadyEvent {
        TaskReadyEvent {
            execution_id: format!("e{n}"),
            task_execution_id: format!("e{n}/t"),
            namespace: "public::etl::daily::t".into(),
            attempt: 1,
            max_attempts: 3,
            ready_at_ms: n * 1_000_000_007,
        }
    }

    #[test]
    fn a_batch_is_its_records_as_they_travel_alone() {
        use crate::codec::avro::{decode_one_or_batch, frame_batch, frame_single};
        let events: Vec<TaskReadyEvent> = (0..3).map(ready).collect();
        let codec = TaskReadyEvent::codec();
        let bodies: Vec<Vec<u8>> = events
            .iter()
            .map(|e| codec.encode_body(e).unwrap())
            .collect();
        let batch = frame_batch::<TaskReadyEvent>(bodies.iter().map(Vec::as_slice));
        // What the schema's own encoder writes for the batch, byte for byte.
        assert_eq!(
            batch,
            encode(&TaskReadyBatch {
                events: events.clone()
            })
            .unwrap()
        );
        assert_eq!(
            decode_one_or_batch::<TaskReadyEvent>(&batch).unwrap(),
            events
        );
        let alone = frame_single::<TaskReadyEvent>(&bodies[1]);
        assert_eq!(alone, encode(&events[1]).unwrap());
        assert_eq!(
            decode_one_or_batch::<TaskReadyEvent>(&alone).unwrap(),
            vec![events[1].clone()]
        );
        let empty = frame_batch::<TaskReadyEvent>(std::iter::empty());
        assert!(decode_one_or_batch::<TaskReadyEvent>(&empty)
            .unwrap()
            .is_empty());
        assert!(decode_one_or_batch::<TaskReadyEvent>(&encode(&tick()).unwrap()).is_err());
    }

    #[test]
    fn batch_schemas_hold_the_single_record_schemas_unchanged() {
        use apache_avro::Schema;
        fn items(batch: &Schema) -> &Schema {
            match batch {
                Schema::Record(record) => match &record.fields[0].schema {
                    Schema::Array(array) => &array.items,
                    other => panic!("batch field is not an array: {other:?}"),
                },
                other => panic!("batch is not a record: {other:?}"),
            }
        }
        let pairs = [
            (TaskReadyBatch::codec(), TaskReadyEvent::codec()),
            (ExecutionResultBatch::codec(), ExecutionResult::codec()),
        ];
        for (batch, single) in pairs {
            let inner = items(batch.schema()).canonical_form();
            assert_eq!(inner, single.schema().canonical_form(), "{}", batch.name());
        }
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
