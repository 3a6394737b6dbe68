#!/usr/bin/env bash
# Run one simulation on a multi-node Ray cluster through Flower's simulation runtime.
#
#   deploy/ray_cluster_run.sh --local-cluster [fedrec run arguments]   # head + a second node on loopback
#   RAY_ADDRESS=HOST:PORT deploy/ray_cluster_run.sh [fedrec run arguments]   # a cluster you started
#
# Flower's Ray backend calls ray.init() without an address, and Ray then joins the cluster named by
# RAY_ADDRESS. `flwr run . local` hands the run to a background SuperLink that keeps the environment
# it was started with, so this script stops this user's local SuperLink first and again at the end
# (the next plain run then starts a fresh one on this machine's own Ray). With --local-cluster it
# starts a head node and a second node on loopback (RAY_NODE_CPUS each, default 1) and stops both at
# the end. The ClientApp actors are spread over every node's CPUs (simulation.num_cpus per actor).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
RAY=.venv/bin/ray
export PATH="$PWD/.venv/bin:$PATH"

started_cluster=0
cleanup() {
  "$PY" -m fedrec_flwr.local_superlink 2>/dev/null || true  # this user's local SuperLink only, by process id
  if [ "$started_cluster" = 1 ]; then "$RAY" stop --force >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT

if [ "${1:-}" = "--local-cluster" ]; then
  shift
  port="${RAY_PORT:-6390}"
  cpus="${RAY_NODE_CPUS:-1}"
  started_cluster=1
  "$RAY" start --head --port="$port" --num-cpus="$cpus" --include-dashboard=false --disable-usage-stats >/dev/null
  "$RAY" start --address="127.0.0.1:$port" --num-cpus="$cpus" --disable-usage-stats >/dev/null
  export RAY_ADDRESS="127.0.0.1:$port"
fi
if [ -z "${RAY_ADDRESS:-}" ]; then
  echo "ray_cluster_run.sh: set RAY_ADDRESS=HOST:PORT of a running cluster, or pass --local-cluster" >&2
  exit 2
fi
nodes=$("$PY" - <<'EOF'
import os, ray
ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR")
alive = [n for n in ray.nodes() if n["Alive"]]
print(len(alive), int(sum(n["Resources"].get("CPU", 0) for n in alive)))
ray.shutdown()
EOF
)
echo "ray_cluster_run.sh: cluster at $RAY_ADDRESS: $nodes (nodes, CPUs)"
export FEDREC_CLUSTER_CPUS="${nodes#* }"  # fedrec run's default sizing: one SuperNode per CPU of the cluster
"$PY" -m fedrec_flwr.local_superlink || true  # our local SuperLink started before would ignore RAY_ADDRESS
"$PY" -m fedrec_flwr.cli run "$@"
