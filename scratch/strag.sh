set -e
python3 -m pip install -q --no-index --find-links .wheelhouse pyzmq optuna mnist1d 2>&1 | tail -2
python3 -m pip install -q --no-build-isolation --no-deps . 2>&1 | tail -2
nproc
cd benchmarks
i=0
for args in "$@"; do
  i=$((i+1))
  CUDA_VISIBLE_DEVICES= timeout ${LIMIT:-480} python3 straggler_bench.py $args --out $OUT/straggler-$i.md > $OUT/log-$i.txt 2>&1 || echo "invocation $i failed: $?"
  grep -v "^  " $OUT/log-$i.txt | tail -30
done
