//! `weir cron preview` as users call it.

mod common;

use std::process::Command;

fn weir(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_weir"))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn preview_prints_utc_instants_one_per_line() {
    let out = weir(&[
        "cron",
        "preview",
        "--expr",
        "30 2 * * *",
        "--tz",
        "America/New_York",
        "--from",
        "2026-03-07T12:00:00Z",
        "--count",
        "2",
    ]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        "2026-03-08T07:00:00Z\n2026-03-09T06:30:00Z\n"
    );
}

#[test]
fn preview_defaults_to_now_and_ten_lines() {
    let out = weir(&["cron", "preview", "--expr", "0 0 * * *", "--tz", "UTC"]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 10);
    assert!(lines.iter().all(|l| l.ends_with("T00:00:00Z")));
}

#[test]
fn bad_expression_or_zone_exits_2_naming_it() {
    let out = weir(&["cron", "preview", "--expr", "61 * * * *", "--tz", "UTC"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("61 * * * *"));
    let out = weir(&[
        "cron",
        "preview",
        "--expr",
        "* * * * *",
        "--tz",
        "Nowhere/Land",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("Nowhere/Land"));
}

#[test]
fn a_count_past_what_can_be_printed_exits_2_naming_it() {
    let out = weir(&[
        "cron",
        "preview",
        "--expr",
        "* * * * *",
        "--tz",
        "UTC",
        "--count",
        "1000000000000",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--count"));
}

#[cfg(feature = "it")]
mod with_redis {
    use super::weir;
    use std::io::Write;

    use crate::common::services;

    /// A config file naming a Redis store under `prefix`.
    fn config_file(prefix: &str) -> tempfile::NamedTempFile {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        write!(
            file,
            "[store]\nkind = \"redis\"\nurl = \"{}\"\nprefix = \"{prefix}\"\n",
            services::redis_url()
        )
        .unwrap();
        file
    }

    /// `weir cron <args[0]> --config <file> <args[1..]>`.
    fn cron(file: &tempfile::NamedTempFile, args: &[&str]) -> std::process::Output {
        let config = file.path().to_str().unwrap();
        let mut all = vec!["cron"];
        all.extend_from_slice(&args[..1]);
        all.extend_from_slice(&["--config", config]);
        all.extend_from_slice(&args[1..]);
        weir(&all)
    }

    #[test]
    fn add_list_pause_resume_history_and_rm() {
        let prefix = services::unique("weircli");
        let _cleanup_prefix = services::cleanup(&prefix);
        let file = config_file(&prefix);
        let run = |args: &[&str]| cron(&file, args);
        let out = run(&[
            "add",
            "--id",
            "nightly",
            "--cron",
            "30 2 * * *",
            "--tz",
            "America/New_York",
            "--payload",
            r#"{"k":1}"#,
        ]);
        assert!(out.status.success(), "{out:?}");
        let out = run(&["list"]);
        let text = String::from_utf8(out.stdout).unwrap();
        assert!(
            text.starts_with("nightly\t30 2 * * *\tAmerica/New_York\tenabled\tnext=20"),
            "{text}"
        );
        assert!(run(&["pause", "nightly"]).status.success());
        assert!(String::from_utf8(run(&["list"]).stdout)
            .unwrap()
            .contains("paused\tnext=-"));
        assert!(run(&["resume", "nightly"]).status.success());
        let show: serde_json::Value =
            serde_json::from_slice(&run(&["show", "nightly"]).stdout).unwrap();
        assert_eq!(show["payload"]["k"], 1);
        assert!(show["next_fire"].as_str().unwrap().ends_with(":30:00Z"));
        assert!(run(&["history", "nightly"]).status.success());
        let bad = run(&["add", "--id", "x", "--cron", "* * *"]);
        assert_eq!(bad.status.code(), Some(2));
        assert!(run(&["rm", "nightly"]).status.success());
        assert_eq!(run(&["rm", "nightly"]).status.code(), Some(2));
    }

    /// A stored schedule this version cannot read (another version wrote it, say) is
    /// named on stderr and the command exits 2, after listing every other schedule.
    #[test]
    fn list_names_an_unreadable_schedule_and_lists_the_rest() {
        let prefix = services::unique("weircli");
        let _cleanup_prefix = services::cleanup(&prefix);
        let file = config_file(&prefix);
        for id in ["a", "b", "c"] {
            let out = cron(&file, &["add", "--id", id, "--cron", "0 * * * *"]);
            assert!(out.status.success(), "{out:?}");
        }
        let client = redis::Client::open(services::redis_url()).unwrap();
        let mut connection = client.get_connection().unwrap();
        redis::cmd("SET")
            .arg(format!("{prefix}:sched:b"))
            .arg(r#"{"id": "b", "cron": 7}"#)
            .query::<()>(&mut connection)
            .unwrap();
        let out = cron(&file, &["list"]);
        let listed: Vec<String> = String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(|line| line.split('\t').next().unwrap().to_string())
            .collect();
        assert_eq!(listed, ["a", "c"]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("schedule \"b\" not listed"), "{stderr}");
        assert!(stderr.contains(&format!("{prefix}:sched:b")), "{stderr}");
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(
            stderr.contains("stored schedules that could not be read: 1"),
            "{stderr}"
        );
        // Looked at alone, it is bad data too, named by its key.
        let out = cron(&file, &["show", "b"]);
        assert_eq!(out.status.code(), Some(2), "{out:?}");
        assert!(String::from_utf8_lossy(&out.stderr).contains(&format!("{prefix}:sched:b")));
        // Removing it is how an operator clears it.
        assert!(cron(&file, &["rm", "b"]).status.success());
        let out = cron(&file, &["list"]);
        assert!(out.status.success(), "{out:?}");
        for id in ["a", "c"] {
            assert!(cron(&file, &["rm", id]).status.success());
        }
    }

    /// An execution record this version cannot read is named on stderr and `history`
    /// exits 2, after listing the schedule's other executions.
    #[test]
    fn history_names_an_unreadable_execution_and_lists_the_rest() {
        let prefix = services::unique("weircli");
        let _cleanup_prefix = services::cleanup(&prefix);
        let file = config_file(&prefix);
        let out = cron(&file, &["add", "--id", "h", "--cron", "0 * * * *"]);
        assert!(out.status.success(), "{out:?}");
        let client = redis::Client::open(services::redis_url()).unwrap();
        let mut connection = client.get_connection().unwrap();
        for at in [1_000i64, 2_000, 3_000] {
            let record = if at == 2_000 {
                services::unreadable_execution("h")
            } else {
                serde_json::to_string(&services::completed_execution("h", at)).unwrap()
            };
            redis::pipe()
                .set(format!("{prefix}:exec:h:{at}"), record)
                .zadd(format!("{prefix}:exec:hist:h"), at, at)
                .query::<()>(&mut connection)
                .unwrap();
        }
        let out = cron(&file, &["history", "h"]);
        let listed: Vec<i64> = String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(|line| {
                let e: serde_json::Value = serde_json::from_str(line).unwrap();
                e["scheduled_ms"].as_i64().unwrap()
            })
            .collect();
        assert_eq!(listed, [3_000, 1_000], "newest first");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("execution of \"h\" at 2000 ms not listed"),
            "{stderr}"
        );
        assert!(
            stderr.contains(&format!("{prefix}:exec:h:2000")),
            "{stderr}"
        );
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(
            stderr.contains("stored executions that could not be read: 1"),
            "{stderr}"
        );
        assert!(cron(&file, &["rm", "h"]).status.success());
    }
}
