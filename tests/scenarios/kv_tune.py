"""The tune table end to end: `tune` writes one, the store loads it (rank 0 reads, all get
it), each size takes its algorithm, and the sums stay numpy's, in every design."""
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


# 1. the command writes a table this job can load
out = os.path.join(folder, 'measured.json')
assert tune.main(['--sizes', '4K,256K', '--trials', '2', '--out', out]) == 0
WORLD.Barrier()
measured = json.load(open(out))
assert measured['comm_size'] == SIZE and [r['bytes'] for r in measured['allreduce']] == [4096, 262144]
assert set(measured['measured_ms']['4096']) >= {'mpi', 'rsag'}, measured['measured_ms']

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
done('kv_tune[%s]' % DESIGN)
