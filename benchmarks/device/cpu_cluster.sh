#!/usr/bin/env bash
# The fused steps and the training comparison on a machine with a core per rank (the device
# machine: 16 cores, root, no network of its own, its own python3 with torch). On a 2-core
# machine 4 ranks share 2 cores, and a fused step's overlap is bounded by the cores, not by the
# schedule (docs/benchmarking.md, "The CPU floor"; the bounds of docs/fused.md); this measures
# the same commands where each rank has cores of its own, each with its A/A control:
#
#   1. the MoE layer's training step, fused against unfused, with its bounds;
#   2. the DLRM-style step at 10 ids per bag (DLRM's default), likewise;
#   3. the embedding exchange by table at 64 ids per bag;
#   4. torch DDP, torch's PowerSGD hook and commfuse's PowerSGD at 100 Mbit/s.
#
# Usage, from the repository root: benchmarks/device/cpu_cluster.sh OUTDIR [quick]
# At most about 9.5 minutes (each command is stopped at its own limit and the next one runs);
# "quick" runs fewer rounds. On a 2-core machine the last command does not finish in its limit. Every result goes to OUTDIR, one JSON per
# command, for `commfuse report`; the log of each beside it.
set -uo pipefail
out=${1:?usage: $0 OUTDIR [quick]}
rounds=5
[[ ${2:-} == quick ]] && rounds=2
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
# The command line of this checkout (no install there): an array, so that timeout can run it.
commfuse=("$py" -c 'import sys; from commfuse.cli import main; sys.exit(main())')

{
  date -u; nproc; uname -r; "$py" -c 'import torch; print("torch", torch.__version__)'
  id -u; command -v ip tc || true
} 2>&1 | tee "$out/machine.txt"

# The emulated cluster needs root, ip and tc; without them the link rates are not shaped and
# nothing here means anything, so say so and stop.
if ! "${commfuse[@]}" net check --hosts 2 --link 1gbit 2>&1 | tee "$out/net-check.txt"; then
  echo "no emulated cluster here (see net-check.txt): nothing measured" | tee -a "$out/machine.txt"
  exit 3
fi

# run NAME LIMIT_S ARGS...: one command, its log in OUTDIR/NAME.log, its JSON in NAME.json.
run() {
  local name=$1 limit=$2
  shift 2
  echo "== $name: commfuse $*" | tee "$out/$name.log"
  timeout "$limit" "${commfuse[@]}" "$@" --json "$out/$name.json" 2>&1 | grep -v socket.cpp \
    | tee -a "$out/$name.log" | tail -8
}

fused=(bench fused --hosts 4 --link 1gbit --control --repeats "$rounds")
run moe-step 150 "${fused[@]}" --op moe_step
run dlrm-10ids 150 "${fused[@]}" --step dlrm --shape 4096x32x20000x64x10
run embedding-64ids 90 "${fused[@]}" --op embedding_all_to_all \
  --shape 4096x32x20000x64x64 --schedule by_table
run compare-100mbit 180 compare --hosts 4 --link 100mbit --steps 30 --max-steps-factor 2 \
  --repeats "$((rounds > 2 ? 2 : 1))" --no-progress --control \
  --strategy ddp --strategy ddp-powersgd:rank=4,warmup=2 \
  --strategy powersgd:rank=8,warmup=2,warmup_rank=32,wire=bf16
