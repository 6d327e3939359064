"""The sharded optimizer (shard_optimizer): training, state files and bad input.

usage: kv_sharded.py DESIGN train
       kv_sharded.py DESIGN save DIR     (writes DIR/params, DIR/states, DIR/expected.npz)
       kv_sharded.py DESIGN load DIR     (any number of ranks: resumes from DIR, sharded and
                                          unsharded, and checks DIR/expected.npz)
       kv_sharded.py DESIGN errors DIR
       kv_sharded.py DESIGN compressed
       kv_sharded.py DESIGN join DIR
       kv_sharded.py DESIGN partitioned
       kv_sharded.py DESIGN grid         (across hosts with as many ranks each)
       kv_sharded.py DESIGN clip

train: 8 gluon steps (update_on_kvstore) with SGD + momentum, Adam and LAMB: the sharded
store's weights equal the unsharded store's and one process's on the whole batch, and each
rank holds 1/N of the optimizer state (numpy's array_split of every key, the keys of fewer
elements than ranks whole). Then float16 weights with multi_precision SGD through pushpull
(MXNet's CPU has no float16 dense layer), against numpy's float32 master weights.

partitioned: partition_bytes of 512 cuts the reduce-scatters and allgathers (the negotiated
designs: schedule.SharePiece), and a credit of 1 KB holds pieces back; the weights equal
the unpartitioned sharded store's (bit for bit through the fp16, bf16 and 2-bit codecs,
whose sums go value by value) and one process's.

clip: gluon steps clipped by the global norm inside the store
(mpi_kvstore.clip_global_norm), SGD with momentum and Adam: sharded and unsharded stores
equal one process that clips with gluon.utils.clip_global_norm between backward and update, where most
steps clip and the clipped weights are far from unclipped ones; then bad keys and a step
left unfinished are refused with the store unchanged, and grouped pushpulls clip alike.

grid: hierarchical='on' across hosts: the reduce-scatters and allgathers go through the hosts
(hierarchy.Grid; the debug counters say so), whole and in pieces, and the weights equal the
flat unsharded store's and one process's.
"""
import os
import pickle
import sys

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import mpi_kvstore
from mpi_kvstore.errors import MPIKVStoreError
from mpi_kvstore.optim.shards import leaves

from common import RANK, SIZE, close, design_arg, done, expect_raises, same_on_all_ranks

DESIGN = design_arg()
PART = sys.argv[2]
# a global batch of 12 splits evenly over 2, 3 and 4 ranks; 8 steps (a wrong share of a
# state or of a weight shows from the first updates, and each step runs the same path)
GLOBAL, STEPS = 12, 8
OPTIMIZERS = {
    'sgd': ('sgd', {'learning_rate': 0.1, 'momentum': 0.9, 'wd': 1e-4}, 'float32'),
    'adam': ('adam', {'learning_rate': 0.01, 'wd': 1e-4}, 'float32'),
    # LAMB's trust ratio needs the whole weight's norms: summed over the shares
    'lamb': ('lamb', {'learning_rate': 0.01, 'wd': 1e-4}, 'float32'),
}


def make_net(dtype='float32'):
    # Odd sizes, so that shares are uneven at 2, 3 and 4 ranks; a bias of 3 elements is
    # smaller than 4 ranks (updated whole), and the convolution's gradient comes from MKLDNN.
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(5, 3, padding=1, in_channels=2, activation='relu'),
            gluon.nn.Flatten(),
            gluon.nn.Dense(13, in_units=5 * 6 * 6, activation='tanh'),
            gluon.nn.Dense(3, in_units=13))
    mx.random.seed(1234)
    net.initialize(mx.init.Xavier())
    net.cast(dtype)
    return net


def batch(step, dtype, ranks=None):
    """The global batch of ``step``, or this rank's part of it (``ranks``: the job's size)."""
    rng = np.random.RandomState(100 + step)
    data = rng.uniform(-1, 1, size=(GLOBAL, 2, 6, 6))
    label = rng.randint(0, 3, size=(GLOBAL,))
    if ranks is not None:
        per = GLOBAL // ranks
        data, label = data[RANK * per:(RANK + 1) * per], label[RANK * per:(RANK + 1) * per]
    return mx.nd.array(data, dtype=dtype), mx.nd.array(label, dtype=dtype)


def steps(net, trainer, first, last, dtype, ranks):
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    for step in range(first, last):
        data, label = batch(step, dtype, ranks)
        with autograd.record():
            loss = loss_fn(net(data), label)
        loss.backward()
        trainer.step(GLOBAL)     # sums over ranks: divide by the global batch


def weights(net):
    return [p.data().astype('float32').asnumpy() for p in net.collect_params().values()]


def store(shard, **options):
    return mpi_kvstore.create('dist_mpi', design=DESIGN, shard_optimizer=shard,
                              fusion_threshold=4 << 10, **options)


def trained(name, kv):
    opt, params, dtype = OPTIMIZERS[name]
    net = make_net(dtype)
    if kv is not None:
        for p in net.collect_params().values():   # the store's broadcast must fix these
            p.set_data(p.data() + RANK)
        mpi_kvstore.broadcast_parameters(net.collect_params(), store=kv)
    trainer = gluon.Trainer(net.collect_params(), opt, params, kvstore=kv,
                            update_on_kvstore=True if kv is not None else None)
    steps(net, trainer, 0, STEPS, dtype, SIZE if kv is not None else None)
    return weights(net), trainer


def state_elements(kv):
    return sum(leaf.size for state in kv._updater.states.values()
               for leaf in (state if isinstance(state, (tuple, list)) else [state])
               if isinstance(leaf, mx.nd.NDArray))


def expected_elements(net_weights, per_weight):
    """Elements of optimizer state on this rank: numpy's cut of each key over the ranks."""
    total = 0
    for w in net_weights:
        share = len(np.array_split(np.arange(w.size), SIZE)[RANK]) if w.size >= SIZE else w.size
        total += per_weight * share
    return total


def multi_precision(shard, optimizer=None):
    """STEPS pushpulls of float16 gradients into float16 weights, SGD with momentum (or
    ``optimizer``) on float32 master weights; -> (weights of every step, elements of
    optimizer state)."""
    kv = store(shard)
    shapes = {'a': (9, 7), 'b': (3,)}
    outs = {}
    for key, shape in shapes.items():
        kv.init(key, mx.nd.array(np.linspace(-1, 1, np.prod(shape)).reshape(shape),
                                 dtype='float16'))
        outs[key] = mx.nd.zeros(shape, dtype='float16')
    kv.set_optimizer(optimizer or mx.optimizer.SGD(learning_rate=0.1, momentum=0.9,
                                                   multi_precision=True))
    seen = []
    for step in range(STEPS):
        for key, shape in shapes.items():
            grad = np.cos(np.arange(np.prod(shape)) + step + RANK).reshape(shape) / 8
            kv.pushpull(key, mx.nd.array(grad, dtype='float16'), out=outs[key])
        seen.append({key: out.asnumpy() for key, out in outs.items()})
    elements = state_elements(kv)
    kv.close()
    return seen, elements


def numpy_multi_precision():
    shapes = {'a': (9, 7), 'b': (3,)}
    master = {k: np.linspace(-1, 1, np.prod(s)).reshape(s).astype(np.float16).astype(np.float32)
              for k, s in shapes.items()}
    mom = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    seen = []
    for step in range(STEPS):
        for key, shape in shapes.items():
            grads = [(np.cos(np.arange(np.prod(shape)) + step + r).reshape(shape) / 8)
                     .astype(np.float16).astype(np.float32) for r in range(SIZE)]
            total = sum(grads).astype(np.float16).astype(np.float32)
            mom[key] = 0.9 * mom[key] - 0.1 * total
            master[key] = master[key] + mom[key]
        seen.append({key: value.astype(np.float16) for key, value in master.items()})
    return seen


def part_multi_precision():
    sharded, elements = multi_precision(True)
    plain, unsharded = multi_precision(False)
    ref = numpy_multi_precision()
    for step in range(STEPS):
        for key in ref[step]:
            what = 'float16 key %r, step %d' % (key, step)
            same_on_all_ranks(sharded[step][key], what)
            close(sharded[step][key], plain[step][key], what + ', sharded vs unsharded',
                  rtol=1e-3, atol=1e-3)
            close(sharded[step][key], ref[step][key], what + ', vs numpy', rtol=1e-2, atol=2e-3)
    # float32 master weights and momentum: two arrays of each share; 'b' (3) whole at 4 ranks
    want = 2 * (len(np.array_split(np.arange(63), SIZE)[RANK])
                + (len(np.array_split(np.arange(3), SIZE)[RANK]) if SIZE <= 3 else 3))
    if elements != want:
        raise AssertionError('rank %d: multi_precision: %d elements of state, expected %d'
                             % (RANK, elements, want))
    assert SIZE == 1 or elements < unsharded, (elements, unsharded)
    # LAMB with float16 weights: its float32 master weights' norm, summed over shares
    lamb = dict(learning_rate=0.05, wd=1e-3, multi_precision=True)
    sharded, _ = multi_precision(True, mx.optimizer.LAMB(**lamb))
    plain, _ = multi_precision(False, mx.optimizer.LAMB(**lamb))
    for step in range(STEPS):
        for key in plain[step]:
            what = 'float16 LAMB key %r, step %d' % (key, step)
            same_on_all_ranks(sharded[step][key], what)
            close(sharded[step][key], plain[step][key], what + ', sharded vs unsharded',
                  rtol=1e-3, atol=1e-3)


def part_train():
    part_multi_precision()
    state = {}      # for the test: elements of optimizer state, sharded and unsharded
    for name in OPTIMIZERS:
        tol = dict(rtol=1e-4, atol=1e-5)
        ref, _ = trained(name, None)
        plain_kv, sharded_kv = store(False), store(True)
        plain, _ = trained(name, plain_kv)
        sharded, trainer = trained(name, sharded_kv)
        assert trainer._update_on_kvstore
        for i, value in enumerate(sharded):
            what = '%s: parameter %d' % (name, i)
            same_on_all_ranks(value, what)
            close(value, plain[i], what + ', sharded vs unsharded store', **tol)
            close(value, ref[i], what + ', sharded vs one process', **tol)
        # momentum: one array a weight; Adam: two
        per_weight = {'sgd': 1, 'adam': 2, 'lamb': 2}[name]
        got, want = state_elements(sharded_kv), expected_elements(sharded, per_weight)
        if got != want:
            raise AssertionError('rank %d: %s: %d elements of optimizer state, expected %d'
                                 % (RANK, name, got, want))
        unsharded = state_elements(plain_kv)
        state[name] = {'sharded': got, 'unsharded': unsharded}
        if SIZE > 1 and not got < unsharded:
            raise AssertionError('%s: sharded state %d is not below unsharded %d'
                                 % (name, got, unsharded))
        plain_kv.close()
        sharded_kv.close()
    done('kv_sharded[%s] train' % DESIGN, state=state, sizes=[w.size for w in sharded])


HALF = STEPS // 2


def part_save(folder):
    """Train half the steps sharded, save, train the rest: the figures a resumed run checks.
    The states saved sharded equal those an unsharded store saves at the same point."""
    opt, params, dtype = OPTIMIZERS['adam']
    saved = {}
    for shard in (True, False):
        kv = store(shard)
        net = make_net(dtype)
        mpi_kvstore.broadcast_parameters(net.collect_params(), store=kv)
        trainer = gluon.Trainer(net.collect_params(), opt, params, kvstore=kv,
                                update_on_kvstore=True)
        steps(net, trainer, 0, HALF, dtype, SIZE)
        path = os.path.join(folder, 'states' if shard else 'states_unsharded')
        trainer.save_states(path)       # every rank: a collective when sharded
        if shard and RANK == 0:
            net.save_parameters(os.path.join(folder, 'params'))
        kv._barrier()
        with open(path, 'rb') as fh:
            saved[shard] = pickle.loads(fh.read())
        if shard:
            steps(net, trainer, HALF, STEPS, dtype, SIZE)
            if RANK == 0:
                np.savez(os.path.join(folder, 'expected.npz'), *weights(net))
        kv.close()
    (sharded_states, _), (plain_states, _) = saved[True], saved[False]
    assert sorted(sharded_states) == sorted(plain_states), (sorted(sharded_states),
                                                             sorted(plain_states))
    for key in plain_states:
        for mine, theirs in zip(sharded_states[key], plain_states[key]):
            assert mine.shape == theirs.shape, (key, mine.shape, theirs.shape)
            close(mine.asnumpy(), theirs.asnumpy(), 'saved state of key %r' % (key,),
                  rtol=1e-4, atol=1e-6)
    done('kv_sharded[%s] save' % DESIGN)


def part_load(folder):
    """Resume at this job's size from the states saved at another size, sharded and not."""
    opt, params, dtype = OPTIMIZERS['adam']
    expected = np.load(os.path.join(folder, 'expected.npz'))
    expected = [expected['arr_%d' % i] for i in range(len(expected.files))]
    for shard in (True, False):
        kv = store(shard)
        net = make_net(dtype)
        net.load_parameters(os.path.join(folder, 'params'))
        mpi_kvstore.broadcast_parameters(net.collect_params(), store=kv)
        trainer = gluon.Trainer(net.collect_params(), opt, params, kvstore=kv,
                                update_on_kvstore=True)
        trainer.load_states(os.path.join(folder, 'states'))
        steps(net, trainer, HALF, STEPS, dtype, SIZE)
        for i, value in enumerate(weights(net)):
            what = 'parameter %d resumed at %d ranks (shard_optimizer=%d)' % (i, SIZE, shard)
            same_on_all_ranks(value, what)
            close(value, expected[i], what, rtol=1e-4, atol=1e-5)
        kv.close()
    done('kv_sharded[%s] load' % DESIGN)


def part_errors(folder):
    kv = store(True)
    # An optimizer whose update needs whole-weight norms is refused, and nothing changes.
    expect_raises(ValueError, kv.set_optimizer, mx.optimizer.LARS(), contains='LARS')
    assert kv._updater is None
    # A state file of another model: refused at load, on every rank, store unchanged.
    rng = np.random.RandomState(RANK)
    kv.init('w', mx.nd.array(rng.uniform(size=(7, 5))))
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.5, momentum=0.9))
    other = mx.optimizer.get_updater(mx.optimizer.SGD(momentum=0.9))
    other.states['w'] = mx.nd.zeros((6, 5))
    path = os.path.join(folder, 'other_model.%d' % RANK)
    with open(path, 'wb') as fh:
        fh.write(other.get_states())
    expect_raises(ValueError, kv.load_optimizer_states, path, contains="key 'w'")
    # the store goes on: two pushes with momentum, checked against numpy
    w = np.random.RandomState(0).uniform(size=(7, 5)).astype(np.float32)   # rank 0's init
    mom = np.zeros_like(w)
    out = mx.nd.zeros((7, 5))
    for step in range(2):
        grad = mx.nd.ones((7, 5)) * (RANK + step + 1)
        kv.pushpull('w', grad, out=out)
        total = sum(r + step + 1 for r in range(SIZE))
        mom = 0.9 * mom - 0.5 * total
        w = w + mom
        close(out.asnumpy(), w, 'momentum step %d after a refused load' % step)
    # 2-bit compression: the shares' codes go by one all-to-all (TwoBit.reduce_scatter)
    kv.set_gradient_compression({'type': '2bit', 'threshold': 0.5})
    kv.pushpull('w', mx.nd.ones((7, 5)), out=out)      # every value sends +0.5
    mom = 0.9 * mom - 0.5 * (0.5 * SIZE)
    close(out.asnumpy(), w + mom, 'a 2-bit compressed sharded step')
    kv.close()
    done('kv_sharded[%s] errors' % DESIGN)


def compress_once(grads, wire):
    """numpy's compress-once sum: each rank's values / N as 16-bit floats, summed in float32
    in rank order, rounded to 16 bits, times N."""
    import ml_dtypes
    kind = np.float16 if wire.startswith('fp16') else ml_dtypes.bfloat16
    n = len(grads)
    total = np.zeros(grads[0].shape, np.float32)
    for g in grads:
        total += (g.astype(np.float32) * np.float32(1.0 / n)).astype(kind).astype(np.float32)
    return total.astype(kind).astype(np.float32) * np.float32(n)


def part_compressed():
    """compression=fp16 / bf16 (and the fp16 ring, whose reduce-scatter compresses once):
    a sharded pushpull through SGD (lr 1) gives the weights minus numpy's compress-once sum,
    and STEPS gluon steps of the sharded store equal the unsharded compressed store's."""
    shape = (11, 7)
    grads = [np.sin(np.arange(77) * (r + 1)).reshape(shape).astype(np.float32) * 3
             for r in range(SIZE)]
    start = np.linspace(-2, 2, 77).reshape(shape).astype(np.float32)
    for wire in ('fp16', 'bf16', 'fp16-ring'):
        kv = store(True, compression=wire)
        kv.init('w', mx.nd.array(start))
        kv.set_optimizer(mx.optimizer.SGD(learning_rate=1.0))
        out = mx.nd.zeros(shape)
        kv.pushpull('w', mx.nd.array(grads[RANK]), out=out)
        close(out.asnumpy(), start - compress_once(grads, wire),
              '%s: one sharded step vs numpy' % wire, rtol=1e-6, atol=1e-6)
        kv.close()
    for wire in ('fp16', 'bf16', '2bit'):
        options = {} if wire == '2bit' else {'compression': wire}
        sharded_kv, plain_kv = store(True, **options), store(False, **options)
        if wire == '2bit':   # gluon passes it to the store's set_gradient_compression
            for kv in (sharded_kv, plain_kv):
                kv.set_gradient_compression({'type': '2bit', 'threshold': 0.01})
        sharded, _ = trained('sgd', sharded_kv)
        plain, _ = trained('sgd', plain_kv)
        for i, value in enumerate(sharded):
            what = '%s: parameter %d' % (wire, i)
            same_on_all_ranks(value, what)
            if wire == '2bit':   # values quantised one by one: the same sums, bit for bit
                assert np.array_equal(value, plain[i]), '%s: sharded != unsharded' % what
            else:
                close(value, plain[i], what + ', sharded vs unsharded', rtol=1e-5, atol=1e-6)
        sharded_kv.close()
        plain_kv.close()
    done('kv_sharded[%s] compressed' % DESIGN)


JOIN_SHAPES = {'w': (8, 3), 'v': (17,), 'b': (2,)}   # 'b': fewer elements than 3 ranks
JOIN_AT, JOIN_STEPS = 3, 7


def join_grad(key, step, rank):
    n = int(np.prod(JOIN_SHAPES[key]))
    return (np.sin(np.arange(n) * (rank + 1) + step + len(key)).reshape(JOIN_SHAPES[key])
            .astype(np.float32))


def join_run(shard, optimizer, folder, **options):
    """Rank SIZE-1 joins after JOIN_AT steps, the others take JOIN_STEPS; -> (the weights
    on this rank after every rank joined, the optimizer states saved then)."""
    kv = store(shard, **options)
    for key, shape in JOIN_SHAPES.items():
        kv.init(key, mx.nd.array(np.linspace(-1, 1, int(np.prod(shape))).reshape(shape)))
    kv.set_optimizer(optimizer())
    outs = {key: mx.nd.zeros(shape) for key, shape in JOIN_SHAPES.items()}
    for step in range(JOIN_STEPS):
        if RANK == SIZE - 1 and step == JOIN_AT:
            break
        for i, key in enumerate(JOIN_SHAPES):
            kv.pushpull(key, mx.nd.array(join_grad(key, step, RANK)), out=outs[key],
                        priority=-i)
    last = kv.join()
    assert last == SIZE - 2, last   # the active ranks issued the most (ties: the highest)
    path = os.path.join(folder, 'join_%s_%d_%d' % ('sharded' if shard else 'whole',
                                                    len(options), RANK))
    kv.save_optimizer_states(path)   # every rank: a collective when sharded
    with open(path, 'rb') as fh:
        states = pickle.loads(fh.read())
    got = {key: out.asnumpy() for key, out in outs.items()}
    kv.close()
    return got, states


def part_join(folder):
    """A rank that joined still owns its shares: the active ranks' reduce-scatter gives it
    their gradient sum of its share, it updates the share and sends it in the weights'
    allgather (shards.JoinedShares). The weights after every rank joined equal, on every
    rank, numpy's SGD with momentum on the sums of the ranks that had data, and the
    unsharded store's under the same join (SGD with momentum, Adam); the optimizer states
    saved then equal the unsharded store's, and so with the collectives in pieces.
    LAMB's norms cannot include the joined rank's
    share: refused with JoinError on the active ranks, and so is clip_global_norm's."""
    lr, momentum = 0.1, 0.9
    optimizers = {
        'sgd': lambda: mx.optimizer.SGD(learning_rate=lr, momentum=momentum),
        'adam': lambda: mx.optimizer.Adam(learning_rate=0.01),
    }
    runs = [(name, optimizer, {}) for name, optimizer in optimizers.items()]
    # the collectives cut in pieces (schedule.SharePiece), 2 held back at a time
    runs.append(('sgd', optimizers['sgd'], dict(partition_bytes=16, credit_bytes=32)))
    for name, optimizer, options in runs:
        sharded, sharded_states = join_run(True, optimizer, folder, **options)
        whole, whole_states = join_run(False, optimizer, folder)
        for key in JOIN_SHAPES:
            what = '%s: key %r after the join' % (name, key)
            same_on_all_ranks(sharded[key], what)
            close(sharded[key], whole[key], what + ', sharded vs unsharded', rtol=1e-5,
                  atol=1e-6)
            if name == 'sgd':
                w = np.linspace(-1, 1, sharded[key].size).reshape(JOIN_SHAPES[key])
                w, mom = w.astype(np.float32), np.zeros(JOIN_SHAPES[key], np.float32)
                for step in range(JOIN_STEPS):
                    ranks = range(SIZE if step < JOIN_AT else SIZE - 1)
                    g = sum(join_grad(key, step, r) for r in ranks)
                    mom = momentum * mom - lr * g
                    w = w + mom
                close(sharded[key], w, what + ', sharded vs numpy', rtol=1e-4, atol=1e-5)
        assert sorted(sharded_states) == sorted(whole_states), name
        for key in whole_states:
            for mine, theirs in zip(leaves(sharded_states[key]), leaves(whole_states[key])):
                close(mine.asnumpy(), theirs.asnumpy(), '%s: state of %r after the join'
                      % (name, key), rtol=1e-5, atol=1e-6)
    kv = store(True)
    kv.init('w', mx.nd.ones((8, 3)))
    kv.set_optimizer(mx.optimizer.LAMB(learning_rate=0.01))
    out = mx.nd.zeros((8, 3))
    if RANK != SIZE - 1:
        def step():   # blocking raises in the call, the engine designs at the wait
            kv.pushpull('w', mx.nd.ones((8, 3)), out=out)
            kv.wait()
        expect_raises(mpi_kvstore.JoinError, step, contains='LAMB')
    kv.join()
    kv.close()
    # clip_global_norm's allreduce of the shares' squares: refused alike
    kv = store(True)
    kv.init('w', mx.nd.ones((8, 3)))
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.01))
    if RANK != SIZE - 1:
        def clipped_step():
            kv.clip_global_norm(1.0, ['w'])
            kv.pushpull('w', mx.nd.ones((8, 3)), out=out)
            kv.wait()
        expect_raises(mpi_kvstore.JoinError, clipped_step, contains='clip_global_norm')
    kv.join()
    kv.close()
    done('kv_sharded[%s] join' % DESIGN)


def part_partitioned():
    from mpi_kvstore import debug
    cut = dict(partition_bytes=512, credit_bytes=1024)
    negotiated = DESIGN in ('funneled', 'concurrent')
    for name in OPTIMIZERS:
        ref, _ = trained(name, None)
        whole_kv = store(True)
        whole, _ = trained(name, whole_kv)
        before = debug.snapshot()
        kv = store(True, **cut)
        got, _ = trained(name, kv)
        pieces = debug.since(before, 'schedule').get('pieces_cut', 0)
        # reduce-scatters and allgathers of the 3 keys over 512 bytes, STEPS steps
        if negotiated and SIZE > 1 and pieces < 2 * STEPS:
            raise AssertionError('%s: %d requests cut, expected at least %d'
                                 % (name, pieces, 2 * STEPS))
        for i, value in enumerate(got):
            what = '%s: parameter %d, partitioned' % (name, i)
            same_on_all_ranks(value, what)
            close(value, whole[i], what + ' vs whole shares', rtol=1e-5, atol=1e-6)
            close(value, ref[i], what + ' vs one process', rtol=1e-4, atol=1e-5)
        kv.close()
        whole_kv.close()
    for wire in ('fp16', 'bf16', '2bit'):
        options = {} if wire == '2bit' else {'compression': wire}
        results = []
        for extra in ({}, cut):
            kv = store(True, **options, **extra)
            if wire == '2bit':
                kv.set_gradient_compression({'type': '2bit', 'threshold': 0.01})
            results.append(trained('sgd', kv)[0])
            kv.close()
        for i, (whole, parted) in enumerate(zip(*results)):
            if not np.array_equal(whole, parted):
                raise AssertionError('%s: parameter %d: partitioned differs from whole '
                                     'shares by %g' % (wire, i, abs(whole - parted).max()))
    done('kv_sharded[%s] partitioned' % DESIGN)


def part_grid():
    from mpi_kvstore import debug
    for name in ('sgd', 'adam'):
        ref, _ = trained(name, None)
        flat_kv = store(False)
        flat, _ = trained(name, flat_kv)
        flat_kv.close()
        for options in ({}, dict(partition_bytes=512, credit_bytes=1024)):
            before = debug.snapshot()
            kv = store(True, hierarchical='on', **options)
            got, _ = trained(name, kv)
            counted = debug.since(before, 'algorithm')
            for kind in ('hierarchical reducescatter', 'hierarchical allgather'):
                if not counted.get(kind):
                    raise AssertionError('%s %s: no %s ran: %s' % (name, options, kind, counted))
            kv.close()
            for i, value in enumerate(got):
                what = '%s %s: parameter %d through the hosts' % (name, options, i)
                same_on_all_ranks(value, what)
                close(value, flat[i], what + ' vs flat unsharded', rtol=1e-5, atol=1e-6)
                close(value, ref[i], what + ' vs one process', rtol=1e-4, atol=1e-5)
    done('kv_sharded[%s] grid' % DESIGN)


CLIP = 0.05    # below most steps' norms: most steps clip (counted below)


def clipped_reference(name):
    """One process on the whole batch, clipping as Gluon users do: the gradient the
    optimizer applies is the sum / GLOBAL, so the sum's bound is CLIP * GLOBAL."""
    opt, params, dtype = OPTIMIZERS[name]
    net = make_net(dtype)
    trainer = gluon.Trainer(net.collect_params(), opt, params, kvstore=None)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    clipped = 0
    for step in range(STEPS):
        data, label = batch(step, dtype)
        with autograd.record():
            loss = loss_fn(net(data), label)
        loss.backward()
        grads = [p.grad() for p in net.collect_params().values() if p.grad_req != 'null']
        norm = gluon.utils.clip_global_norm(grads, CLIP * GLOBAL)
        clipped += norm > CLIP * GLOBAL
        trainer.step(GLOBAL)
    return weights(net), clipped


def clipped_run(name, shard, **options):
    opt, params, dtype = OPTIMIZERS[name]
    kv = store(shard, **options)
    net = make_net(dtype)
    trainer = gluon.Trainer(net.collect_params(), opt, params, kvstore=kv,
                            update_on_kvstore=True)
    mpi_kvstore.clip_global_norm(trainer, CLIP)
    steps(net, trainer, 0, STEPS, dtype, SIZE)
    return weights(net), kv


def part_clip():
    tol = dict(rtol=1e-4, atol=1e-5)
    for name in ('sgd', 'adam'):
        ref, clipped = clipped_reference(name)
        assert clipped >= STEPS // 2, '%s: only %d of %d steps clip' % (name, clipped, STEPS)
        unclipped, _ = trained(name, None)
        far = max(float(np.abs(a - b).max()) for a, b in zip(ref, unclipped))
        assert far > 100 * tol['atol'], '%s: clipping changed the weights by %g' % (name, far)
        for shard in (True, False):
            got, kv = clipped_run(name, shard)
            for i, value in enumerate(got):
                what = '%s, shard_optimizer=%s: parameter %d' % (name, shard, i)
                same_on_all_ranks(value, what)
                close(value, ref[i], what + ', clipped in the store vs one process', **tol)
            assert kv._optimizer.clip is None, 'a finished run leaves no clipped step under way'
            kv.close()
    # Bad input: refused before anything is sent, and the store goes on.
    expect_raises(TypeError, mpi_kvstore.clip_global_norm, object(), 1.0, contains='Module')
    net = make_net()
    expect_raises(ValueError, mpi_kvstore.clip_global_norm,
                  gluon.Trainer(net.collect_params(), 'sgd'), 0.0, contains='max_norm')
    outside = gluon.Trainer(net.collect_params(), 'sgd', kvstore=store(True),
                            update_on_kvstore=False)
    mpi_kvstore.clip_global_norm(outside, 1.0)
    data, label = batch(0, 'float32', SIZE)
    with autograd.record():
        loss = gluon.loss.SoftmaxCrossEntropyLoss()(net(data), label)
    loss.backward()
    expect_raises(ValueError, outside.step, GLOBAL, contains='update_on_kvstore=False')
    outside._kvstore.close()
    kv = store(True)
    expect_raises(MPIKVStoreError, kv.clip_global_norm, 1.0, ['w'], contains='no optimizer')
    w0 = np.random.RandomState(0).uniform(size=(7, 5)).astype(np.float32)
    kv.init('w', mx.nd.array(w0))
    kv.init('b', mx.nd.array(w0[0]))
    kv.init('x', mx.nd.zeros((3,)))               # a key of the store, not of the step
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.5))
    for bad in (0, -1.0, float('nan'), True, '1'):
        expect_raises(ValueError, kv.clip_global_norm, bad, ['w', 'b'], contains='max_norm')
    expect_raises(ValueError, kv.clip_global_norm, 1.0, [], contains='not empty')
    expect_raises(ValueError, kv.clip_global_norm, 1.0, ['w', 'w'], contains='distinct')
    out_w, out_b = mx.nd.zeros((7, 5)), mx.nd.zeros((5,))
    kv.clip_global_norm(1.0, ['w', 'b'])
    expect_raises(ValueError, kv.clip_global_norm, 1.0, ['w', 'b'], contains='still waits')
    expect_raises(ValueError, kv.pushpull, 'x', mx.nd.ones((3,)), contains='not one of its keys')
    # one grouped call of both keys: the sum of ones over the ranks is SIZE per value;
    # with SGD's rescale_grad 1 its norm is SIZE * sqrt(40), clipped to 1
    kv.pushpull(['w', 'b'], [mx.nd.ones((7, 5)), mx.nd.ones((5,))], out=[out_w, out_b])
    factor = min(1.0, 1.0 / (SIZE * np.sqrt(40.0) + 1e-8))
    close(out_w.asnumpy(), w0 - 0.5 * SIZE * factor, 'a clipped grouped step (w)')
    close(out_b.asnumpy(), w0[0] - 0.5 * SIZE * factor, 'a clipped grouped step (b)')
    # a key twice in one step is refused, the step stays open for the other key
    kv.clip_global_norm(1e6, ['w', 'b'])          # no clipping: the plain SGD step
    kv.pushpull('w', mx.nd.ones((7, 5)), out=out_w)
    expect_raises(ValueError, kv.pushpull, 'w', mx.nd.ones((7, 5)), out=out_w,
                  contains='already pushed')
    kv.pushpull('b', mx.nd.ones((5,)), out=out_b)
    close(out_w.asnumpy(), w0 - 0.5 * SIZE * factor - 0.5 * SIZE, 'an unclipped step (w)')
    close(out_b.asnumpy(), w0[0] - 0.5 * SIZE * factor - 0.5 * SIZE, 'an unclipped step (b)')
    assert kv._optimizer.clip is None
    kv.close()
    done('kv_sharded[%s] clip' % DESIGN)


if PART == 'train':
    part_train()
elif PART == 'save':
    part_save(sys.argv[3])
elif PART == 'load':
    part_load(sys.argv[3])
elif PART == 'compressed':
    part_compressed()
elif PART == 'join':
    part_join(sys.argv[3])
elif PART == 'partitioned':
    part_partitioned()
elif PART == 'grid':
    part_grid()
elif PART == 'clip':
    part_clip()
elif PART == 'errors':
    part_errors(sys.argv[3])
else:
    raise SystemExit('unknown part %r' % PART)
