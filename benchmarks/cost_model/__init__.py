"""An alpha-beta model of a data-parallel training step, calibrated on the test bed.

model (the formulas), fit (calibration, validation and the learned overlap), report (tables
and the plot); ``python -m benchmarks.cost_model`` (__main__) runs them.

    python -m benchmarks.cost_model                  # seconds: fit, check and predict from the
                                                     # json of benchmarks/testbed_scaling.py
    python -m benchmarks.cost_model --measured FILE [--calibration FILE,...] [--out DIR]
    python -m benchmarks.cost_model --predict-only [--gpus 256 --gpu-images-per-s 125 ...]
    python -m benchmarks.cost_model --overlap A.json,B.json,... [--fit-on A]
                                                     # h per schedule learned on GPU-like runs
                                                     # of benchmarks/overlap.py (see below)

The model (times in seconds, sizes in bytes)
--------------------------------------------
Network. p ranks on H hosts, k = p/H a host, placed in blocks (ranks 0..k-1 on the first
host, as `mpiexec -ppn k` does). MPICH's allreduce of n bytes (power-of-two p) is a
reduce-scatter by recursive halving then an allgather by recursive doubling: in each phase,
step j (j = 1..log2 p) exchanges n/2^j bytes with the rank p/2^j away. The first log2 H steps
cross hosts, and all k ranks of a host send at once over its one link; the last log2 k steps
stay inside a host (shared memory). So, with a (alpha) the latency of one step and b (beta)
the time per byte a way, reduction included:

    T_flat(n) = 2 log2(H) a_net + 2 k n (1 - 1/H) b_net + 2 log2(k) a_shm + 2 n (1/H - 1/p) b_shm

(p = 2, k = 1: 2 a_net + n b_net). Hierarchical, as the store's `hierarchical` option does it
(reduce-scatter inside each host, each rank's piece of n/k allreduced across hosts, the k
pieces of a host at once, allgather inside each host), carries k times fewer bytes over each
link:

    T_hier(n) = 2 [log2(k) a_shm + n (k-1)/k b_shm] + 2 log2(H) a_net + 2 n (1 - 1/H) b_net

Store. The gradients (sizes s_i in the Trainer's order) travel as collectives. With fusion,
neighbouring arrays of at most `threshold` bytes share one collective of at most `threshold`
bytes and bigger ones travel alone (mpi_kvstore.comm.fusion.plan, the store's own planner); without, one collective
per array. funneled and concurrent fuse whatever is pending when they negotiate (gluon.Trainer's
per-parameter calls too); chained and blocking run each call on its own, so they fuse only
inside one grouped call (DistributedTrainer). On top of MPI the store costs sigma once per
exchange, kappa per array and c per collective (the agreement: one small allreduce), plus,
for GPU arrays without a CUDA-aware MPI, a copy to the host and back:

    T_x = sigma + sum over collectives of (c + T_allreduce(bytes) + 2 bytes stage) + kappa arrays

Step. Compute T_c (forward, backward, update) splits into forward (fwd_share) and backward;
backward makes the gradients in reverse order, one array after another at an even pace. A
collective starts once its arrays exist and the previous one has finished (one
communication thread). The overlap fraction h in [0, 1] is how much of backward
communication can run beside: a gradient made at time t counts as ready at
t + (1 - h)(end of backward - t). h = 0: everything starts after backward, T_step = T_c + T_x;
h = 1: wait-free backpropagation. In general T_step = max(T_c, end of the last collective).

The test bed (h = 0: all hosts share the machine's 2 cores and as many ranks as cores
compute, so no core is free to move data beside them; measured 'hidden' is near 0):
- T_allreduce on each test bed (rate, ranks, ranks a host) is a line a + b n fitted to raw
  MPI Allreduce(IN_PLACE) timed on that test bed: a from the sizes <= 64 KB, b the median
  per-byte time of the sizes >= 4 MB (tbf lets a 2 ms burst through at full speed, so 1 MB
  runs faster than the link; an exchange's back-to-back collectives see the sustained rate).
  scaling.py times them inside the training job's exchange-alone rounds (testbed_scaling.py
  passes --raw-allreduce), so under the load the exchanges saw.
  a_net, b_net per rate follow from the 2-rank line (a = 2 a_net); the 4-rank lines check
  the flat and hierarchical formulas (the "topology" table);
- sigma: each config's exchange alone on 1 rank, where no byte crosses a network (the same
  arrays, calls and fusion), scaled by ranks / cores where ranks outnumber the cores (it is
  CPU time); kappa = 0 (inside sigma); c = the line at 8 bytes;
- T_c: each job's measured step of `none` (the same ranks, exchanging nothing).
The multi-rank training measurements are the check: nothing is fitted to them.

At scale: ResNet-50 (model-zoo resnet50_v1, 1000 classes: 102 MB of float32 gradients in 193
arrays, its bottleneck convolutions having biases) on ImageNet-1k (1,281,167 training
images), with stated assumptions for GPU speed, cluster and network (--help, and the
printed list); an epoch is its steps x T_step, I/O ignored.
"""
