#!/bin/bash
# Three more pairs of the compiled wait (and Horovod in its own job), without and with a 30% GIL
# load, alternating which comes first: rounds 4-6 beside gil_ab.sh's 1-3.
export PATH=/work/main/.venv/bin:$PATH OMP_NUM_THREADS=1
OUT=/tmp/lead41/benchmarks/results/gil_wait
cd /tmp/lead41
for r in 4 5 6; do
  loads="0 0.3"; [ $r = 5 ] && loads="0.3 0"
  for load in $loads; do
    name=compiled-load$load-r$r
    echo "$(date -u +%T) $name ($(git rev-parse --short HEAD))" >> $OUT/sequence.txt
    extra=""; [ $load != 0 ] && extra="--host-load $load"
    timeout 1200 python -m benchmarks.overlap_grid --hosts 2 --rates 3gbit --models resnet50_v1 --wires none \
      --columns priority --no-p3 --horovod-python /work/hvd-venv/bin/python \
      --overlap-args "--images-per-s 125 --batch 32 --warmups 1 --rounds 5 --chain 3 --optimizer gpulikesgd $extra" \
      --out $OUT/$name > $OUT/$name.log 2>&1
    echo "$(date -u +%T) $name rc=$?" >> $OUT/sequence.txt
  done
done
echo done >> $OUT/sequence.txt
