"""The sharded optimizer (shard_optimizer) side by side with the unsharded store.

    mpiexec -n 4 python -m benchmarks.sharded [--configs unsharded,sharded,sharded+bf16]
    for c in unsharded sharded; do mpiexec -n 4 python -m benchmarks.sharded --rss-only $c \
        --rss-json rss_$c.json; done         # then --rss-files rss_unsharded.json,rss_sharded.json

gpu_like's model, trained by gluon.Trainer with the optimizer in the store (Adam by
default). Every configuration (CONFIGS) is a store and a model of its own, all created
before anything is timed: unsharded (allreduce, every rank updates everything), sharded
(reduce-scatter, update this rank's share, allgather the weights), sharded+bf16/fp16 (a
16-bit reduce-scatter), sharded+2bit (MXNet's 2-bit gradient compression, threshold 0.5,
on the reduce-scatter), and unsharded+whole / sharded+whole (no collective cut into
priority pieces). Rounds interleave the configurations (harness.interleaved), each making
one run of --chain steps (gpu_like._train).

Per configuration: step (min/median/max, ratio to unsharded's, per-round ratios), the
optimizer state this rank holds (largest over ranks), wire bytes a rank sends a step in the
ring model (allreduce 2(N-1)/N G; reduce-scatter + allgather the same; a 16-bit wire halves
the reduce-scatter, 2-bit sends a sixteenth), and RSS. RSS comes from a job of its own per
configuration (configurations in one process share its memory): --rss-only CONFIG trains
one alone and writes its RSS; --rss-files hands the timed job those files.

Checks (a failure is printed in the table and exits 1): weights equal on every rank; every
trained weight equals MXNet's own optimizer fed the same summed gradients (float32
tolerance, 1e-2 for 16-bit wires; for 2-bit a reference that quantises each rank's gradient
with its own residual, as quantize_2bit does, which is exact on gpu_like's gradients);
sharded weights equal unsharded ones; a sharded rank's state is exactly its share of
unsharded's.
"""
import argparse
import collections
import functools
import json
import os

import mxnet as mx
import numpy as np
from mxnet import gluon

import mpi_kvstore
from benchmarks import gpu_like, harness, report
from mpi_kvstore.comm.fusion import share
from mpi_kvstore.optim import shards

CONFIGS = {
    'unsharded': {'shard_optimizer': False},
    'sharded': {'shard_optimizer': True},
    'sharded+bf16': {'shard_optimizer': True, 'compression': 'bf16'},
    'sharded+fp16': {'shard_optimizer': True, 'compression': 'fp16'},
    # harness.create_store: '2bit' is set_gradient_compression's threshold (MXNet's default)
    'sharded+2bit': {'shard_optimizer': True, '2bit': 0.5},
    'unsharded+whole': {'shard_optimizer': False, 'partition_bytes': 0, 'credit_bytes': 0},
    'sharded+whole': {'shard_optimizer': True, 'partition_bytes': 0, 'credit_bytes': 0},
}
DEFAULT_CONFIGS = 'unsharded,sharded,sharded+bf16'
# The optimizers offered, with what they get besides the learning rate: each has state
# (SGD and NAG with momentum), and updates elementwise (LAMB and LARS are refused sharded).
OPTIMIZERS = {'adam': {}, 'sgd': {'momentum': 0.9}, 'nag': {'momentum': 0.9},
              'rmsprop': {}, 'adagrad': {}}
STEPS = {'warmups': 1, 'trials': 5}         # untimed and timed rounds
DEFAULT_OUT = os.path.join(harness.DEFAULT_OUT, 'sharded')
TOLERANCE = {'exact': {'rtol': 1e-5, 'atol': 1e-6}, '16bit': {'rtol': 1e-2, 'atol': 1e-2}}
MB = 1 << 20


def configs(text):
    chosen = harness.names(text)
    unknown = [c for c in chosen if c not in CONFIGS]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f'unknown configuration(s) {unknown}: use some of '
                                         f'{", ".join(CONFIGS)}')
    return chosen


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                     conflict_handler='resolve')
    gpu_like.add_workload_args(parser)
    # gpu_like's --optimizer offers SGD without state; here the state is the point.
    parser.add_argument('--optimizer', default='adam', choices=sorted(OPTIMIZERS))
    parser.add_argument('--lr', type=float, default=0.01)
    parser.add_argument('--configs', type=configs, default=configs(DEFAULT_CONFIGS),
                        help=f'comma-separated, of {", ".join(CONFIGS)}')
    parser.add_argument('--design', help="every store's design, options after '+'")
    parser.add_argument('--topology', help='a free label, e.g. "2 hosts x 1 rank, 1gbit"')
    harness.add_common_args(parser, default_out=DEFAULT_OUT, sizes=False, quick=False, full=STEPS,
                            timeout=900.0)
    parser.add_argument('--rounds', dest='trials', type=int, help='the same as --trials')
    parser.add_argument('--rss-only', choices=list(CONFIGS),
                        help='train this configuration alone and write its RSS per rank')
    parser.add_argument('--rss-json', help='with --rss-only: the JSON to write')
    parser.add_argument('--rss-files', help="comma-separated JSONs of --rss-only jobs")
    args = harness.resolve_quick(parser.parse_args(argv), STEPS)
    if args.chain < 1:
        raise SystemExit('--chain must be >= 1')
    return args


# ---------------------------------------------------------------- the configurations

class Config:
    """One configuration: its store, model and trainer; what the checks found."""

    def __init__(self, name, kv, model, trainer):
        self.name, self.kv, self.model, self.trainer = name, kv, model, trainer
        self.runs = 0          # runs of --chain steps trained so far
        self.check = None      # 'ok' or why not, once checked


def optimizer_params(args):
    return dict(OPTIMIZERS[args.optimizer], learning_rate=args.lr)


def make_config(args, plan_, name, index):
    """Collective: a store with `name`'s options, a model of its own (parameters apart from
    every other configuration's) and a gluon.Trainer updating on the store."""
    model = gpu_like.GPULikeModel(plan_, prefix=f'{plan_.model}_{index}_')
    model.initialize()
    kv, why = harness.create_store(args.design, args.timeout, **CONFIGS[name])
    if kv is None:
        raise SystemExit(f'{name}: no store: {why}')
    mpi_kvstore.broadcast_parameters(model.collect_params(), store=kv)
    trainer = gluon.Trainer(model.collect_params(), args.optimizer, optimizer_params(args),
                            kvstore=kv, update_on_kvstore=True)
    return Config(name, kv, model, trainer)


def train_run(args, config, comm):
    """One run of --chain steps: seconds a step, the slowest rank's (gpu_like._train)."""
    one = argparse.Namespace(warmups=0, trials=1, chain=args.chain, batch=args.batch)
    seconds = gpu_like._train(one, config.model, config.trainer, comm)['wall_s'][0]
    config.runs += 1
    return seconds


def state_bytes(kv):
    """Bytes of optimizer state this rank's store holds: every NDArray of every key's state."""
    updater = kv._updater
    if updater is None:
        return 0
    return sum(leaf.size * np.dtype(leaf.dtype).itemsize
               for state in updater.states.values() for leaf in shards.leaves(state))


def expected_share_bytes(kv_whole, nranks, rank):
    """The bytes a sharded rank should hold, from an unsharded store's whole states: every
    key's arrays cut to this rank's share (fusion.share), keys of fewer elements than ranks
    whole."""
    total = 0
    for state in kv_whole._updater.states.values():
        for leaf in shards.leaves(state):
            count = leaf.size
            start, stop = share(count, nranks, rank) if count >= nranks else (0, count)
            total += (stop - start) * np.dtype(leaf.dtype).itemsize
    return total


def wire_bytes(name, plan_, nranks):
    """Bytes a rank sends a step in the ring model (the docstring), from the gradient sizes."""
    grads = plan_.grad_bytes
    part = (nranks - 1) / nranks * grads
    if not CONFIGS[name]['shard_optimizer']:
        return 2 * part
    if CONFIGS[name].get('2bit') is not None:
        scatter = part / 16            # a quarter byte for a float32's four
    elif CONFIGS[name].get('compression'):
        scatter = part / 2
    else:
        scatter = part
    return scatter + part


def rss():
    """{'VmRSS': MB, 'VmHWM': MB} of this process: now and its peak."""
    return dict(zip(('VmRSS', 'VmHWM'), harness.rss_and_peak_mb()))


# ---------------------------------------------------------------- checks

def two_bit_send(residual, grad, threshold):
    """(the value MXNet's quantize_2bit sends for one element, the new residual), in
    float32: +t where residual + grad >= t, -t where <= -t, else 0; the rest is kept."""
    t = np.float32(threshold)
    r = np.float32(residual + np.float32(grad))
    sent = t if r >= t else (-t if r <= -t else np.float32(0))
    return sent, np.float32(r - sent)


def reference_weights(args, plan_, nranks, runs, two_bit=None):
    """{parameter index: the value every element of that trained weight should hold}:
    MXNet's optimizer (as the Trainer makes it) on one-element arrays, fed each step's
    gradient summed over ranks as the store sums it (float32, rank order), `runs` runs of
    --chain steps (gpu_like._train numbers each run's steps from 0). With `two_bit` (a
    threshold), each rank's gradient is what its 2-bit quantisation sends (two_bit_send,
    one residual a rank and parameter: every element of a parameter has the same gradient)."""
    optimizer = mx.optimizer.create(args.optimizer, **optimizer_params(args))
    optimizer.rescale_grad = 1.0 / (args.batch * nranks)     # Trainer.step(batch * ranks)
    updater = mx.optimizer.get_updater(optimizer)
    expected = {}
    for index, spec in enumerate(plan_.params):
        if spec.grad_req == 'null':
            continue
        weight = mx.nd.array([gpu_like.initial_value(index)], dtype='float32')
        residuals = [np.float32(0)] * nranks
        for _ in range(runs):
            for step in range(args.chain):
                summed = np.float32(0)
                for r in range(nranks):
                    grad = np.float32(gpu_like.grad_unit(index) * gpu_like.step_scale(step, r))
                    if two_bit is not None:
                        grad, residuals[r] = two_bit_send(residuals[r], grad, two_bit)
                    summed = np.float32(summed + grad)
                updater(index, mx.nd.array([summed], dtype='float32'), weight)
        expected[index] = float(weight.asnumpy()[0])
    return expected


def two_bit_of(name):
    """The 2-bit threshold of configuration `name`, None without 2-bit."""
    return CONFIGS[name].get('2bit')


def _tolerance(name):
    # 2-bit is checked against its own (exact) 2-bit reference
    return TOLERANCE['16bit' if CONFIGS[name].get('compression') else 'exact']


def weights_of(config):
    return [p.data().asnumpy() for p in config.model.collect_params().values()]


def check_config(config, reference, plan_, comm):
    """Collective: 'ok', or why `config`'s weights are wrong, the same on every rank.
    `reference`: reference_weights' for this configuration (2-bit's models the 2-bit)."""
    config.kv.wait()
    weights = weights_of(config)
    error = harness.ranks_differ(weights, comm)
    if error is None:
        tol = _tolerance(config.name)
        for index, (spec, w) in enumerate(zip(plan_.params, weights)):
            if index not in reference:
                continue
            if not np.all(np.isfinite(w)) or not np.allclose(w, reference[index], **tol):
                bad = np.flatnonzero(~np.isclose(w.ravel(), reference[index], **tol))
                first = bad[0] if bad.size else 0
                error = (f'{spec.name}: {bad.size} elements differ from the reference '
                         f'{reference[index]!r}, first {first}: {w.ravel()[first]!r}')
                break
    config.check = harness.agree(error, comm) or 'ok'
    return weights


def compare(name, weights, base, comm):
    """Collective: (max |weights - base| over every element and rank, why they differ or
    None): a configuration against unsharded's weights. A 2-bit configuration's distance is
    measured, not checked: its weights follow other gradients (check_config's reference)."""
    tol = _tolerance(name)
    worst, error = 0.0, None
    for index, (w, b) in enumerate(zip(weights, base)):
        worst = max(worst, float(np.max(np.abs(w - b))) if w.size else 0.0)
        if error is None and two_bit_of(name) is None and not np.allclose(w, b, **tol):
            error = f'parameter {index} differs from unsharded by up to {worst:g}'
    return max(comm.allgather(worst)), harness.agree(error, comm)


# ---------------------------------------------------------------- RSS

def rss_only(args, plan_, comm, run):
    """--rss-only: one configuration alone, trained as the timed job trains it; RSS after."""
    name = args.rss_only
    with harness.deadline(args.timeout, f'sharded --rss-only {name}'):
        config = make_config(args, plan_, name, 0)
        gpu_like.measure_compute(config.model, 1, 0, comm.rank)   # gradients and activations
        mx.nd.waitall()
        before = rss()
        for _ in range(args.warmups + args.trials):
            train_run(args, config, comm)
        config.kv.wait()
        mx.nd.waitall()
        after = rss()
        reference = reference_weights(args, plan_, comm.size, config.runs, two_bit_of(name))
        check_config(config, reference, plan_, comm)
        state = state_bytes(config.kv)
    per_rank = comm.allgather({'rss_MB': after['VmRSS'], 'hwm_MB': after['VmHWM'],
                               'model_rss_MB': before['VmRSS'], 'state_bytes': state})
    row = {'config': name, 'options': CONFIGS[name], 'check': config.check, 'runs': config.runs,
           'per_rank': per_rank,
           **{key: max(r[key] for r in per_rank)
              for key in ('rss_MB', 'hwm_MB', 'model_rss_MB', 'state_bytes')}}
    harness.rank0_print(
        f'{name} alone: RSS {row["rss_MB"]:.1f} MB (peak {row["hwm_MB"]:.1f}; the model before '
        f'any store {row["model_rss_MB"]:.1f}), optimizer state {row["state_bytes"] / MB:.1f} '
        f'MB, largest over {comm.size} ranks; weights {config.check}')
    payload = {'model': args.model, 'optimizer': args.optimizer, 'batch': args.batch,
               'chain': args.chain, 'rss': row}
    if args.rss_json:
        run.json_path = args.rss_json
    run.write(payload, interleaved=False)
    harness.rank0_print(f'  written to {run.json_path}')
    config.kv.close()
    if config.check != 'ok':
        raise SystemExit(f'{name}: weight check failed: {config.check}')


def load_rss(args, nranks):
    """{config: the --rss-only row} of --rss-files, each checked to be of this run's shape."""
    rows = {}
    for path in harness.names(args.rss_files or ''):
        with open(path) as handle:
            record = json.load(handle)
        mine = {'nranks': nranks, 'model': args.model, 'optimizer': args.optimizer,
                'batch': args.batch}
        theirs = {'nranks': record['nranks'], **{k: record[k] for k in mine if k != 'nranks'}}
        if theirs != mine:
            raise SystemExit(f'{path}: an --rss-only run of {theirs}, not of {mine}')
        rows[record['rss']['config']] = dict(record['rss'], file=path, date=record['config']['date'])
    return rows


# ---------------------------------------------------------------- the timed job

def summarize(names, steps, rows):
    """Medians, spreads and ratios to unsharded's into rows ({config: row})."""
    base = steps.get('unsharded')
    for name in names:
        row = rows[name]
        row['step_s'] = steps[name]
        row['step'] = harness.spread(steps[name])
        if base:
            row['vs_unsharded'] = row['step']['median'] / harness.spread(base)['median']
            row['vs_unsharded_per_round'] = harness.spread(
                [s / b for s, b in zip(steps[name], base)])
    return rows


def table(names, rows, nranks):
    cells = []
    base_state = rows.get('unsharded', {}).get('state_bytes')
    for name in names:
        row = rows[name]
        per_round = row.get('vs_unsharded_per_round')
        ratio = (f'{row["vs_unsharded"]:.3f}x ({per_round["median"]:.3f}, '
                 f'{per_round["min"]:.3f}-{per_round["max"]:.3f})' if per_round else '-')
        state = row['state_bytes'] / MB
        share = f'{row["state_bytes"] / base_state:.3f} (1/N = {1 / nranks:.3f})' \
            if base_state else '-'
        rss_ = f'{row["rss"]["rss_MB"]:.0f}' if row.get('rss') else '-'
        cells.append([name, report.spread_ms(row['step']), ratio, f'{state:.1f}', share, rss_,
                      f'{row["wire_bytes"] / MB:.1f}', row['check']])
    return report.markdown(['configuration', 'step ms median (min-max)', 'step / unsharded '
                            '(median of per-round ratios, min-max)', 'optimizer state MB/rank',
                            'state / unsharded', 'RSS MB/rank (own job)', 'wire MB/step/rank',
                            'weights'], cells)


def findings(names, rows, nranks):
    """The ratios issue 22 sets targets for, as lines of text (only those measured)."""
    lines = []
    steps = {n: rows[n]['step']['median'] for n in names}
    if 'unsharded' in steps and 'sharded' in steps:
        lines.append(f'sharded / unsharded step: {steps["sharded"] / steps["unsharded"]:.3f}x '
                     '(target <= 1.05x)')
    if 'unsharded+whole' in steps and 'sharded+whole' in steps:
        lines.append('collectives whole (no pieces): sharded / unsharded step: '
                     f'{steps["sharded+whole"] / steps["unsharded+whole"]:.3f}x')
    for a, b in (('unsharded', 'unsharded+whole'), ('sharded', 'sharded+whole')):
        if a in steps and b in steps:
            lines.append(f'{a}: pieces speed it up {steps[b] / steps[a]:.3f}x (whole / pieces)')
    for wire in ('bf16', 'fp16', '2bit'):
        name = f'sharded+{wire}'
        if name in steps and 'sharded' in steps:
            lines.append(f'{name} speed-up over sharded (sharded / {name} step): '
                         f'{steps["sharded"] / steps[name]:.3f}x (target >= 1.3x across hosts '
                         'at 1 Gbit/s)')
    if 'unsharded' in rows and 'sharded' in rows:
        u, s = rows['unsharded'], rows['sharded']
        lines.append(f'state per rank sharded / unsharded: {s["state_bytes"] / u["state_bytes"]:.4f} '
                     f'(1/N = {1 / nranks:.4f}; exact share: {s.get("state_share_check", "-")})')
        if u.get('rss') and s.get('rss'):
            fell = u['rss']['rss_MB'] - s['rss']['rss_MB']
            freed = (u['state_bytes'] - s['state_bytes']) / MB
            lines.append(f'RSS per rank fell by {fell:.1f} MB against {freed:.1f} MB of state '
                         f'freed: {fell / freed:.2f}x (target >= 0.7x at 4 ranks)')
    return lines


def timed(args, plan_, comm, run):
    """The side by side: every configuration created, rounds timed, then the checks."""
    names = args.configs
    rss_rows = load_rss(args, comm.size)
    with harness.deadline(args.timeout, 'sharded'):
        made = [make_config(args, plan_, name, i) for i, name in enumerate(names)]
        by_name = {c.name: c for c in made}
        ops = {c.name: functools.partial(train_run, args, c, comm) for c in made}
        steps = harness.interleaved(ops, args.trials, args.warmups, lambda name, op: op())
        mx.nd.waitall()
        references = {}     # 2-bit threshold (None: exact gradients) -> reference_weights
        weights = {}
        rows = collections.OrderedDict()
        for config in made:
            two_bit = two_bit_of(config.name)
            if two_bit not in references:
                references[two_bit] = reference_weights(args, plan_, comm.size, config.runs,
                                                        two_bit)
            weights[config.name] = check_config(config, references[two_bit], plan_, comm)
            state = state_bytes(config.kv)
            rows[config.name] = {
                'config': config.name, 'options': CONFIGS[config.name], 'runs': config.runs,
                'state_bytes': max(comm.allgather(state)),
                'state_bytes_per_rank': comm.allgather(state),
                'wire_bytes': wire_bytes(config.name, plan_, comm.size),
                'rss': rss_rows.get(config.name)}
        if 'unsharded' in by_name:
            whole = by_name['unsharded']
            expected = expected_share_bytes(whole.kv, comm.size, comm.rank)
            for config in made:
                if config.name == 'unsharded':
                    continue
                worst, why = compare(config.name, weights[config.name], weights['unsharded'],
                                     comm)
                rows[config.name]['max_abs_vs_unsharded'] = worst
                if why and config.check == 'ok':
                    config.check = why
                if not CONFIGS[config.name]['shard_optimizer']:
                    continue   # unsharded+whole holds the whole state, as unsharded does
                share_ok = harness.agree(
                    None if state_bytes(config.kv) == expected else
                    f'rank {comm.rank} holds {state_bytes(config.kv)} bytes of state, its share '
                    f'of unsharded\'s is {expected}', comm)
                rows[config.name]['state_share_check'] = share_ok or 'ok'
                if share_ok and config.check == 'ok':
                    config.check = share_ok
        for config in made:
            rows[config.name]['check'] = config.check
        all_rss = comm.allgather(rss()['VmRSS'])
        del weights
        for config in made:
            config.kv.wait()
            config.kv.close()
    summarize(names, steps, rows)
    return rows, all_rss


def main(argv=None):
    args = parse_args(argv)
    comm = harness.world()
    plan_ = gpu_like.plan(args.model, args.images_per_s, args.batch)
    where = harness.topology(comm, args.topology)
    base = f'{args.model}_{args.optimizer}_h{where["hosts"]}'
    if args.rss_only:
        run = harness.Run('sharded', args, comm=comm, label=f'{base}_rss_{args.rss_only}')
        return rss_only(args, plan_, comm, run)
    run = harness.Run('sharded', args, comm=comm, label=base)
    label = args.topology or f'{where["hosts"]} host(s), {comm.size} ranks in all'
    harness.rank0_print(
        f'sharded: {args.model}, {plan_.grad_bytes / 1e6:.1f} MB of gradients, '
        f'{plan_.images_per_s:.1f} images/s at batch {args.batch} ({plan_.compute_s * 1e3:.1f} ms '
        f'of compute a step), {args.optimizer} in the store; {label}; {args.warmups} + '
        f'{args.trials} rounds of {args.chain} steps, interleaved')
    rows, all_rss = timed(args, plan_, comm, run)
    text = table(args.configs, rows, comm.size)
    lines = findings(args.configs, rows, comm.size)
    harness.rank0_print(f'\n{text}\n')
    for line in lines:
        harness.rank0_print(line)
    harness.rank0_print(f'RSS of the timed job (every configuration alive): '
                        f'{max(all_rss):.0f} MB, largest over ranks')
    if not args.rss_files:
        harness.rank0_print('RSS per configuration: none given (--rss-files of --rss-only jobs)')
    failed = {n: r['check'] for n, r in rows.items() if r['check'] != 'ok'}
    payload = {'model': args.model, 'optimizer': args.optimizer, 'batch': args.batch,
               'chain': args.chain, 'grad_bytes': plan_.grad_bytes,
               'keys': sum(p.grad_req != 'null' for p in plan_.params),
               'images_per_s': plan_.images_per_s, 'compute_stated_s': plan_.compute_s,
               'topology': where, 'rows': list(rows.values()), 'findings': lines,
               'rss_timed_job_MB': all_rss, 'table': text,
               'check': 'ok' if not failed else failed}
    run.write(payload, interleaved=True, topology=label)
    harness.rank0_print(f'written to {run.json_path}')
    if failed:
        harness.rank0_print(f'CHECK FAILED: {failed}')
        raise SystemExit(1)
    harness.rank0_print('weights check: ok (equal across ranks, against the reference, '
                        'sharded against unsharded; 2-bit against its 2-bit reference)')
    return None


if __name__ == '__main__':
    harness.run_main(main)
