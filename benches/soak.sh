#!/usr/bin/env bash
# Soak: steady load on a graph, cron schedules and workflows for SOAK_MINUTES (30 by
# default), sampling the resident memory and open file descriptors of `weir run` and
# `weir worker` every minute. Not part of CI: run it by hand, then compare the first
# and last samples (they should stay flat).
#
#   benches/soak.sh                     # builds the release binary first
#   WEIR_BIN=path/to/weir SOAK_MINUTES=5 benches/soak.sh
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/services

minutes=${SOAK_MINUTES:-30}
rate=${SOAK_EVENTS_PER_SECOND:-200}
if [ -z "${WEIR_BIN:-}" ]; then
  cargo build --release --bin weir
  WEIR_BIN=target/release/weir
fi
work=$(mktemp -d)
prefix="soak$RANDOM$RANDOM"
admin_port=$((20000 + RANDOM % 20000))
pids=()
cleanup() {
  # The processes started here and every background job (the input generator too).
  for pid in "${pids[@]}" $(jobs -p); do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

cat >"$work/weir.toml" <<EOF
[broker]
kind = "nats"
url = "$WEIR_TEST_NATS"
retention_ms = 3600000
[store]
kind = "redis"
url = "$WEIR_TEST_REDIS"
prefix = "$prefix"
[admin]
listen = "127.0.0.1:$admin_port"
[dispatch]
results_topic = "$prefix.results"
default_executor = "$prefix"
[[graph]]
name = "soak"
criteria = "when_any"
strategy = "sequential"
function = "snapshot"
output = "$prefix.out"
[[graph.accumulator]]
name = "a"
topic = "$prefix.in"
[[schedule]]
id = "$prefix-tick"
cron = "* * * * * *"
topic = "$prefix.ticks"
delivery = "at_least_once"
[[schedule]]
id = "$prefix-flow"
cron = "* * * * * *"
workflow = "$prefix-flow"
[[workflow]]
name = "$prefix-flow"
[[workflow.task]]
id = "first"
handler = "builtin::echo"
[[workflow.task]]
id = "second"
handler = "builtin::sleep"
depends_on = ["first"]
EOF

"$WEIR_BIN" run --config "$work/weir.toml" 2>"$work/run.log" &
run_pid=$!
pids+=("$run_pid")
WEIR__ADMIN__LISTEN="127.0.0.1:$((admin_port + 1))" \
  "$WEIR_BIN" worker --config "$work/weir.toml" --executor "$prefix" 2>"$work/worker.log" &
worker_pid=$!
pids+=("$worker_pid")

# Steady input: `rate` events a second, in tenths.
(
  n=0
  while true; do
    for _ in $(seq 1 $((rate / 10))); do
      echo "{\"id\": $n, \"px\": 1.0}"
      n=$((n + 1))
    done
    sleep 0.1
  done
) | "$WEIR_BIN" produce "$prefix.in" --config "$work/weir.toml" 2>"$work/produce.log" &
pids+=("$!")

sample() {
  local pid=$1
  local rss fds
  rss=$(awk '/VmRSS/ {print $2}' "/proc/$pid/status" 2>/dev/null || echo "?")
  fds=$(ls "/proc/$pid/fd" 2>/dev/null | wc -l)
  printf '%s KiB, %s fds' "$rss" "$fds"
}

echo "soak: $minutes min, $rate events/s, a tick and a workflow every second ($prefix)"
printf 'minute\tweir run\tweir worker\treadyz\n'
for minute in $(seq 0 "$minutes"); do
  if [ "$minute" -gt 0 ]; then sleep 60; fi
  for pid in "$run_pid" "$worker_pid"; do
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "soak: process $pid exited; logs in $work" >&2
      cat "$work/run.log" "$work/worker.log" >&2
      exit 1
    fi
  done
  ready=$( (exec 3<>"/dev/tcp/127.0.0.1/$admin_port" &&
    printf 'GET /readyz HTTP/1.0\r\n\r\n' >&3 && head -1 <&3 | awk '{print $2}') 2>/dev/null || echo "?")
  printf '%s\t%s\t%s\t%s\n' "$minute" "$(sample "$run_pid")" "$(sample "$worker_pid")" "$ready"
done
