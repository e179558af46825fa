//! A custom accumulator: a moving average over the last few readings, whose window is
//! checkpointed with its source position, so a restart resumes the same average.
//! Runs on the embedded default: `cargo run --example custom_accumulator`.

use std::collections::VecDeque;

use serde_json::{json, Value};
use weir::accumulator::AccumulatorError;
use weir::testing::TestDriver;
use weir::{
    Accumulator, AccumulatorSpec, Event, GraphBuilder, NodeContext, ReactorState, Strategy,
};

/// Emits the mean of the last `window` readings once the window is full.
struct MovingAverage {
    window: usize,
    readings: VecDeque<f64>,
}

impl Accumulator for MovingAverage {
    fn init(&mut self, state: Option<Value>) -> Result<(), AccumulatorError> {
        if let Some(state) = state {
            self.readings = serde_json::from_value(state)
                .map_err(|e| AccumulatorError::BadCheckpoint(e.to_string()))?;
        }
        Ok(())
    }

    fn process(&mut self, event: Event) -> Result<Option<Value>, AccumulatorError> {
        let Some(reading) = event.value.as_f64() else {
            return Err(AccumulatorError::Rejected(format!(
                "{} is not a number",
                event.value
            )));
        };
        self.readings.push_back(reading);
        if self.readings.len() > self.window {
            self.readings.pop_front();
        }
        if self.readings.len() < self.window {
            return Ok(None);
        }
        let mean = self.readings.iter().sum::<f64>() / self.window as f64;
        Ok(Some(json!(mean)))
    }

    /// Some state makes the accumulator stateful: its position is committed only with it.
    fn checkpoint(&self) -> Option<Value> {
        Some(json!(self.readings))
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let driver = TestDriver::new();
    let graph = driver.spawn(
        GraphBuilder::new("temperatures")
            .accumulator(
                AccumulatorSpec::custom("avg", || MovingAverage {
                    window: 3,
                    readings: VecDeque::new(),
                })
                .topic("sensor.readings"),
            )
            // One fire per average, none coalesced.
            .strategy(Strategy::Sequential)
            .node("report", ["avg"], |ctx: NodeContext| async move {
                let mean: f64 = ctx.get("avg")?.unwrap_or_default();
                Ok(Some(json!({ "mean_of_3": mean })))
            })
            .output("report", "sensor.averages")
            .build()?,
    );
    graph.wait_for_state(ReactorState::Live).await;
    for reading in [20.0, 21.0, 22.5, 23.0, 19.5] {
        driver.pipe("sensor.readings", &json!(reading)).await;
    }
    driver
        .eventually("three averages", || async {
            driver.outputs("sensor.averages").len() == 3
        })
        .await;
    for average in driver.outputs("sensor.averages") {
        println!("{average}");
    }
    driver.shutdown().await;
    Ok(())
}
