"""Ranks given different options raise ConfigError together at store creation, naming each
option that differs with every rank's value and where it came from; ranks given the same
options (or options that may differ) get a store that sums as numpy does.

usage: kv_agree.py [CASE ...]   (every case when none is named)
"""
import json
import os
import sys
import tempfile
import time

import mxnet as mx
import numpy as np
from mpi4py import MPI

import mpi_kvstore

from common import RANK, SIZE, close, done, expect_raises

WORLD = MPI.COMM_WORLD


def sums_right(kv, key):
    """A store that was created works: a pushpull gives numpy's sum on every rank."""
    value = mx.nd.array(np.arange(7, dtype=np.float32) + RANK)
    kv.pushpull(key, value)
    close(value.asnumpy(), np.arange(7) * SIZE + SIZE * (SIZE - 1) / 2, key)


def refused(contains, *args, **options):
    """ConfigError on every rank, within seconds, naming ``contains`` -> its message."""
    start = time.monotonic()
    err = expect_raises(mpi_kvstore.ConfigError, mpi_kvstore.create, 'dist_mpi', *args,
                        **options)
    took = time.monotonic() - start
    message = str(err)
    for word in contains:
        if word not in message:
            raise AssertionError('rank %d: %r is not in the message: %s' % (RANK, word, message))
    if took > 30:     # about a second on a busy 2-core machine; a hang meets the job's timeout
        raise AssertionError('rank %d: the refusal took %.1f s' % (RANK, took))
    return message


def with_env(name, value, fn):
    """Run ``fn`` with environment variable ``name`` set to ``value`` (None: unset)."""
    before = os.environ.pop(name, None)
    if value is not None:
        os.environ[name] = value
    try:
        return fn()
    finally:
        os.environ.pop(name, None)
        if before is not None:
            os.environ[name] = before


def case_design():
    """Rank 0 passes design='funneled', the others get 'chained' from their environment."""
    if RANK == 0:
        message = refused(['design', "'funneled' on rank 0 (argument)", "'chained'",
                           'environment variable MPI_KVSTORE_DESIGN'], design='funneled')
    else:
        message = with_env('MPI_KVSTORE_DESIGN', 'chained', lambda: refused(
            ['design', "'funneled' on rank 0 (argument)", "'chained' on rank"]))
    want = 'rank 1' if SIZE == 2 else 'ranks 1-%d' % (SIZE - 1)
    if "'chained' on %s (environment variable MPI_KVSTORE_DESIGN)" % want not in message:
        raise AssertionError('rank %d: the chained ranks are not grouped: %s' % (RANK, message))
    # Nothing else differs, so nothing else is named.
    for other in ('fusion_threshold', 'partition_bytes', 'tune_table', 'version'):
        if other in message:
            raise AssertionError('rank %d: %s named though equal: %s' % (RANK, other, message))
    # A store of agreed options is made and sums right after the refusal.
    kv = mpi_kvstore.create('dist_mpi', design='chained')
    sums_right(kv, 'after_design')
    kv.close()


def case_several():
    """Two options differ at once, one of them only on the last rank: both are named."""
    last = RANK == SIZE - 1
    refused(['compression', 'fusion_threshold', "'fp16' on rank %d" % (SIZE - 1),
             '64K on rank', '1M on rank'],
            fusion_threshold='64K' if RANK == 0 else '1M',
            compression='fp16' if last else 'none')


def case_invalid():
    """An invalid option on one rank only: every rank raises, naming it, instead of the
    valid ranks waiting in their first collective for the one that raised."""
    bad = RANK == SIZE - 1
    message = with_env('MPI_KVSTORE_DESIGN', 'ring' if bad else None, lambda: refused(
        ['options', "environment variable MPI_KVSTORE_DESIGN='ring'", 'valid on rank']))
    if 'design:' in message:
        raise AssertionError('rank %d: options of an invalid rank were compared: %s'
                             % (RANK, message))


def case_may_differ():
    """Options that may differ (stall_warning, timeline) and options a design does not read
    (lanes under funneled) do not refuse a store."""
    folder = WORLD.bcast(tempfile.mkdtemp(prefix='kv_agree_') if RANK == 0 else None)
    kv = mpi_kvstore.create('dist_mpi', design='funneled', stall_warning=30 + RANK,
                            lanes=1 + RANK, timeline=os.path.join(folder, 'tl%d.json' % RANK))
    sums_right(kv, 'may_differ')
    kv.close()
    # ... but lanes do refuse the concurrent design, which opens one communicator a lane.
    refused(['lanes', '1 on rank 0'], design='concurrent', lanes=1 + RANK)


def case_auto():
    """'auto' and an explicit value are different options, even where they would resolve
    alike: the ranks were given different things."""
    refused(['partition_bytes', "'auto' on rank 0 (default)", '0 on rank'],
            partition_bytes=None if RANK == 0 else 0)


def case_tune_table():
    """Rank 0 reads the tune table and broadcasts it: every rank must be given one or none,
    and a rank that can read its own path must find rank 0's content there."""
    folder = WORLD.bcast(tempfile.mkdtemp(prefix='kv_agree_') if RANK == 0 else None)
    table = {'version': 1, 'comm_size': SIZE, 'measured_ms': {},
             'allreduce': [{'bytes': 1024, 'algorithm': 'mpi'}]}
    other = dict(table, allreduce=[{'bytes': 1024, 'algorithm': 'rsag'}])
    if RANK == 0:
        for name, payload in (('a.json', table), ('b.json', table), ('c.json', other)):
            with open(os.path.join(folder, name), 'w') as fh:
                json.dump(payload, fh)
    WORLD.Barrier()
    # The same content under two paths, and a path that only rank 0 can read: agreed.
    for theirs in ('b.json', 'not-on-this-host.json'):
        mine = os.path.join(folder, 'a.json' if RANK == 0 else theirs)
        kv = mpi_kvstore.create('dist_mpi', tune_table=mine)
        sums_right(kv, 'table_' + theirs)
        kv.close()
    # Different content: refused, naming both paths.
    mine = os.path.join(folder, 'a.json' if RANK == 0 else 'c.json')
    refused(['tune_table', 'a.json', 'c.json', 'content sha256'], tune_table=mine)
    # A table on one rank only: refused (it would send allreduces another way).
    refused(['tune_table', 'none on rank'], tune_table=mine if RANK == 0 else '')


def case_subcomm():
    """A store on a sub-communicator compares its own ranks only: the even ranks agree and
    get a store while the odd ranks, who disagree among themselves, are refused."""
    sub = WORLD.Split(RANK % 2, RANK)
    odd = RANK % 2 == 1
    if odd and sub.Get_size() > 1:
        refused(['fusion_threshold'], comm=sub, fusion_threshold=1024 * (sub.Get_rank() + 1))
    else:
        kv = mpi_kvstore.create('dist_mpi', comm=sub, fusion_threshold=4096 * (RANK % 2 + 1))
        value = mx.nd.array(np.full(5, RANK, dtype=np.float32))
        kv.pushpull('sub', value)
        members = list(range(RANK % 2, SIZE, 2))
        close(value.asnumpy(), sum(members), 'sub')
        kv.close()
    sub.Free()


def case_horovod():
    """mpi_kvstore.horovod's init makes its store from Horovod's variables: ranks whose
    variables differ are refused alike, and its process sets are stores on
    sub-communicators of the agreed options."""
    import mpi_kvstore.horovod as hvd
    name = 'HOROVOD_FUSION_THRESHOLD'
    err = with_env(name, str(1 << 16) if RANK == 0 else None, lambda: expect_raises(
        mpi_kvstore.ConfigError, hvd.init))
    # (init hands Horovod's variables to the store as arguments)
    others = 'rank 1' if SIZE == 2 else 'ranks 1-%d' % (SIZE - 1)
    for word in ('fusion_threshold: 64K on rank 0 (argument), 1M on %s (default)' % others,):
        if word not in str(err):
            raise AssertionError('rank %d: %r not in %s' % (RANK, word, err))
    hvd.init()
    members = list(range(SIZE - 1)) or [0]
    ps = hvd.add_process_set(members)
    if RANK in members:
        out = hvd.allreduce(mx.nd.full((3,), RANK + 1), op=hvd.Sum, process_set=ps)
        close(out.asnumpy(), sum(r + 1 for r in members), 'process set')
    hvd.shutdown()


CASES = {name[len('case_'):]: fn for name, fn in sorted(globals().items())
         if name.startswith('case_')}

for case in sys.argv[1:] or list(CASES):
    CASES[case]()
    WORLD.Barrier()
done('kv_agree[%s]' % ', '.join(sys.argv[1:] or CASES))
