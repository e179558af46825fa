//! `weir cron preview` as users call it.

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
