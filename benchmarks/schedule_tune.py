"""Autotune the schedule for this job's topology: partition_bytes and credit_bytes, measured
on a GPU-like workload, written where the store finds them (a tune table's schedule entry).

    python -m testbed run --hosts 2 --rate 3gbit -n 2 --timeout 1200 -- \\
        python -m benchmarks.schedule_tune [--model resnet50_v1] [--images-per-s 125] \\
        [--batch 32] [--partitions 1M,4M,16M] [--credits 4M,8M,32M] [--trials 3] [--chain 3] \\
        [--table tune.json] [--out DIR]

Candidates: every (partition_bytes, credit_bytes) of the two lists, plus FIFO (0, 0), each a
DistributedTrainer on a funneled store with those options (progress_sleep_us as the store
decides it). All stores and trainers are created first and kept; each round runs every
candidate once, in rotating order (harness.interleaved), one run being --chain training steps
of benchmarks/gpu_like.py's model with one waitall at the end. The candidate with the lowest
median step wins. Every candidate trains the same parameters, so the weights after all runs
are checked against numpy (gpu_like's check): a schedule that sums wrong is never timed as
fast.

Rank 0 writes the winner into --table: into the ``schedule`` entry of the tune table there
(python -m mpi_kvstore tune writes its allreduce rows), or into a new table whose allreduce
rows leave every size to MPI. A store created with ``tune_table=`` that file (or
MPI_KVSTORE_TUNE_TABLE) then takes these values for the options left 'auto'
(mpi_kvstore/topology.py). The table is for this topology: a job on other hosts, another
rate or another rank count should tune its own.
"""
import argparse
import itertools
import json
import os
import time

import mxnet as mx

from benchmarks import gpu_like, harness

STEPS = {'warmups': 1, 'trials': 3}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    gpu_like.add_workload_args(parser)
    parser.add_argument('--partitions', default='1M,4M,16M',
                        help='partition_bytes candidates (default 1M,4M,16M)')
    parser.add_argument('--credits', default='4M,8M,32M',
                        help='credit_bytes candidates (default 4M,8M,32M)')
    parser.add_argument('--table', default='',
                        help='tune table to write the winner into (created if missing); '
                             'default: none, only the JSON result')
    harness.add_common_args(parser, sizes=False, quick=False, full=STEPS, timeout=1800.0)
    return harness.resolve_quick(parser.parse_args(argv), STEPS)


def candidates(args):
    """[(partition_bytes, credit_bytes)]: FIFO first, then every pair of the lists."""
    parts = [harness.parse_size(t) for t in args.partitions.split(',') if t]
    credits = [harness.parse_size(t) for t in args.credits.split(',') if t]
    return [(0, 0)] + list(itertools.product(parts, credits))


def label(pair):
    part, credit = pair
    return 'fifo' if pair == (0, 0) else (f'partition {harness.format_size(part)}, '
                                          f'credit {harness.format_size(credit)}')


def write_table(path, pair, comm_size, measured):
    """The winner into path's schedule entry (rank 0 only)."""
    from mpi_kvstore import tuning
    if os.path.exists(path):
        with open(path) as fh:
            table = tuning.Table.from_json(json.load(fh))
    else:
        table = tuning.Table([0], ['mpi'], comm_size)
    table.schedule = {'partition_bytes': pair[0], 'credit_bytes': pair[1]}
    with open(path, 'w') as fh:
        json.dump(table.to_json(measured), fh, indent=1)


def main(argv=None):
    import mpi_kvstore
    args = parse_args(argv)
    comm = harness.world()
    plan_ = gpu_like.plan(args.model, args.images_per_s, args.batch)
    model = gpu_like.GPULikeModel(plan_)
    model.initialize()
    run = harness.Run('schedule_tune', args, comm=comm, label=args.model)
    pairs = candidates(args)
    harness.rank0_print(f'{args.model}: {plan_.grad_bytes / 1e6:.1f} MB of gradients, '
                        f'{plan_.compute_s * 1e3:.1f} ms of compute a step; {comm.size} ranks; '
                        f'{len(pairs)} candidates, {args.trials} interleaved rounds of '
                        f'{args.chain} steps')
    with harness.deadline(args.timeout, 'schedule_tune'):
        trainers = {}
        for pair in pairs:
            kv = mpi_kvstore.create('dist_mpi', partition_bytes=pair[0], credit_bytes=pair[1])
            trainers[label(pair)] = mpi_kvstore.DistributedTrainer(
                model.collect_params(), args.optimizer, {'learning_rate': args.lr}, store=kv)
        steps = itertools.count()

        def train(trainer):
            def op():
                for _ in range(args.chain):
                    model(gpu_like.step_scale(next(steps), comm.rank))
                    model.backward()
                    trainer.step(args.batch * comm.size)
                mx.nd.waitall()
            return op

        def time_one(name, op):
            mx.nd.waitall()
            comm.Barrier()      # no collective of any store in flight
            start = time.perf_counter()
            op()
            return comm.allreduce(time.perf_counter() - start, op=_mpi_max()) / args.chain

        walls = harness.interleaved({name: train(t) for name, t in trainers.items()},
                                    args.trials, args.warmups, time_one=time_one)
        gpu_like._check_trained(model, args, next(steps), comm.size)
    medians = {name: harness.spread(v)['median'] for name, v in walls.items()}
    best = min(pairs, key=lambda p: medians[label(p)])
    for pair in pairs:
        ms = {k: v * 1e3 for k, v in harness.spread(walls[label(pair)]).items()}
        harness.rank0_print(f'  {label(pair):32s} step {ms["median"]:7.1f} ms (min '
                            f'{ms["min"]:.1f}, max {ms["max"]:.1f})'
                            + ('   <- best' if pair == best else ''))
    if args.table and comm.rank == 0:
        write_table(args.table, best, comm.size,
                    {label(p): medians[label(p)] * 1e3 for p in pairs})
        print(f'  schedule written to {args.table}: partition_bytes={best[0]}, '
              f'credit_bytes={best[1]}', flush=True)
    run.write({'model': args.model, 'compute_s': plan_.compute_s,
               'grad_bytes': plan_.grad_bytes,
               'candidates': [{'partition_bytes': p, 'credit_bytes': c,
                               'wall_s': walls[label((p, c))]} for p, c in pairs],
               'best': {'partition_bytes': best[0], 'credit_bytes': best[1]}},
              interleaved=True)


def _mpi_max():
    from mpi4py import MPI
    return MPI.MAX


if __name__ == '__main__':
    main()
