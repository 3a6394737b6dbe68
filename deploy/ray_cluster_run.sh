#!/usr/bin/env bash
# Run one simulation on a multi-node Ray cluster through Flower's simulation runtime.
#
#   deploy/ray_cluster_run.sh --local-cluster [fedrec run arguments]   # head + a second node on loopback
#   RAY_ADDRESS=HOST:PORT deploy/ray_cluster_run.sh [fedrec run arguments]   # a cluster you started
#
# Flower's Ray backend calls ray.init() without an address, and Ray then joins the cluster named by
# RAY_ADDRESS. `flwr run . local` hands the run to a background SuperLink that keeps the environment it
# was started with, so this script gives the run a Flower home of its own (FLWR_HOME in a fresh work
# folder) and free SuperLink ports: the SuperLink started there sees RAY_ADDRESS, and the user's own SuperLink
# is never touched.
# At the end it stops that SuperLink by process id (fedrec_flwr.flower.local_superlink), and with --local-cluster
# the two Ray nodes it started (each a `ray start --block` process, whose SIGTERM stops that node's own
# processes and nothing else), then removes the work folder. Nothing is stopped by name.
# --local-cluster: RAY_NODE_CPUS CPUs per node (default 1), RAY_PORT (default 6390). The ClientApp actors
# are spread over every node's CPUs (simulation.num_cpus per actor). FEDREC_RAY_WORK names the work
# folder instead of a fresh one, and keeps it: the Ray nodes' logs are under its ray/, where each ClientApp
# logs the Ray node it ran on (FEDREC_CLIENT_LOG_LEVEL, INFO on the loopback nodes).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="$PWD/.venv/bin/python"
RAY="$PWD/.venv/bin/ray"
export PATH="$PWD/.venv/bin:$PATH"

keep_work=0
if [ -n "${FEDREC_RAY_WORK:-}" ]; then
  work="$FEDREC_RAY_WORK"; keep_work=1; mkdir -p "$work"
else
  work=$(mktemp -d /tmp/fedrec-ray.XXXXXX)
fi
if [ "${#work}" -gt 32 ]; then  # Ray's socket paths (session folder + sockets/...) must fit AF_UNIX's 107 bytes
  echo "ray_cluster_run.sh: work folder $work is longer than 32 characters, too long for Ray's socket paths" >&2
  exit 2
fi
export FLWR_HOME="$work/flwr-home"
mkdir -p "$FLWR_HOME"
# Flower's managed local SuperLink listens on fixed ports (39091, 39093) whatever FLWR_HOME says, so a SuperLink
# already running there (this user's, or another run's) would take the run, and run it without RAY_ADDRESS. Ours
# gets free ports of its own (Flower reads them from these variables).
read -r FLWR_LOCAL_SUPERLINK_HTTP_API_PORT FLWR_LOCAL_CONTROL_API_PORT < <("$PY" -c '
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')
export FLWR_LOCAL_SUPERLINK_HTTP_API_PORT FLWR_LOCAL_CONTROL_API_PORT
node_pids=()

cleanup() {
  "$PY" -m fedrec_flwr.flower.local_superlink >/dev/null 2>&1 || true  # the SuperLink of this run's Flower home only
  local pid
  for pid in "${node_pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${node_pids[@]}"; do  # a node that outlives 30 s of SIGTERM is killed (its reaper ends the rest)
    for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  if [ "$keep_work" = 0 ]; then rm -rf "$work"; fi
}
trap cleanup EXIT
trap 'exit 143' TERM
trap 'exit 130' INT

# The cluster's live nodes and CPUs, as "NODES CPUS".
cluster_size() {
  "$PY" - "$1" <<'EOF'
import sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR")
alive = [n for n in ray.nodes() if n["Alive"]]
print(len(alive), int(sum(n["Resources"].get("CPU", 0) for n in alive)))
ray.shutdown()
EOF
}

if [ "${1:-}" = "--local-cluster" ]; then
  shift
  port="${RAY_PORT:-6390}"
  cpus="${RAY_NODE_CPUS:-1}"
  address="127.0.0.1:$port"
  mkdir -p "$work/ray"
  export FEDREC_CLIENT_LOG_LEVEL="${FEDREC_CLIENT_LOG_LEVEL:-INFO}"  # each ClientApp logs its Ray node there
  "$RAY" start --head --block --node-ip-address=127.0.0.1 --port="$port" --num-cpus="$cpus" \
    --temp-dir="$work/ray" --include-dashboard=false --disable-usage-stats >"$work/ray-head.log" 2>&1 &
  node_pids+=($!)
  for _ in $(seq 120); do  # the head writes its address once it serves
    [ -s "$work/ray/ray_current_cluster" ] && break
    kill -0 "${node_pids[0]}" 2>/dev/null || { echo "ray_cluster_run.sh: the Ray head did not start: $work/ray-head.log" >&2; tail -5 "$work/ray-head.log" >&2; exit 1; }
    sleep 1
  done
  "$RAY" start --block --node-ip-address=127.0.0.1 --address="$address" --num-cpus="$cpus" \
    --disable-usage-stats >"$work/ray-worker.log" 2>&1 &
  node_pids+=($!)
  for _ in $(seq 120); do
    [ "$(cluster_size "$address" | cut -d' ' -f1)" = 2 ] && break
    kill -0 "${node_pids[1]}" 2>/dev/null || { echo "ray_cluster_run.sh: the second Ray node did not start: $work/ray-worker.log" >&2; tail -5 "$work/ray-worker.log" >&2; exit 1; }
    sleep 1
  done
  export RAY_ADDRESS="$address"
fi
if [ -z "${RAY_ADDRESS:-}" ]; then
  echo "ray_cluster_run.sh: set RAY_ADDRESS=HOST:PORT of a running cluster, or pass --local-cluster" >&2
  exit 2
fi
size=$(cluster_size "$RAY_ADDRESS")
echo "ray_cluster_run.sh: cluster at $RAY_ADDRESS: ${size% *} nodes, ${size#* } CPUs"
export FEDREC_CLUSTER_CPUS="${size#* }"  # fedrec run's default sizing: one SuperNode per CPU of the cluster
"$PY" -m fedrec_flwr.cli.commands run "$@"
