"""Autotune the schedule for this job's topology: partition_bytes and credit_bytes, measured
on a GPU-like workload, written where the store finds them (a tune table's schedule entry).

    python -m testbed run --hosts 2 --rate 3gbit -n 2 --timeout 1200 -- \\
        python -m benchmarks.schedule_tune [--partitions 1M,4M,16M] [--credits 4M,8M,32M] \\
        [--table tune.json]

Candidates: every (partition_bytes, credit_bytes) of the two lists, plus FIFO (0, 0), each a
DistributedTrainer on a funneled store with those options (progress_sleep_us as the store
decides it). All stores and trainers are created first and kept; each round runs every
candidate once, in rotating order, one run being --chain training steps of
benchmarks/gpu_like.py's model with one waitall at the end, as benchmarks/overlap.py times
its columns (overlap.rounds, overlap.train_run): the weights are reset before each run and
checked against numpy after it, with every element of the summed gradients, so a schedule
that sums wrong is never timed as fast. The candidate with the lowest median step wins.

Rank 0 writes the winner into --table: into the ``schedule`` entry of the tune table there
(python -m mpi_kvstore tune writes its allreduce rows), or into a new table whose allreduce
rows leave every size to MPI. A store created with ``tune_table=`` that file (or
MPI_KVSTORE_TUNE_TABLE) then takes these values for the options left 'auto'
(mpi_kvstore/comm/topology.py). The table is for this topology: a job on other hosts, another
rate or another rank count should tune its own.
"""
import functools
import itertools
import json
import os

from benchmarks import gpu_like, harness, overlap

STEPS = {'warmups': 1, 'trials': 3}


def parse_args(argv=None):
    parser = harness.parser(__doc__)
    gpu_like.add_workload_args(parser)
    parser.add_argument('--partitions', default='1M,4M,16M', help='partition_bytes candidates')
    parser.add_argument('--credits', default='4M,8M,32M', help='credit_bytes candidates')
    parser.add_argument('--table', default='', help='tune table to write the winner into '
                                                    '(created if missing)')
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
    from mpi_kvstore.comm import tuning
    if os.path.exists(path):
        with open(path) as fh:
            table = tuning.Table.from_json(json.load(fh))
    else:
        table = tuning.Table([0], ['mpi'], comm_size)
    table.schedule = {'partition_bytes': pair[0], 'credit_bytes': pair[1]}
    with open(path, 'w') as fh:
        json.dump(table.to_json(measured), fh, indent=1)


def main(argv=None):
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
        # overlap.py's runs: weights reset, --chain steps, one waitall, weights and summed
        # gradients checked against numpy; a candidate that sums wrong is not timed again
        columns = [overlap.mpi_column(args, model, label(pair), 'funneled+partition_bytes=%d'
                                      '+credit_bytes=%d' % pair, 'distributed')
                   for pair in pairs]
        walls = overlap.rounds(args, {c.name: functools.partial(overlap.train_run, args, model,
                                                                c, comm) for c in columns})
        failed = {c.name: c.failed for c in columns if c.failed}
        overlap.close(columns)
    timed = [pair for pair in pairs if label(pair) not in failed]
    if not timed:
        raise SystemExit(f'every candidate failed its weight check: {failed}')
    medians = {label(p): harness.spread(walls[label(p)])['median'] for p in timed}
    best = min(timed, key=lambda p: medians[label(p)])
    for pair in pairs:
        if label(pair) in failed:
            harness.rank0_print(f'  {label(pair):32s} failed: {failed[label(pair)]}')
            continue
        ms = {k: v * 1e3 for k, v in harness.spread(walls[label(pair)]).items()}
        harness.rank0_print(f'  {label(pair):32s} step {ms["median"]:7.1f} ms (min '
                            f'{ms["min"]:.1f}, max {ms["max"]:.1f})'
                            + ('   <- best' if pair == best else ''))
    if args.table and comm.rank == 0:
        write_table(args.table, best, comm.size, {label(p): medians[label(p)] * 1e3 for p in timed})
        print(f'  schedule written to {args.table}: partition_bytes={best[0]}, '
              f'credit_bytes={best[1]}', flush=True)
    run.write({'model': args.model, 'compute_s': plan_.compute_s,
               'grad_bytes': plan_.grad_bytes,
               'candidates': [{'partition_bytes': p, 'credit_bytes': c,
                               'wall_s': walls[label((p, c))],
                               'check': failed.get(label((p, c)), 'ok')} for p, c in pairs],
               'best': {'partition_bytes': best[0], 'credit_bytes': best[1]}},
              interleaved=True)


if __name__ == '__main__':
    main()
