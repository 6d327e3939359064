"""How fast will training be with mpi_kvstore, against Horovod, MXNet's dist_sync and P3, and raw MPI?

One script per question, each a module run from the repository root, under mpiexec where it
is an MPI program (``--help`` gives its options; runs write to benchmarks/results/runs/):

    mpiexec -n 2 python -m benchmarks.allreduce --quick

Scripts:
    scaling           images/s and efficiency of CIFAR and ImageNet models (resnet20,
                      resnet18_v1, resnet50_v1) with every peer against no exchange
    overlap           gpu_like's model trained by every peer side by side in one job: step,
                      exchange alone, and how much of it hides
    grid              overlap (or --scaling: scaling) over test hosts, a test bed a cell of
                      (hosts, rate, model, wire); Horovod and P3 in jobs of their own (root)
    allreduce         kv.pushpull over a size sweep and many small keys (fusion): every
                      design against raw MPI, the engine floor and dist_sync
    small             per-call latency and a burst of small tensors: kv.pushpull and
                      mpi_kvstore.horovod against raw MPI (and horovod.mxnet where it imports)
    gpu_bandwidth     GPU transports on CuPy arrays (needs CuPy and a GPU)
    cost_model        an alpha-beta model of a training step: ResNet-50 on ImageNet at scale,
                      with the overlap learned on the committed overlap table (no mpiexec)

What they share:
    harness           arguments, timing with CPU, interleaved rounds, trainers, stores, records
    report            tables, the one median (min-max) format, documented tables, the plot
    schema            what a result file holds, and its check
    peers             raw MPI, the engine floor, ps-lite's dist_sync and P3, Horovod
    gpu_like          the GPU-like model overlap trains: layers that sleep on the engine

tests/test_benchmarks.py runs every script briefly, so that none rots unnoticed.
"""
