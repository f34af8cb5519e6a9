# Sourced by the device-call scripts (gpu_session.sh, gpu_learner.sh): a deadline for the whole call and one
# step runner. Needs $OUT; BUDGET_S (default 570) is the call's seconds, counted from when this file is sourced.
start=$(date +%s)
left() { echo $(( ${BUDGET_S:-570} - ($(date +%s) - start) )); }
step() {  # step NAME SECONDS CMD...: run CMD with a deadline (at most what is left), log to $OUT/NAME.log, report
  local name=$1 secs=$2; shift 2
  local cap; cap=$(left); [ "$secs" -gt "$cap" ] && secs=$cap
  if [ "$secs" -le 20 ]; then echo "[$name] skipped: no time left"; return 0; fi
  local t0; t0=$(date +%s)
  timeout -k 10 "$secs" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "[$name] rc=$rc in $(( $(date +%s) - t0 )) s (limit $secs s)"
  tail -n 25 "$OUT/$name.log" | cut -c1-400
}
