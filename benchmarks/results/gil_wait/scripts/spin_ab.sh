#!/bin/bash
export PATH=/work/main/.venv/bin:$PATH OMP_NUM_THREADS=1
OUT=/tmp/spin_results; mkdir -p $OUT
for r in 1 2 3; do
  trees="old40 lead40 spin40"; [ $r = 2 ] && trees="spin40 old40 lead40"; [ $r = 3 ] && trees="lead40 spin40 old40"
  for tree in $trees; do
    cd /tmp/$tree; name=$tree-r$r
    echo "$(date -u +%T) $name $(git rev-parse --short HEAD)" >> $OUT/sequence.txt
    timeout 900 python -m benchmarks.overlap_grid --hosts 2 --rates 3gbit --models resnet50_v1 --wires none \
      --columns priority --no-p3 --out $OUT/$name > $OUT/$name.log 2>&1
    echo "rc=$?" >> $OUT/sequence.txt
  done
done
echo done >> $OUT/sequence.txt
