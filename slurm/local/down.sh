#!/usr/bin/env bash
# Stop the local cluster of up.sh by its pid files (slurmd, slurmctld, then munged).
#   slurm/local/down.sh STATE_DIR [--purge]
set -uo pipefail
STATE=${1:?usage: down.sh STATE_DIR [--purge]}
stop() {  # pid files, in order; SIGTERM, then SIGKILL after 4 s
  local pids=()
  for f in "$@"; do [ -f "$f" ] && pids+=("$(cat "$f")"); done
  [ ${#pids[@]} -eq 0 ] && return
  kill "${pids[@]}" 2>/dev/null
  for _ in $(seq 40); do
    kill -0 "${pids[@]}" 2>/dev/null || return 0
    sleep 0.1
  done
  kill -9 "${pids[@]}" 2>/dev/null
}
export SLURM_CONF="$STATE/slurm.conf"
jobs=$(timeout 5 squeue -h -o %A 2>/dev/null)
if [ -n "$jobs" ]; then  # end running jobs first, so no task outlives the cluster
  timeout 5 scancel --full $jobs 2>/dev/null
  sleep 1
fi
stop "$STATE"/slurmd-n1.launcher.pid "$STATE"/slurmd-n2.launcher.pid "$STATE"/slurmd-n1.pid "$STATE"/slurmd-n2.pid
stop "$STATE"/slurmctld.launcher.pid "$STATE"/slurmctld.pid
stop "$STATE"/munged.pid
[ "${2:-}" = "--purge" ] && rm -rf "$STATE"
exit 0
