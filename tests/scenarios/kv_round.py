"""A round's native ops taken up and completed together (designs/negotiated.py _collect,
designs/base.complete_all, designs/repeat.py's compiled copies).

usage: kv_round.py DESIGN [STEPS]

Every step issues one burst back to back, then waits for all of it: 40 tensors of mixed
sizes (1 to 4096 elements) and dtypes (float32, float64, int32, int64, float16), each by
kv.pushpull of its key, a list pushpull of three keys (one engine op of several requests),
or hvd.allreduce_ (Sum, or Average for float dtypes); then a burst of 30 float32 tensors all
averaged (the bet scales its whole sum once) and one of 30 summed. The very same arrays come
back every step with new values (rank r contributes (r + 1) * base), so repeated rounds are
bet on and copied through the kept addresses. Every sum is checked against numpy; the
counters of the round's take-up ('round') and of the bets ('repeat') are reported, and
each tensor's check of the last step.
"""
import sys

import mxnet as mx
import numpy as np

import mpi_kvstore
import mpi_kvstore.horovod as hvd
from mpi_kvstore import debug

from common import RANK, SIZE, close, design_arg, done, report

DESIGN = design_arg()
STEPS = int(sys.argv[2]) if len(sys.argv) > 2 else 6
FACTOR = SIZE * (SIZE + 1) // 2      # sum over ranks of (rank + 1)
FLOATS = ('float32', 'float64', 'float16')

kv = mpi_kvstore.create('dist_mpi', design=DESIGN, autotune='0')
hvd.init(design=DESIGN, autotune='0')
draw = np.random.RandomState(43)     # the same program on every rank
MIXED = [(int(draw.choice((1, 7, 256, 1000, 4096))),
          str(draw.choice(('float32', 'float64', 'int32', 'int64', 'float16'))),
          str(draw.choice(('pushpull', 'list', 'hvd')))) for _ in range(40)]
AVERAGED = [(int(draw.choice((16, 256, 4096))), 'float32', 'average') for _ in range(30)]
SUMMED = [(int(draw.choice((16, 256, 4096))), 'float32', 'sum') for _ in range(30)]


def run_burst(name, program, step):
    arrays = ARRAYS[name]
    wanted = []
    for i, (count, dtype, api) in enumerate(program):
        base = (np.arange(count) + i + step) % 7
        arrays[i][:] = (base * (RANK + 1)).astype(dtype)
        average = api in ('hvd', 'average') and dtype in FLOATS
        wanted.append(base * (FACTOR / SIZE if average else FACTOR))
        for j, extra in enumerate(LISTED.get('%s.%d' % (name, i), ())):
            extra[:] = (RANK + 1) * (j + step)
    for i, (_, dtype, api) in enumerate(program):
        key = '%s.%d' % (name, i)
        if api == 'list':
            keys = ['%s.%d.%d' % (name, i, j) for j in range(3)]
            kv.pushpull(keys, [arrays[i]] + LISTED[key])
        elif api == 'pushpull':
            kv.pushpull(key, arrays[i], priority=-i)
        else:
            average = api in ('hvd', 'average') and dtype in FLOATS
            hvd.allreduce_(arrays[i], name=key, op=hvd.Average if average else hvd.Sum)
    for array in arrays:
        array.wait_to_read()
    for i, (array, want) in enumerate(zip(arrays, wanted)):
        dtype = program[i][1]
        what = '%s tensor %d (%s %s)' % (name, i, dtype, program[i][2])   # the last step's kept
        close(array.asnumpy(), want, what, rtol=1e-3 if dtype == 'float16' else 1e-6, atol=0)
        for j, extra in enumerate(LISTED.get('%s.%d' % (name, i), ())):
            close(extra.asnumpy(), FACTOR * (j + step), what + ' extra %d' % j)


ARRAYS, LISTED = {}, {}
for name, program in (('mixed', MIXED), ('averaged', AVERAGED), ('summed', SUMMED)):
    ARRAYS[name] = [mx.nd.zeros((count,), dtype=dtype) for count, dtype, _ in program]
    for i, (_, _, api) in enumerate(program):
        if api == 'list':
            LISTED['%s.%d' % (name, i)] = [mx.nd.zeros((5,), dtype='float32') for _ in range(2)]

before = debug.snapshot()
for step in range(STEPS):
    for name, program in (('mixed', MIXED), ('averaged', AVERAGED), ('summed', SUMMED)):
        run_burst(name, program, step)
kv.wait()
report('kv_round_info', round=debug.since(before, 'round'), repeat=debug.since(before, 'repeat'))
done('kv_round[%s]' % DESIGN)
hvd.shutdown()
kv.close()
