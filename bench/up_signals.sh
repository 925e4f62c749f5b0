#!/usr/bin/env bash
# How `kvfleet up` stops on each signal: start a one-replica cluster in a process group of its
# own (as a shell job, `timeout` or a systemd unit would), wait for "ready", send the signal, time
# the stop, then list what is left of that cluster (processes of its sessions, its Ray session
# directory under /tmp/kvf-ray-*).
#
#   bash bench/up_signals.sh MODE [MODE ...]     MODE: group-term group-int group-hup
#                                                      launcher-term launcher-kill cluster-term
#                                                      cluster-kill
# launcher-*: the process started (the supervisor); cluster-*: the cluster process it runs in a
# session of its own (the pid `kvfleet status` records).
# KVFLEET_UP_SUPERVISED=1 in the environment runs `up` unsupervised (the behaviour before the
# cluster had a session of its own), for comparison; SHOW=1 lists the cluster's processes. Quote `uptime` with the times.
set -u
cd "$(dirname "$0")/.."
KVFLEET=${KVFLEET:-.venv/bin/kvfleet}
for mode in "$@"; do
  log=$(mktemp /tmp/kvf-up-signals-XXXX.log)
  setsid "$KVFLEET" up --replicas 1 --port 0 --http-port 0 >"$log" 2>&1 &
  leader=$!  # setsid execs in the background job's child: its pid leads the new group
  for _ in $(seq 600); do grep -q "kvfleet ready" "$log" && break; sleep 0.5; done
  grep -q "kvfleet ready" "$log" || { echo "$mode: not ready"; cat "$log"; kill -KILL -- -"$leader"; continue; }
  sids=$(ps -eo sid=,pid=,ppid= | awk -v l="$leader" '$2==l || $3==l {print $1}' | sort -u | tr '\n' ' ')
  # This cluster's Ray session directory: named on its own processes' command lines (other
  # clusters on the host have theirs).
  ray_dir=$(ps -eo sid=,args= | awk -v s=" $sids" 'index(s, " " $1 " ")' \
            | grep -o '/tmp/kvf-ray-[A-Za-z0-9_]*' | sort -u | tr '\n' ' ')
  [ -n "${SHOW:-}" ] && ps -eo sid=,pgid=,pid=,ppid=,comm= | awk -v s=" $sids" 'index(s, " " $1 " ")'
  start=$(date +%s.%N)
  case "$mode" in
    group-term) kill -TERM -- -"$leader" ;;
    group-int) kill -INT -- -"$leader" ;;
    group-hup) kill -HUP -- -"$leader" ;;
    launcher-term) kill -TERM "$leader" ;;
    launcher-kill) kill -KILL "$leader" ;;
    cluster-term) kill -TERM "$(pgrep -P "$leader" | head -1)" ;;
    cluster-kill) kill -KILL "$(pgrep -P "$leader" | head -1)" ;;
  esac
  wait "$leader"; rc=$?
  # The launcher is gone; what it started may still be stopping: give it up to 120 s.
  for _ in $(seq 240); do
    left=$(ps -eo sid=,pid=,args= | awk -v s=" $sids" 'index(s, " " $1 " ") {print}')
    [ -z "$left" ] && break; sleep 0.5
  done
  end=$(date +%s.%N)
  dirs=$(for d in $ray_dir; do [ -e "$d" ] && echo "$d"; done)
  printf '%s: exit %s, all stopped after %.1f s; sessions %s; left: %s; ray dir %s left: %s\n' \
    "$mode" "$rc" "$(echo "$end - $start" | bc)" "$sids" "${left:-none}" "$ray_dir" "${dirs:-none}"
  rm -f "$log"
done
