//! Environment overrides: `WEIR__SECTION__KEY=value` sets `section.key` (array entries
//! by index: `WEIR__GRAPH__0__OUTPUT`).

use super::*;

/// The key an override sets, as deserialization errors name it: `graph[0].output`.
pub(super) fn override_key(path: &str) -> String {
    let mut key = String::new();
    for segment in path.split("__").map(str::to_ascii_lowercase) {
        if segment.parse::<usize>().is_ok() {
            key.push_str(&format!("[{segment}]"));
        } else {
            if !key.is_empty() {
                key.push('.');
            }
            key.push_str(&segment);
        }
    }
    key
}

pub(super) fn apply_override(
    root: &mut toml::Value,
    var: &str,
    path: &str,
    raw: &str,
    as_text: bool,
) -> Result<(), ConfigError> {
    let segments: Vec<String> = path.split("__").map(|s| s.to_ascii_lowercase()).collect();
    if segments.iter().any(String::is_empty) {
        return Err(ConfigError::Env {
            var: var.into(),
            message: "expected WEIR__SECTION__KEY".into(),
        });
    }
    // A value that parses as TOML (number, boolean, quoted string, array) is taken as
    // such; anything else is a plain string.
    let value = toml::from_str::<toml::Table>(&format!("v = {raw}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .filter(|_| !as_text)
        .unwrap_or_else(|| toml::Value::String(raw.to_string()));
    let mut at = root;
    for (i, segment) in segments.iter().enumerate() {
        let last = i + 1 == segments.len();
        let key = segment.clone();
        // `graph` and `accumulator` are arrays of tables in the file; an index selects one.
        at = match at {
            toml::Value::Table(table) => {
                if last {
                    table.insert(key, value);
                    return Ok(());
                }
                let next_is_index = segments[i + 1].parse::<usize>().is_ok();
                table.entry(key).or_insert_with(|| {
                    if next_is_index {
                        toml::Value::Array(Vec::new())
                    } else {
                        toml::Value::Table(toml::Table::new())
                    }
                })
            }
            toml::Value::Array(items) => {
                let index: usize = segment.parse().map_err(|_| ConfigError::Env {
                    var: var.into(),
                    message: format!("{segment:?} is not an array index"),
                })?;
                if index >= items.len() {
                    return Err(ConfigError::Env {
                        var: var.into(),
                        message: format!(
                            "index {index} is past the {} declared entries",
                            items.len()
                        ),
                    });
                }
                if last {
                    items[index] = value;
                    return Ok(());
                }
                &mut items[index]
            }
            _ => {
                return Err(ConfigError::Env {
                    var: var.into(),
                    message: format!("{segment:?} is inside a value that is not a table"),
                })
            }
        };
    }
    Ok(())
}
