"""The tune table end to end: `tune` writes one (allreduce and the other collectives'
rows), the store loads it (rank 0 reads, all get it), each size takes its algorithm, and
the sums stay numpy's, in every design. Then the other collectives' rows: init, a
broadcast from the last rank, and the array collectives (bcast, allgather, reducescatter)
of odd sizes and several dtypes take the table's choice by size, against numpy."""
import json
import os
import tempfile

import mxnet as mx
import numpy as np
from mpi4py import MPI

import mpi_kvstore
from mpi_kvstore import debug
from mpi_kvstore.cli import tune
from mpi_kvstore.comm import tuning

from common import RANK, SIZE, design_arg, done, expect_raises

DESIGN = design_arg()
WORLD = MPI.COMM_WORLD
folder = WORLD.bcast(tempfile.mkdtemp(prefix='kv_tune_') if RANK == 0 else None)


def write(name, payload):
    path = os.path.join(folder, name)
    if RANK == 0:
        with open(path, 'w') as fh:
            json.dump(payload, fh)
    WORLD.Barrier()
    return path


# 1. the command writes a table this job can load (once: the command is the same in
# every design)
if DESIGN == 'funneled':
    out = os.path.join(folder, 'measured.json')
    assert tune.main(['--sizes', '4K,600K', '--trials', '2', '--out', out]) == 0
    WORLD.Barrier()
    measured = json.load(open(out))
    assert measured['comm_size'] == SIZE and [r['bytes'] for r in measured['allreduce']] == [4096, 614400]
    assert set(measured['measured_ms']['4096']) >= {'mpi', 'rsag'}, measured['measured_ms']
    assert sorted(measured['ops']) == sorted(tuning.OPS), measured['ops']
    for op, rows in measured['ops'].items():
        assert [r['bytes'] for r in rows] == [4096, 614400], (op, rows)
    # chunks of 256 KB fit in 600 KB: both chunked broadcasts were timed there
    assert {'flat', 'pipelined/262144', 'chain/262144'} <= set(measured['ops_ms']['broadcast']['614400'])
    assert tuning.Table.from_json(measured).choose_op('alltoall', 1).algorithm == 'mpi'

# 2. a table that sends middle sizes through reduce-scatter + allgather
table = {'version': 1, 'comm_size': SIZE, 'measured_ms': {},
         'allreduce': [{'bytes': 1024, 'algorithm': 'mpi'}, {'bytes': 65536, 'algorithm': 'rsag'},
                       {'bytes': 1 << 22, 'algorithm': 'mpi'}],
         # device rows (tune writes them where every rank has a GPU): host buffers ignore them
         'device': [{'bytes': 4096, 'transport': 'nccl'}, {'bytes': 1 << 26, 'transport': 'staged'}]}
path = write('table.json', table)
if RANK != 0:
    path = path + '.only-rank-0-reads-it'        # another rank's path need not exist
kv = mpi_kvstore.create('dist_mpi', design=DESIGN, tune_table=path)
before = debug.snapshot()
chooser = tuning.Table.from_json(table)
assert [chooser.choose_device(n) for n in (4, (1 << 19) - 1, 1 << 19, 1 << 30)] == ['nccl', 'nccl', 'staged', 'staged']
for n in (1, 255, 4096, 16384, 100000, 1 << 20):       # float32 elements: 4 B to 4 MB
    assert chooser.choose(4 * n) in ('mpi', 'rsag')
    value = mx.nd.array(np.arange(n, dtype=np.float32) * (RANK + 1))
    kv.pushpull('k%d' % n, value)
    expected = np.arange(n, dtype=np.float64) * SIZE * (SIZE + 1) / 2
    np.testing.assert_allclose(value.asnumpy(), expected, rtol=1e-6,
                               err_msg='%d floats through %s' % (n, chooser.choose(4 * n)))
keys = ['f%d' % i for i in range(5)]                    # a fused bucket of 5 x 16 KB: rsag
values = [mx.nd.ones((4096,)) * (RANK + i) for i in range(5)]
kv.pushpull(keys, values)
for i, v in enumerate(values):
    np.testing.assert_allclose(v.asnumpy(), sum(r + i for r in range(SIZE)))
kv.wait()
ran = dict({'mpi': 0, 'rsag': 0}, **debug.since(before, 'algorithm'))
# each size took its algorithm (chained's compiled op runs the 'mpi' ones itself)
assert ran['rsag'] >= 3 and (ran['mpi'] >= 2 or DESIGN == 'chained'), ran
kv.close()

# 3. a table of another size is ignored; a bad file fails on every rank alike
other = write('other.json', dict(table, comm_size=SIZE + 1))
kv = mpi_kvstore.create('dist_mpi', design=DESIGN, tune_table=other)
x = mx.nd.ones((10,))
kv.pushpull('x', x)
np.testing.assert_array_equal(x.asnumpy(), SIZE)
kv.close()
bad = write('bad.json', {'version': 1, 'comm_size': SIZE,
                         'allreduce': [{'bytes': 4, 'algorithm': 'carrier-pigeon'}]})
expect_raises(mpi_kvstore.ConfigError, mpi_kvstore.create, 'dist_mpi', design=DESIGN,
              tune_table=bad, contains='carrier-pigeon')

# 4. the other collectives' rows: broadcasts below 64 B flat, then Ibcast chunks of 1000 B,
# then chains of 4 KB chunks, then through the hosts (one host here: Ibcasts of 64 KB)
ops = {'broadcast': [{'bytes': 1, 'algorithm': 'flat'},
                     {'bytes': 4096, 'algorithm': 'pipelined', 'chunk_bytes': 1000},
                     {'bytes': 65536, 'algorithm': 'chain', 'chunk_bytes': 4096},
                     {'bytes': 1 << 20, 'algorithm': 'hierarchical', 'chunk_bytes': 65536}],
       'allgather': [{'bytes': 4, 'algorithm': 'hierarchical'}],
       'reducescatter': [{'bytes': 4, 'algorithm': 'hierarchical'}]}
kv = mpi_kvstore.create('dist_mpi', design=DESIGN, tune_table=write('ops.json', dict(table, ops=ops)))
chooser = tuning.Table.from_json(dict(table, ops=ops))
before = debug.snapshot()
CASES = [(3, 'float32'), (1001, 'float16'), (1001, 'float32'), (10007, 'int32'),
         (100003, 'float32'), (20011, 'float64')]


def data(n, dtype, rank):
    return (np.arange(n) % 251 * (rank + 1) + rank).astype(dtype)


for n, dtype in CASES:
    key = 'b%d%s' % (n, dtype)
    value = mx.nd.array(data(n, dtype, RANK), dtype=dtype)
    kv.init(key, value)                       # rank 0's value into the store
    out = mx.nd.zeros((n,), dtype=dtype)
    kv.pull(key, out=out)
    np.testing.assert_array_equal(out.asnumpy(), data(n, dtype, 0), err_msg=key)
    mine = mx.nd.array(data(n, dtype, RANK), dtype=dtype)
    kv.broadcast(key, mine, root=SIZE - 1)      # in place (out=None)
    np.testing.assert_array_equal(mine.asnumpy(), data(n, dtype, SIZE - 1), err_msg=key)
    arr = mx.nd.array(data(n, dtype, RANK), dtype=dtype)
    kv.collectives.array('bcast', 'a' + key, arr, root=SIZE - 1)
    np.testing.assert_array_equal(arr.asnumpy(), data(n, dtype, SIZE - 1), err_msg='a' + key)
    if dtype == 'float32':
        whole = mx.nd.array(data(n, dtype, RANK), dtype=dtype)
        kv.collectives.array('reducescatter', 'rs' + key, whole)
        share = np.array_split(np.arange(n), SIZE)[RANK]
        np.testing.assert_allclose(whole.asnumpy()[share],
                                   sum(data(n, 'float64', r) for r in range(SIZE))[share],
                                   rtol=1e-6, err_msg='rs' + key)
        gathered = mx.nd.array(data(n, dtype, RANK), dtype=dtype)
        kv.collectives.array('allgather', 'ag' + key, gathered)
        owner = np.concatenate([np.full(len(s), r) for r, s in
                                enumerate(np.array_split(np.arange(n), SIZE))])
        np.testing.assert_array_equal(gathered.asnumpy(),
                                      (np.arange(n) % 251 * (owner + 1) + owner).astype(dtype),
                                      err_msg='ag' + key)
kv.wait()
ran = debug.since(before, 'algorithm')
chosen = {chooser.choose_op('broadcast', n * np.dtype(d).itemsize).algorithm for n, d in CASES}
assert chosen == {'flat', 'pipelined', 'chain', 'hierarchical'}, chosen
# one host: 'hierarchical' rows take Ibcasts of their chunk (chained's compiled op sends
# the flat ones itself, as one MPI_Bcast, uncounted)
want = {'broadcast pipelined', 'broadcast chain'} | (
    set() if DESIGN == 'chained' else {'broadcast flat'})
assert want <= set(ran), ran
assert 'broadcast hierarchical' not in ran and 'hierarchical allgather' not in ran, ran
kv.close()
done('kv_tune[%s]' % DESIGN, chosen=sorted(chosen), ran=ran)
