#!/usr/bin/env bash
# Paired measurements of a base commit against this tree, run from the project root:
#   BASE=/tmp/base PY=.peers-venv/bin/python stress/bench_against_base.sh OUTDIR
# trace mode at 83,576 and 222,868 blocks (base, new with the peers, base, new), the full-trace
# replay (base, new, base, new) and the peer harness; the base needs ../shared beside it (a symlink).
set -u
out=${1:-/tmp/b14}; mkdir -p "$out"
export OMP_NUM_THREADS=1
PY=${PY:-.peers-venv/bin/python}
PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")  # absolute, links kept: a venv's python is a link to its base one
BASE=${BASE:?set BASE to a worktree of the base commit, e.g. git worktree add /tmp/base 0a4c218}
T=$(realpath ../shared/traces/mooncake_conversation.jsonl)
ROOT=$(pwd)
echo "main at $(git rev-parse --short HEAD), base $(git -C $BASE rev-parse --short HEAD); start $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" | tee "$out/log.txt"
for size in 83576 222868; do
  (cd $BASE && PYTHONPATH=$BASE $PY stress/peer_trace.py run --trace conversation --limit 2000 --size $size --managers akv:slru --out "$out/pt_base_$size.json" > "$out/pt_base_$size.txt" 2>&1)
  PYTHONPATH=$ROOT $PY stress/peer_trace.py run --trace conversation --limit 2000 --size $size --managers akv:slru,sglang,vllm --out "$out/pt_new_$size.json" > "$out/pt_new_$size.txt" 2>&1
  (cd $BASE && PYTHONPATH=$BASE $PY stress/peer_trace.py run --trace conversation --limit 2000 --size $size --managers akv:slru --out "$out/pt_base2_$size.json" > "$out/pt_base2_$size.txt" 2>&1)
  PYTHONPATH=$ROOT $PY stress/peer_trace.py run --trace conversation --limit 2000 --size $size --managers akv:slru --out "$out/pt_new2_$size.json" > "$out/pt_new2_$size.txt" 2>&1
  echo "trace $size done $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)" | tee -a "$out/log.txt"
done
for i in 1 2; do
  (cd $BASE && PYTHONPATH=$BASE python3 stress/bench_replay.py --trace $T --json "$out/replay_base_$i.json" > "$out/replay_base_$i.txt" 2>&1)
  PYTHONPATH=$ROOT python3 stress/bench_replay.py --trace $T --json "$out/replay_new_$i.json" > "$out/replay_new_$i.txt" 2>&1
  echo "replay $i done $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)" | tee -a "$out/log.txt"
done
PYTHONPATH=$ROOT $PY stress/bench_peers.py --size large --rounds 3 --json "$out/bench_peers.json" > "$out/bench_peers.txt" 2>&1
echo "peers done $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)" | tee -a "$out/log.txt"
