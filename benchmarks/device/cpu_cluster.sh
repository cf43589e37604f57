# The training and fused-operator comparisons on a machine with a core per rank (16 cores, no
# network of its own, its own python3 with torch). On a 2-core machine 4 ranks share 2 cores and
# every compressed or fused step is CPU-bound (docs/benchmarking.md, "The CPU floor"); this
# measures the same commands where they are not.
#
# Usage, from the repository root: benchmarks/device/cpu_cluster.sh OUTDIR [quick]
# About 8 minutes in all; "quick" runs one round of each (about 4). Every result goes to OUTDIR.
set -uo pipefail
out=${1:?usage: $0 OUTDIR [quick]}
rounds=3
[[ ${2:-} == quick ]] && rounds=1
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
commfuse() { "$py" -c 'import sys; from commfuse.cli import main; sys.exit(main())' "$@"; }

{
  date -u; nproc; uname -r; "$py" -c 'import torch; print("torch", torch.__version__)'
  id -u; command -v ip tc || true
} 2>&1 | tee "$out/machine.txt"

# The emulated cluster needs root, ip and tc; without them the link rates are not shaped and
# the 100 Mbit/s comparison means nothing, so say so and stop.
if ! commfuse net check --hosts 2 --link 1gbit 2>&1 | tee "$out/net-check.txt"; then
  echo "no emulated cluster here (see net-check.txt): nothing measured" | tee -a "$out/machine.txt"
  exit 3
fi

timeout 420 commfuse compare --hosts 4 --link 100mbit --steps 30 --max-steps-factor 2 \
  --repeats "$rounds" --no-progress \
  --strategy ddp --strategy ddp-powersgd:rank=4,warmup=2 \
  --strategy powersgd:rank=8,warmup=2,warmup_rank=32,wire=bf16 \
  --strategy powersgd:rank=8,warmup=1,warmup_rank=32,wire=bf16 \
  --json "$out/compare-100mbit.json" --markdown "$out/compare-100mbit.md" \
  --plot "$out/compare-100mbit.png" 2>&1 | grep -v socket.cpp | tail -20

timeout 240 commfuse bench fused --hosts 4 --link 1gbit \
  --json "$out/fused-4x1.json" --markdown "$out/fused-4x1.md" 2>&1 | grep -v socket.cpp | tail -25
