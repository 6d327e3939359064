#!/bin/bash
export PATH=/work/main/.venv/bin:$PATH OMP_NUM_THREADS=1
OUT=/tmp/lead40/benchmarks/results/gil_wait
cd /tmp/lead40
for r in 1 2; do for load in 0.3 0; do
  name=sleeps-vs-blocking-load$load-r$r
  echo "$(date -u +%T) $name ($(git rev-parse --short HEAD))" >> $OUT/sequence.txt
  extra=""; [ $load != 0 ] && extra="--host-load $load"
  timeout 1200 python -m benchmarks.overlap_grid --hosts 2 --rates 3gbit --models resnet50_v1 --wires none \
    --columns priority,best --best-options progress_sleep_us=0 --no-p3 \
    --overlap-args "--images-per-s 125 --batch 32 --warmups 1 --rounds 5 --chain 3 --optimizer gpulikesgd $extra" \
    --out $OUT/$name > $OUT/$name.log 2>&1
  echo "$(date -u +%T) $name rc=$?" >> $OUT/sequence.txt
done; done
echo done2 >> $OUT/sequence.txt
