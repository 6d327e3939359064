"""A grouped hvd.allreduce_ that one rank cuts into more engine ops than another: its list
has an aliased member (the same array twice: the second goes through a staging buffer) or a
sparse one, so that rank pushes one op a tensor while the others push the group as one op
(store/collectives.py, allreduce's one_op).

The designs that agree op by op (chained, blocking) find 'rank 0 issued 1, rank 1 issued 3'
and fail the call on every rank, naming both; chained then fails the rest of the parted
call unagreed (Design.parted), so the ranks meet again at their next call. Before, the
rank with more ops agreed its rest with the others' next calls: every call after failed,
and the last waited for a partner until the stall inspector. The designs that agree
request by request (funneled, concurrent) run the call: the sums are numpy's.

usage: hvd_group_parted.py DESIGN [python]   (python: native_ops off, chained's Python op)

For the aliased rank 0, then 1 (a sparse member on rank 1 last), each with a call of the
group before it in the same burst and two after it (no wait between them): the group's
calls before and after, and an unrelated group's, sum as numpy on every rank.
"""
import sys

import mxnet as mx

import mpi_kvstore
import mpi_kvstore.horovod as hvd

from common import RANK, SIZE, close, design_arg, done, expect_raises

DESIGN = design_arg()
OPTIONS = {'native_ops': False} if sys.argv[2:] == ['python'] else {}
SHAPES = [(16,), (16,), (4, 3)]
FACTOR = SIZE * (SIZE + 1) // 2      # sum over ranks of (rank + 1)
PARTS = (('aliased', 0), ('aliased', 1), ('sparse', 1))
AGREES_BY_OP = DESIGN in ('chained', 'blocking')

hvd.init(design=DESIGN, autotune='0', **OPTIONS)
store = hvd.global_process_set._store


def fill(xs, step):
    for i, x in enumerate(xs):
        x[:] = (i + 1 + step) * (RANK + 1)


def check(xs, step, what, first=0):
    for i, x in enumerate(xs, first):
        close(x.asnumpy(), (i + 1 + step) * FACTOR, '%s, tensor %d, step %d' % (what, i, step))


def parted(how, odd, round_):
    """One part: the group 'p' right, then on rank ``odd`` the list with an aliased or sparse
    member; the calls after it (unwaited: queued behind it) right again."""
    xs = [mx.nd.zeros(shape) for shape in SHAPES]
    name = 'p%d' % round_
    fill(xs, 0)
    hvd.grouped_allreduce_(xs, name=name, op=hvd.Sum)
    store.wait()
    check(xs, 0, '%s %d before' % (how, odd))
    ys = list(xs)
    if RANK == odd:
        ys[1] = ys[0] if how == 'aliased' else mx.nd.zeros(SHAPES[1]).tostype('row_sparse')
    fill(ys, 1)
    other = [mx.nd.ones((3,)) * (RANK + 1), mx.nd.ones((2,)) * (RANK + 1)]
    after = [mx.nd.zeros(shape) for shape in SHAPES]
    fill(after, 2)

    def calls():
        hvd.grouped_allreduce_(ys, name=name, op=hvd.Sum)
        hvd.grouped_allreduce_(other, name='other%d' % round_, op=hvd.Sum)
        hvd.grouped_allreduce_(after, name=name, op=hvd.Sum)
        store.wait()

    if AGREES_BY_OP:
        # chained: raised by the wait, the calls queued behind the parted one ran
        said = str(expect_raises(mpi_kvstore.RankMismatchError, calls))
        if DESIGN == 'blocking':
            # raised by the next op submitted (the rank with more ops: the parted call's
            # own; the other: 'other'), so none of the calls after it ran: again, unwaited
            hvd.grouped_allreduce_(other, name='other%d' % round_, op=hvd.Sum)
            hvd.grouped_allreduce_(after, name=name, op=hvd.Sum)
            store.wait()
    else:
        said = None
        calls()
        # the parted call itself: numpy's sums where this rank's list has no alias
        if RANK != odd or how == 'sparse':
            check(ys[2:], 1, '%s %d parted' % (how, odd), 2)
        if RANK != odd:   # an aliased rank sent its one array's last value, tensor 1's
            sent = 3 * (odd + 1) if how == 'aliased' else None
            for i, x in enumerate(ys[:2]):
                want = sum((i + 2) * (r + 1) if sent is None or r != odd else sent
                           for r in range(SIZE))
                close(x.asnumpy(), want, '%s %d parted, tensor %d' % (how, odd, i))
    for x in other:
        close(x.asnumpy(), FACTOR, '%s %d other' % (how, odd))
    check(after, 2, '%s %d after' % (how, odd))
    fill(xs, 3)   # the group on its very arrays again, the same on every rank
    hvd.grouped_allreduce_(xs, name=name, op=hvd.Sum)
    store.wait()
    check(xs, 3, '%s %d again' % (how, odd))
    return said


said = [parted(how, odd, i) for i, (how, odd) in enumerate(PARTS)]
done('hvd_group_parted[%s]' % DESIGN, said=said)
hvd.shutdown()
