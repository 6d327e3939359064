#!/bin/bash
export PATH=/work/main/.venv/bin:$PATH OMP_NUM_THREADS=1
OUT=/tmp/lead40/benchmarks/results/gil_wait/switch_interval
mkdir -p $OUT; cd /tmp/lead40
for r in 1 2; do for swi in 0.005 0.0005; do
  echo "$(date -u +%T) swi=$swi r$r" >> $OUT/sequence.txt
  timeout 600 python -m testbed run --hosts 2 --rate 3gbit -n 2 --timeout 500 -- python /tmp/swi.py $swi --model resnet50_v1 --columns priority --topology "2 hosts x 1 rank, 3gbit" --out $OUT/swi$swi-r$r --images-per-s 125 --batch 32 --warmups 1 --rounds 5 --chain 3 --optimizer gpulikesgd --host-load 0.3 > $OUT/swi$swi-r$r.log 2>&1
  echo "rc=$?" >> $OUT/sequence.txt
done; done
