"""A rank whose local step fails before the MPI call still keeps the ranks paired.

usage: fault_local_failure.py DESIGN [CASE ...]   (default: every case)

On rank 1 only, the local step of ONE collective raises before its MPI call:

fused-inplace, fused-out
    Several float32 keys pushed as one list travel as one fused bucket; rank 1's
    concatenation into the fusion buffer raises, after the ranks agreed to run the
    bucket. Rank 1 takes part with zeros: rank 0 gets the sum without rank 1's part
    and no error; rank 1's kv.wait() raises.
single-inplace, single-out
    One key alone; reading its array (flat_view, inside the engine op) raises on
    rank 1, before the agreement. Since 1bd89e6 rank 1 then spoils the request's
    signature, so every rank skips that collective: rank 0 gets RankMismatchError
    and NaN, rank 1 its own error. (Before it, rank 0 got the sum with rank 1's
    zeros and no error, as in the fused cases: HEALTHY_RANK_GETS says which.)

In every case the failing rank's error names the injected failure, the outputs
of every failed collective are NaN (except the array rank 1 could not read: the
store cannot write it either, see docs/faults.md on MKLDNN-layout arrays), and the next collective
of both ranks sums every rank's part. The NaN check comes last, after a barrier,
so that every other check has passed when it fails. A rank that skipped the MPI
call instead would leave the others in it: the job then hangs (the watchdog ends
it) or pairs the next collective with this one (a wrong sum).
"""
import faulthandler
import sys

import mxnet as mx
import numpy as np

import mpi_kvstore
from mpi_kvstore.comm import reduce
from mpi_kvstore.designs import base

from common import RANK, SIZE, WORLD, close, design_arg, done

DESIGN = design_arg()
CASES = ('fused-inplace', 'fused-out', 'single-inplace', 'single-out')
FAILING_RANK = 1
WATCHDOG_S = 90       # a rank left alone in a collective hangs: end the job with stacks
# What the healthy ranks see of the failed collective, by where rank 1 failed.
HEALTHY_RANK_GETS = {'fused': 'sum without the failing rank',
                     'single': 'RankMismatchError'}
# Shapes no other array of the run has: the injected failure finds its target by size.
FUSED_SHAPES = [(5,), (3, 2), (7,), (2, 2)]        # 22 elements in one bucket
SINGLE_SHAPE = (13,)


class Injected(RuntimeError):
    """The local failure this scenario injects."""


# -- the injected failures (armed on the failing rank only) ---------------------------------
class _FailingConcatenate:
    """Stands in for numpy in Reducer._fuse: its concatenate raises once for a bucket
    of ``count`` elements, then hands everything to numpy again."""

    def __init__(self, count):
        self.count, self.armed = count, RANK == FAILING_RANK

    def concatenate(self, views, out):
        if self.armed and out.size == self.count:
            self.armed = False
            raise Injected('rank %d: injected failure while fusing %d elements'
                           % (RANK, self.count))
        return np.concatenate(views, out=out)


def fail_fusion(count):
    """Arm a failure of the next fusion of ``count`` elements; returns the disarm."""
    real = reduce._xp
    fake = _FailingConcatenate(count)
    reduce._xp = lambda array: fake if isinstance(array, np.ndarray) else real(array)
    return lambda: setattr(reduce, '_xp', real)


def fail_attach(nbytes):
    """Arm a failure of the next view of an ``nbytes`` array; returns the disarm.

    The Python op reads arrays through base.flat_view; the native op of funneled and
    concurrent takes the pointer in compiled code and the view through base.view_at:
    both are armed, whichever comes first fails.
    """
    real_flat, real_at = base.flat_view, base.view_at
    armed = [RANK == FAILING_RANK]

    def check(size):
        if armed[0] and size == nbytes:
            armed[0] = False
            raise Injected('rank %d: injected failure reading an array of %d bytes'
                           % (RANK, size))

    def flat_view(array, size, dtype):
        check(size)
        return real_flat(array, size, dtype)

    def view_at(address, dev_type, dev_id, size, dtype, array):
        check(size)
        return real_at(address, dev_type, dev_id, size, dtype, array)

    base.flat_view, base.view_at = flat_view, view_at

    def disarm():
        base.flat_view, base.view_at = real_flat, real_at
    return disarm


# -- one case -------------------------------------------------------------------------------------
def arrays(shapes, value):
    return [mx.nd.full(shape, value, dtype='float32') for shape in shapes]


def exchange(kv, keys, shapes, step, in_place):
    """One pushpull of ``keys`` (a list, or one key); every rank adds (rank + 1) * step."""
    vals = arrays(shapes, (RANK + 1) * step)
    outs = None if in_place else arrays(shapes, -1)
    if isinstance(keys, list):
        kv.pushpull(keys, vals, out=outs)
    else:
        kv.pushpull(keys, vals[0], out=outs[0] if outs else None)
    return vals if in_place else outs


def wait_error(kv):
    """What kv.wait() raises (None if nothing)."""
    try:
        kv.wait()
    except mpi_kvstore.MPIKVStoreError as err:
        return err
    return None


def check_failed(case, err, results):
    """The collective that failed on rank 1, seen by this rank; -> outputs not poisoned."""
    path = case.split('-')[0]
    what = '%s: the failed collective' % case
    if RANK == FAILING_RANK:
        expected = 'the injected failure'
        ok = err is not None and 'injected failure' in str(err)
    elif HEALTHY_RANK_GETS[path] == 'RankMismatchError':
        expected = 'RankMismatchError'
        ok = isinstance(err, mpi_kvstore.RankMismatchError)
    else:
        expected = 'nothing'
        ok = err is None
    if not ok:
        raise AssertionError('rank %d: %s: wait() should raise %s, raised %r'
                             % (RANK, what, expected, err))
    if expected == 'nothing':
        without = sum(r + 1 for r in range(SIZE) if r != FAILING_RANK)
        for res in results:
            close(res, without, '%s: the sum with rank %d sending zeros' % (what, FAILING_RANK))
        return []
    if RANK == FAILING_RANK and path == 'single':
        # The array this rank could not read, it cannot write either (docs/faults.md, MKLDNN layout:
        # an MKLDNN-layout array keeps its value); its error above is what it gets.
        return []
    return ['%s: %s' % (what, res.ravel()[:4]) for res in results if not np.isnan(res).all()]


ERRORS = {}     # for the test: by case, what this rank's wait() raised after the failure


def run_case(kv, case):
    path, mode = case.split('-')
    in_place = mode == 'inplace'
    if path == 'fused':
        keys, shapes = ['%s/%d' % (case, i) for i in range(len(FUSED_SHAPES))], FUSED_SHAPES
        kv.init(keys, arrays(shapes, 0))
        kv.wait()
        disarm = fail_fusion(sum(int(np.prod(s)) for s in shapes))
    else:
        keys, shapes = case, [SINGLE_SHAPE]
        kv.init(keys, arrays(shapes, 0)[0])
        kv.wait()
        disarm = fail_attach(int(np.prod(SINGLE_SHAPE)) * 4)
    try:
        results = exchange(kv, keys, shapes, 1, in_place)
        err = wait_error(kv)
    finally:
        disarm()
    ERRORS[case] = {'type': type(err).__name__ if err is not None else None,
                    'injected': err is not None and 'injected failure' in str(err)}
    unpoisoned = check_failed(case, err, [r.asnumpy() for r in results])
    # The next collective: every rank took part in the failed one, so this one pairs.
    results = exchange(kv, keys, shapes, 10, in_place)
    kv.wait()
    for res in results:
        close(res.asnumpy(), 10 * SIZE * (SIZE + 1) / 2, '%s: the next collective' % case)
    return unpoisoned


def main():
    if SIZE < 2:
        raise SystemExit('fault_local_failure needs at least 2 ranks')
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    cases = sys.argv[2:] or CASES
    # Chained's native op fuses with memcpy and reads arrays in compiled code: no
    # Python step of it can fail, so these injections need its Python op. The one
    # local failure it has, an array it cannot read in place, is kv_native.py's.
    kv = mpi_kvstore.create('dist_mpi', design=DESIGN, native_ops=DESIGN != 'chained')
    unpoisoned = [bad for case in cases for bad in run_case(kv, case)]
    kv.close()
    faulthandler.cancel_dump_traceback_later()
    # Checked last, once every rank passed every other check: a failed collective's
    # outputs hold NaN, never a plausible value.
    WORLD.Barrier()
    if unpoisoned:
        raise AssertionError('rank %d: outputs of failed collectives not poisoned: %s'
                             % (RANK, '; '.join(unpoisoned)))
    done('fault_local_failure[%s]' % DESIGN, errors=ERRORS)


main()
