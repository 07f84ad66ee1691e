#!/usr/bin/env bash
# Runs every kill -9 and race test of the default suite N times in a row (default 20)
# and prints a tally per run: `make test-races N=20`. A flaky test blocks every
# submission, so these must pass every time, not usually.
set -uo pipefail
cd "$(dirname "$0")/.."
N=${N:-20}
TESTS=(
  tests/test_maintenance_crash.py
  tests/test_ingest_crash.py
  tests/test_storage_crash.py
  "tests/test_ingest_pg_cdc.py::test_two_cdc_instances_race_on_one_slot"
  "tests/test_ingest_pg_cdc.py::test_cdc_kill9_restarts_equal_the_table_at_every_bound_lsn"
  tests/test_cas_race.py
  tests/test_two_processes.py
  tests/test_ingest_concurrent.py
  "tests/test_spark_write.py::test_killed_executor_process_commits_nothing"
  tests/test_reliability.py
  tests/test_no_data_loss.py
  tests/test_location_contract.py::test_blob_concurrent_sets_never_torn
  tests/test_location_contract.py::test_consensus_concurrent_threads_single_winner
  tests/test_location_contract.py::test_sqlite_first_open_waits_for_a_rival_holding_the_write_lock
  tests/test_location_contract.py::test_sqlite_many_threads_open_a_fresh_location_at_once
  tests/test_location_contract.py::test_sqlite_many_processes_open_a_fresh_location_at_once
)
KW="not slow"
pass=0; fail=0
for i in $(seq 1 "$N"); do
  start=$(date +%s)
  if .venv/bin/python -m pytest -q -p no:cacheprovider -m "$KW" "${TESTS[@]}" \
       > "/tmp/race-loop-$i.log" 2>&1; then
    pass=$((pass + 1)); verdict=ok
  else
    fail=$((fail + 1)); verdict=FAILED
  fi
  summary=$(tail -1 "/tmp/race-loop-$i.log")
  echo "run $i/$N: $verdict in $(( $(date +%s) - start )) s: $summary (log /tmp/race-loop-$i.log)"
done
echo "race/kill -9 loop: $pass passed, $fail failed of $N runs"
[ "$fail" -eq 0 ]
