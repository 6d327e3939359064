"""Ranks that disagree get one RankMismatchError that names what every rank issued.

usage: kv_mismatch.py DESIGN

Each case issues, at one position, something that differs between ranks; every rank
catches the RankMismatchError and prints it as Python would print it uncaught
(traceback.format_exception), after a line 'rank R: CASE raised RankMismatchError'.
tests/test_mismatch.py checks the words, and that each rank's output holds them once
(the library itself must not print them again). After each case the output is
poisoned (where the error came from wait()) and the store still sums a fresh key.

shape   pushpull of key 'w' with shape (3 + rank,) float32
dtype   pushpull of key 'd' with shape (4,) and dtype float32, float64, int32 by rank
root    broadcast of key 'b', root rank % 2
kind    key 'k': rank 0 pushpulls, the others broadcast
joined  (3 ranks or more) the last rank has called join(); the others pushpull key 'j'
        with shape (3 + rank,): the joined rank takes part in telling what they issued
        and is not named; then they join too
count   (chained, blocking: one call is one agreement) rank 0 pushpulls keys 'c0', 'c1',
        the others 'c0', 'c1', 'c2'; last, since the ranks' sequence numbers then differ
"""
import traceback

import mxnet as mx
import numpy as np

import mpi_kvstore

from common import RANK, SIZE, WORLD, close, design_arg, done

DESIGN = design_arg()
DTYPES = ('float32', 'float64', 'int32')


# Each case: (the call, an output it writes), made before the call, which may raise.
def shape(kv):
    out = mx.nd.ones((3 + RANK,)) * (RANK + 1)
    return lambda: kv.pushpull('w', out), out


def dtype(kv):
    out = mx.nd.ones((4,), dtype=DTYPES[RANK % len(DTYPES)]) * (RANK + 1)
    return lambda: kv.pushpull('d', out), out


def root(kv):
    out = mx.nd.ones((4,)) * (RANK + 1)
    return lambda: kv.broadcast('b', out, root=RANK % 2), out


def kind(kv):
    out = mx.nd.ones((4,)) * (RANK + 1)
    call = kv.pushpull if RANK == 0 else kv.broadcast
    return lambda: call('k', out), out


def joined(kv):
    out = mx.nd.ones((3 + RANK,)) * (RANK + 1)
    return lambda: kv.pushpull('j', out), out


def count(kv):
    keys = ['c0', 'c1'] + (['c2'] if RANK else [])
    outs = [mx.nd.ones((2,)) * (RANK + 1) for _ in keys]
    return lambda: kv.pushpull(keys, outs), outs[0]


def caught(kv, case):
    """The output of CASE, or None where the call itself raised (blocking), whose outputs
    a caller cannot have read: a broadcast's stays as it was there (store/exchange.py copies
    it out after the collective)."""
    call, out = case(kv)
    try:
        call()
    except mpi_kvstore.RankMismatchError as err:
        report(case, err)
        return None
    try:
        kv.wait()
    except mpi_kvstore.RankMismatchError as err:
        report(case, err)
        return out
    raise AssertionError('rank %d: %s raised no RankMismatchError' % (RANK, case.__name__))


def report(case, err):
    print('rank %d: %s raised RankMismatchError\n%s' % (
        RANK, case.__name__, ''.join(traceback.format_exception(err))), flush=True)


def poisoned(out, case):
    """No read returns this rank's own values: MXNet's read may raise (funneled,
    concurrent), the next one returns the poison."""
    try:
        out.asnumpy()
    except mx.base.MXNetError:
        pass
    got = out.asnumpy()
    want = mpi_kvstore.store.deferred.poison_value(got.dtype)
    assert np.array_equal(got, np.full(got.shape, want, dtype=got.dtype), equal_nan=True), (
        'rank %d: %s: a mismatched output holds %s, not the poison %s'
        % (RANK, case.__name__, got[:4], want))


def still_sums(kv, case):
    after = mx.nd.ones((5,)) * (RANK + 1)
    kv.pushpull('after_' + case.__name__, after)
    close(after.asnumpy(), SIZE * (SIZE + 1) / 2, 'a pushpull after the %s mismatch'
          % case.__name__)


def main():
    assert SIZE > 1, 'a mismatch needs two ranks'
    kv = mpi_kvstore.create('dist_mpi', design=DESIGN)
    cases = [shape, dtype, root, kind]
    if SIZE > 2:
        cases.append(joined)
    if DESIGN in ('chained', 'blocking'):
        cases.append(count)
    for case in cases:
        out = None
        if case is joined and RANK == SIZE - 1:
            kv.join()
        else:
            out = caught(kv, case)
            if case is joined:
                kv.join()
        WORLD.Barrier()   # every rank has printed before any reads on
        if out is not None:
            poisoned(out, case)
        still_sums(kv, case)
    kv.wait()
    kv.close()
    done('kv_mismatch[%s]' % DESIGN)


main()
