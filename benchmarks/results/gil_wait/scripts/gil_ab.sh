#!/bin/bash
# A/B: the Python wait (3679014, /tmp/old40) against the compiled wait (lead40), with and without a 30% GIL load.
export PATH=/work/main/.venv/bin:$PATH OMP_NUM_THREADS=1
OUT=/tmp/lead40/benchmarks/results/gil_wait
for r in 1 2; do
  for load in 0 0.3; do
    for tree in old40 lead40; do
      [ $r = 2 ] && { [ $tree = old40 ] && tree=lead40 || tree=old40; }   # order flips in round 2
      name=$( [ $tree = old40 ] && echo python || echo compiled )-load$load-r$r
      cd /tmp/$tree && echo "$(date -u +%T) $name ($(git rev-parse --short HEAD))" >> $OUT/sequence.txt
      extra=""; [ $load != 0 ] && extra="--host-load $load"
      timeout 1200 python -m benchmarks.overlap_grid --hosts 2 --rates 3gbit --models resnet50_v1 --wires none \
        --columns priority --no-p3 --horovod-python /work/hvd-venv/bin/python \
        --overlap-args "--images-per-s 125 --batch 32 --warmups 1 --rounds 5 --chain 3 --optimizer gpulikesgd $extra" \
        --out $OUT/$name > $OUT/$name.log 2>&1
      echo "$(date -u +%T) $name rc=$?" >> $OUT/sequence.txt
    done
  done
done
echo done >> $OUT/sequence.txt
