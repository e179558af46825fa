//! The built-in job handlers.

use std::time::Duration;

use serde_json::{json, Map, Value};

use super::{HandlerError, JobEvent, JobHandler, Step, Timer};

/// `builtin::count`: `count` grows by one per message; with `every_ms` in the state, each
/// timeout adds one to `timeouts` and arms the next. A stop outputs the final state.
pub struct Count;

impl Count {
    fn every(state: &Map<String, Value>) -> Timer {
        match state.get("every_ms").and_then(Value::as_u64) {
            Some(ms) if ms > 0 => Timer::After(Duration::from_millis(ms)),
            _ => Timer::Clear,
        }
    }

    fn bump(state: &mut Map<String, Value>, field: &str) {
        let n = state.get(field).and_then(Value::as_u64).unwrap_or(0);
        state.insert(field.to_string(), json!(n.saturating_add(1)));
    }
}

impl JobHandler for Count {
    fn handle(&self, state: Value, event: &JobEvent) -> Result<Step, HandlerError> {
        let Value::Object(mut state) = state else {
            return Err(HandlerError::new(format!(
                "builtin::count keeps its state in a JSON object, not {state}"
            )));
        };
        match event {
            JobEvent::Start => {
                state.entry("count").or_insert(json!(0));
                let timer = Self::every(&state);
                if timer != Timer::Clear {
                    state.entry("timeouts").or_insert(json!(0));
                }
                Ok(Step::new(Value::Object(state)).timer(timer))
            }
            JobEvent::Message(_) => {
                Self::bump(&mut state, "count");
                Ok(Step::new(Value::Object(state)))
            }
            JobEvent::Timeout => {
                Self::bump(&mut state, "timeouts");
                let timer = Self::every(&state);
                Ok(Step::new(Value::Object(state)).timer(timer))
            }
            JobEvent::Stop => {
                let state = Value::Object(state);
                Ok(Step::new(state.clone()).timer(Timer::Clear).output(state))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_messages_and_timeouts() {
        let step = Count
            .handle(json!({"every_ms": 100}), &JobEvent::Start)
            .unwrap();
        assert_eq!(step.timer, Timer::After(Duration::from_millis(100)));
        let step = Count
            .handle(step.state, &JobEvent::Message(json!("x")))
            .unwrap();
        assert_eq!(step.timer, Timer::Keep);
        let step = Count.handle(step.state, &JobEvent::Timeout).unwrap();
        assert_eq!(
            step.state,
            json!({"every_ms": 100, "count": 1, "timeouts": 1})
        );
        let step = Count.handle(step.state, &JobEvent::Stop).unwrap();
        assert_eq!(step.timer, Timer::Clear);
        assert_eq!(step.outputs, vec![step.state.clone()]);
    }

    #[test]
    fn counts_stop_at_the_largest_number_rather_than_overflow() {
        let step = Count
            .handle(json!({"count": u64::MAX}), &JobEvent::Message(json!(1)))
            .unwrap();
        assert_eq!(step.state["count"], json!(u64::MAX));
    }

    #[test]
    fn a_state_that_is_no_object_is_refused() {
        let refused = Count.handle(json!(3), &JobEvent::Start).unwrap_err();
        assert!(refused.reason.contains("JSON object"), "{refused}");
    }
}
