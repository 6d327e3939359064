"""Benchmarks of mpi_kvstore against raw MPI, MXNet's dist_sync (and its P3 van) and Horovod.

Each script runs as a module from the repository root, under mpiexec where it is an MPI
program (``--help`` gives its options; results go to benchmarks/results/):

    mpiexec -n 2 python -m benchmarks.allreduce --quick

Scripts:
    allreduce         kv.pushpull over a size sweep and 100 small keys (fusion): every design
                      against raw MPI, the engine floor and dist_sync
    scaling           training steps on synthetic data (resnet20, resnet18_v1, resnet50_v1):
                      every design, DistributedTrainer, Horovod and dist_sync against no exchange
    cost_model        an alpha-beta model of a training step, calibrated and checked on
                      grid --scaling's results; ResNet-50 on ImageNet at scale (no mpiexec)
    small             per-call latency and a burst of small tensors: kv.pushpull and
                      mpi_kvstore.horovod against raw MPI (and horovod.mxnet where it imports)
    gpu_bandwidth     GPU transports on CuPy arrays (needs CuPy and a GPU)
    gpu_like          a GPU-like workload: a model zoo net whose layers sleep on the engine
    overlap           gpu_like's model trained by every peer (FIFO, priority, gluon, dist_sync
                      or P3, Horovod) in one job: step, exchange alone, and how much hides
    grid              overlap (or --scaling: scaling) over test hosts, a test bed a cell of
                      (hosts, rate, model, wire); Horovod and P3 in jobs of their own (root)

What they share:
    harness           arguments, timing (repeated and interleaved), checks, stores, JSON
                      with versions and configuration, CPU and RSS (psutil), deadlines
    report            tables (tabulate) and plots (matplotlib)
    schema            what a result file under results/ holds, and its check
    peers             raw MPI, the engine floor, ps-lite's dist_sync and P3, Horovod

tests/test_benchmarks.py runs every script briefly, so that none rots unnoticed.
"""
