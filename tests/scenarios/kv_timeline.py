"""MPI_KVSTORE_TIMELINE writes a valid Chrome trace per rank with every collective.

usage: kv_timeline.py DESIGN PATH
"""
import itertools
import json
import sys

import mxnet as mx

import mpi_kvstore
from mpi_kvstore.comm.timeline import trace_path

from common import RANK, SIZE, WORLD, done

design, path = sys.argv[1], sys.argv[2]
kv = mpi_kvstore.create('dist_mpi', design=design, timeline=path)
keys = ['w%d' % i for i in range(5)]
kv.init(keys, [mx.nd.zeros((100 * (i + 1),)) for i in range(5)])
for _step in range(3):
    for i, k in enumerate(keys):
        kv.pushpull(k, mx.nd.ones((100 * (i + 1),)), priority=-i)
kv.close()
WORLD.Barrier()

trace = json.load(open(trace_path(path, RANK, SIZE)))
events = [e for e in trace['traceEvents'] if e['ph'] == 'X']
by_name = {}
for e in events:
    by_name.setdefault(e['name'], []).append(e)
    assert e['pid'] == RANK and e['dur'] >= 0 and e['ts'] >= 0, e
collectives = 5 + 15                                   # init broadcasts + pushpulls
assert len(by_name['mpi_kvstore.bcast']) == 5, sorted(by_name)
assert len(by_name['mpi_kvstore.allreduce']) == 15, sorted(by_name)
assert len(by_name['QUEUED']) == len(by_name['NEGOTIATE']) == collectives
for seq in range(collectives):                         # phases of one collective in order
    phases = sorted((e for e in events if e['args']['seq'] == seq), key=lambda e: e['ts'])
    assert [p['name'] for p in phases][:2] == ['QUEUED', 'NEGOTIATE'], phases
    for a, b in itertools.pairwise(phases):
        assert a['ts'] + a['dur'] <= b['ts'] + 1.0, (a, b)
names = {m['args']['name'] for m in trace['traceEvents'] if m['ph'] == 'M'}
assert 'rank %d' % RANK in names and "key 'w0'" in names, names
done('kv_timeline[%s]' % design, events={name: len(of) for name, of in by_name.items()})
