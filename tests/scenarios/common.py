"""Shared by the store scenarios: expected values come from (rank, size) alone."""
import json
import sys

import numpy as np
from mpi4py import MPI

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()


def design_arg(default='funneled'):
    return sys.argv[1] if len(sys.argv) > 1 else default


# What this rank's checks saw since the last done(), which reports it for the test to assert
# on: close()'s {what: [shape, sum]} of what it got (CHECKED) and of what it expected
# (EXPECTED: the numpy or one-process value the scenario computed), for the first
# MAX_CHECKED names (a later call with the same name replaces its entry), and
# expect_raises()'s [exception type, ...] in order.
CHECKED, EXPECTED, RAISED = {}, {}, []
MAX_CHECKED = 400


def summary(array):
    """[shape, sum] of an array, as close() records it."""
    array = np.asarray(array)
    return [list(array.shape), float(array.astype(np.float64).sum())]


def record(actual, expected, what):
    """Keep what a check named WHAT saw, for done() to report (close() calls it)."""
    if what in CHECKED or len(CHECKED) < MAX_CHECKED:
        CHECKED[what], EXPECTED[what] = summary(actual), summary(expected)


def close(actual, expected, what, rtol=1e-5, atol=1e-6):
    actual = np.asarray(actual)
    expected = np.broadcast_to(np.asarray(expected, dtype=np.float64), actual.shape)
    record(actual, expected, what)
    if not np.allclose(actual.astype(np.float64), expected, rtol=rtol, atol=atol):
        raise AssertionError('rank %d: %s: got %s, expected %s'
                             % (RANK, what, actual.ravel()[:6], expected.ravel()[:6]))


def same_on_all_ranks(array, what):
    """Every rank holds bitwise the same array as rank 0."""
    mine = np.ascontiguousarray(array)
    ref = mine.copy()
    WORLD.Bcast(ref, root=0)
    if not np.array_equal(mine, ref):
        raise AssertionError('rank %d: %s differs from rank 0 (max diff %g)'
                             % (RANK, what, np.abs(mine.astype(np.float64) - ref).max()))


def expect_raises(exc_type, fn, *args, contains=None, **kwargs):
    """Call fn; it must raise exc_type (a type or a tuple of types) whose message holds
    ``contains``. -> the exception."""
    names = ' or '.join(t.__name__ for t in (exc_type if isinstance(exc_type, tuple)
                                             else (exc_type,)))
    try:
        fn(*args, **kwargs)
    except exc_type as err:
        RAISED.append(type(err).__name__)
        if contains and contains not in str(err):
            raise AssertionError('%s raised, but %r is not in its message: %s'
                                 % (names, contains, err)) from err
        return err
    raise AssertionError('%s was not raised by %s' % (names, getattr(fn, '__name__', fn)))


RESULT = '[result] '   # tests/mpi_harness.py's results() reads the lines that start so


def _plain(value):
    """numpy's arrays and scalars as JSON's lists and numbers."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError('%r cannot be reported' % (value,))


def report(name, **values):
    """Every rank's VALUES, gathered to rank 0, which prints them as one JSON line for the
    test to assert on: {"name": NAME, "size": SIZE, "ranks": [values of rank 0, ...]}.
    Collective: every rank calls it."""
    every = WORLD.gather(values, root=0)
    if RANK == 0:
        print(RESULT + json.dumps({'name': name, 'size': SIZE, 'ranks': every},
                                  default=_plain), flush=True)


def done(name, **values):
    """The scenario NAME ended well on every rank: report (as NAME) what each rank's checks
    saw, {'checked': CHECKED, 'expected': EXPECTED, 'raised': RAISED, **VALUES}, then print
    NAME: OK."""
    report(name, checked=dict(CHECKED), expected=dict(EXPECTED), raised=list(RAISED), **values)
    CHECKED.clear()
    EXPECTED.clear()
    del RAISED[:]
    WORLD.Barrier()
    if RANK == 0:
        print('%s: OK at %d ranks' % (name, SIZE), flush=True)


def check_state_shares(kv):
    """With shard_optimizer (MPI_KVSTORE_SHARD_OPTIMIZER=1 in the job's environment), every
    optimizer state array of a key with at least SIZE elements holds this rank's share of
    it, as numpy's array_split cuts it; without, the whole key. -> keys checked."""
    import mxnet as mx
    checked = 0
    for key, state in kv._updater.states.items():
        count = kv._keys.get(key).count
        whole = not kv.config.shard_optimizer or count < SIZE
        want = count if whole else len(np.array_split(np.arange(count), SIZE)[RANK])
        leaves = state if isinstance(state, (tuple, list)) else [state]
        for leaf in leaves:
            if isinstance(leaf, mx.nd.NDArray) and leaf.size != want:
                raise AssertionError('rank %d: optimizer state of key %r has %d elements, '
                                     'expected %d' % (RANK, key, leaf.size, want))
        checked += 1
    return checked


def set_values(rank):
    """What rank ``rank`` gives a process set's allreduce in the hvd set scenarios
    (hvd_elastic_sets.py, hvd_elastic_set_ids.py); their tests sum the same values."""
    return [10.0 * (rank + 1), rank - 0.5, 3.0]


def set_sums(process_set, rank):
    """hvd.allreduce (Sum) of :func:`set_values` over ``process_set`` -> a list."""
    import mxnet as mx

    import mpi_kvstore.horovod as hvd
    got = hvd.allreduce(mx.nd.array(set_values(rank)), op=hvd.Sum, process_set=process_set)
    return got.asnumpy().tolist()


def elastic_net(dim=8, hidden=6):
    """The elastic scenarios' Gluon model, alike on every worker: -> (net, its parameters)."""
    import mxnet as mx
    from mxnet import gluon
    mx.random.seed(42)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(hidden, activation='tanh', in_units=dim),
            gluon.nn.Dense(1, in_units=hidden))
    net.initialize(mx.init.Uniform(0.5))
    return net, net.collect_params()


def elastic_batch(step, rank, size, dim=8, count=24):
    """This rank's part of the elastic scenarios' global batch of step STEP (RandomState(900 +
    step), a sine of a linear map), as (data, target) NDArrays; rank 0 of 1 gets it whole."""
    import mxnet as mx
    rng = np.random.RandomState(900 + step)
    data = rng.uniform(-1, 1, (count, dim)).astype(np.float32)
    target = np.sin(data @ np.linspace(-1, 1, dim)).astype(np.float32).reshape(-1, 1)
    mine = np.array_split(np.arange(count), size)[rank]
    return mx.nd.array(data[mine]), mx.nd.array(target[mine])


class ElasticModel:
    """The elastic scenarios' Gluon model (:func:`elastic_net`) and its L2 loss: a step's
    forward and backward pass, the weights written to a file, and the reference run."""

    def __init__(self, dim=8, hidden=6):
        from mxnet import gluon
        self.dim = dim
        self.net, self.params = elastic_net(dim, hidden)
        self.loss_fn = gluon.loss.L2Loss()

    def forward_backward(self, data, target):
        from mxnet import autograd
        with autograd.record():
            loss = self.loss_fn(self.net(data), target)
        loss.backward()

    def save(self, path):
        np.savez(path, *[p.data().asnumpy() for p in self.params.values()])

    def reference(self, out, steps, optimizer, options, count=24):
        """One process, no store: ``steps`` steps of gluon.Trainer on each step's whole
        :func:`elastic_batch`; the weights to OUT.ref.npz."""
        from mxnet import gluon
        trainer = gluon.Trainer(self.params, optimizer, options, kvstore=None)
        for step in range(steps):
            self.forward_backward(*elastic_batch(step, 0, 1, self.dim, count))
            trainer.step(count)
        self.save('%s.ref.npz' % out)


def elastic_store(**options):
    """Our own API's elastic world: World.from_environment(), formed, and a dist_mpi store on
    it (``options``): -> (world, kv, reset), reset() being what elastic.run_fn calls after a
    loss or a host update (re-form the world, then reset the store on it)."""
    import mpi_kvstore
    from mpi_kvstore.elastic.world import World
    world = World.from_environment()
    world.form()
    kv = mpi_kvstore.create('dist_mpi', world=world, **options)

    def reset():
        world.reform()
        kv.reset()
    return world, kv, reset


class Held:
    """An engine op that writes ``arrays`` and completes only when released (the chained
    scenarios: a burst's first array held busy until every call was made)."""

    def __init__(self, arrays):
        import threading

        from mpi_kvstore.engine import core as engine  # only the scenarios that hold load it
        self.gate = threading.Event()

        def run(completion):
            self.gate.wait(60)
            completion.done()
        engine.push(run, mutable=arrays)

    def release(self):
        self.gate.set()


class UserFP16:
    """A float16 compressor written as a Horovod user would (compress/decompress, no store
    hint)."""

    @staticmethod
    def compress(tensor):
        return tensor.astype('float16'), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor.astype(ctx)
