//! The direct Avro reader behind weir's own records (boundaries, cron ticks, task
//! events and results, alone and in batches, jobs, recovery events), behind the right
//! header.
#![no_main]

use libfuzzer_sys::fuzz_target;
use weir::codec::avro::{decode, AvroRecord};
use weir::codec::records::*;

fn framed<T: AvroRecord>(body: &[u8]) -> Vec<u8> {
    let mut bytes = vec![0xC3, 0x01];
    bytes.extend_from_slice(&T::codec().fingerprint().to_le_bytes());
    bytes.extend_from_slice(body);
    bytes
}

fn read<T: AvroRecord + PartialEq + std::fmt::Debug>(body: &[u8]) {
    if let Ok(record) = decode::<T>(&framed::<T>(body)) {
        // What decodes encodes again, and reads back the same.
        let again = weir::codec::avro::encode(&record).expect("a decoded record encodes");
        assert_eq!(
            decode::<T>(&again).expect("re-encoded record decodes"),
            record
        );
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&which, body)) = data.split_first() else {
        return;
    };
    match which % 8 {
        0 => read::<BoundaryRecord>(body),
        1 => read::<CronTick>(body),
        2 => read::<TaskReadyEvent>(body),
        3 => read::<ExecutionResult>(body),
        4 => read::<JobMessage>(body),
        5 => read::<TaskReadyBatch>(body),
        6 => read::<ExecutionResultBatch>(body),
        _ => read::<RecoveryEventRecord>(body),
    }
});
