"""Priority-partitioned scheduling (partition_bytes, credit_bytes) under mpiexec.

Parts, each on stores of its own, each checked on every rank:
- sums: keys of odd sizes and every float and int dtype, per-key calls of different
  priorities and one multi-key call, three iterations, under three option sets (cut and
  held back; cut, all at once, averaged; held back only), equal to numpy's sums of what
  every rank contributed (deterministic per-rank data, exact in every dtype); funneled
  and concurrent must count cut requests and held-back dispatches (debug 'schedule'),
  chained and blocking ignore the options and count nothing;
- compression: fp16 wire casting and 2-bit (one-phase, and two-phase from 2 ranks on)
  give bitwise the results of an unpartitioned store over several iterations;
- overtake (funneled, concurrent): a small priority-0 pushpull made right after a large
  priority -10 one ends, in the timeline, before the large one's last piece starts;
- join: rank r has 2 + r steps, then joins; sums cover the active ranks, no deadlock.

usage: kv_schedule.py DESIGN TRACE_PATH [PART ...]   (default: every part)
"""
import json
import sys
import zlib

import mxnet as mx
import numpy as np

import mpi_kvstore
from mpi_kvstore import debug
from mpi_kvstore.comm.timeline import trace_path
from mpi_kvstore.config import parse_bytes

from common import RANK, SIZE, WORLD, close, design_arg, done, same_on_all_ranks

DESIGN = design_arg()
# may name the design and the size, as {design} and {size}: one job runs every design
TRACE = sys.argv[2].format(design=DESIGN, size=SIZE)
PARTS = sys.argv[3:] or ['sums', 'compression', 'overtake', 'join']
SCHEDULED = DESIGN in ('funneled', 'concurrent')    # the designs that read the options
ITERS = 3

# key: (elements, dtype, priority) of the per-key calls
KEYS = {'one': (1, 'float32', 3), 'h1023': (1023, 'float16', -1),
        'd4097': (4097, 'float64', 0), 'i4097': (4097, 'int32', -2),
        'f100003': (100003, 'float32', -5), 'l20011': (20011, 'int64', 1)}
# key: (elements, dtype) of the multi-key call, made at priority -3
GROUP = {'g_f4097': (4097, 'float32'), 'g_l1023': (1023, 'int64'),
         'g_h30011': (30011, 'float16'), 'g_i1': (1, 'int32')}


def data(rank, it, key, count, dtype):
    """Rank ``rank``'s values: floats are multiples of 1/8 below 8 in size, whose sums over
    at most 4 ranks are exact even in float16."""
    rng = np.random.default_rng([rank, it, zlib.crc32(key.encode())])
    if np.dtype(dtype).kind == 'i':
        return rng.integers(-1000, 1000, count).astype(dtype)
    return (rng.integers(-64, 64, count) / 8).astype(dtype)


def expected(it, key, count, dtype, average, ranks=range(SIZE)):
    total = sum(data(r, it, key, count, np.float64 if np.dtype(dtype).kind == 'f' else np.int64)
                for r in ranks).astype(dtype)
    if average:                         # as the reducer averages (reduce.Reducer._average)
        if total.dtype.itemsize == 2:   # float16 in float32, by 1/SIZE in float32 (reduce.scale)
            total = (total.astype(np.float32) * np.float32(1.0 / SIZE)).astype(total.dtype)
        elif total.dtype.kind == 'f':
            total *= 1.0 / SIZE
        else:
            total //= SIZE
    return total


def cut_per_iteration(partition):
    """How many requests of one iteration are larger than ``partition`` bytes."""
    sizes = [n * np.dtype(t).itemsize for n, t, _ in KEYS.values()]
    sizes += [n * np.dtype(t).itemsize for n, t in GROUP.values()]
    return sum(s > partition for s in sizes)


def sums(partition, credit, average):
    kv = mpi_kvstore.create('dist_mpi', design=DESIGN, partition_bytes=partition,
                            credit_bytes=credit, average=average)
    what = 'partition_bytes=%r credit_bytes=%r average=%s' % (partition, credit, average)
    before = debug.snapshot()
    for it in range(ITERS):
        arrays = {k: mx.nd.array(data(RANK, it, k, n, t), dtype=t) for k, (n, t, _) in KEYS.items()}
        group = {k: mx.nd.array(data(RANK, it, k, n, t), dtype=t) for k, (n, t) in GROUP.items()}
        for key, (_, _, priority) in KEYS.items():
            kv.pushpull(key, arrays[key], priority=priority)
        kv.pushpull(list(group), list(group.values()), priority=-3)
        table = dict(KEYS, **{k: v + (-3,) for k, v in GROUP.items()})
        for key, array in list(arrays.items()) + list(group.items()):
            count, dtype, _ = table[key]
            got = array.asnumpy()
            want = expected(it, key, count, dtype, average)
            assert got.dtype == want.dtype, (key, got.dtype)
            if not np.array_equal(got, want):
                bad = np.flatnonzero(got != want)
                raise AssertionError('rank %d: %s, iteration %d, key %s: %d of %d elements '
                                     'differ, first at %d: got %s, expected %s'
                                     % (RANK, what, it, key, bad.size, count, bad[0],
                                        got[bad[0]], want[bad[0]]))
    kv.wait()
    counted = debug.since(before, 'schedule')
    kv.close()
    if not SCHEDULED:
        assert counted == {}, '%s ignores the options, yet counted %s' % (DESIGN, counted)
        return
    cut = cut_per_iteration(parse_bytes(partition)) * ITERS if partition else 0
    assert counted.get('pieces_cut', 0) == cut, (what, counted, cut)
    assert (counted.get('held_back', 0) > 0) == bool(credit), (what, counted)


COMPRESSED = {'c4097': (4097, 'float32'), 'c30011': (30011, 'float32'),
              'c1023': (1023, 'float32')}
COMPRESSED_GROUP = {'cg5000': (5000, 'float32'), 'cg_d3000': (3000, 'float64')}
COMPRESSED_ITERS = 3


def compressed_run(options, two_bit):
    """Each iteration's results of one store: per-key calls, then one multi-key call."""
    kv = mpi_kvstore.create('dist_mpi', design=DESIGN, **options)
    if two_bit:
        kv.set_gradient_compression({'type': '2bit', 'threshold': 0.5})
    before = debug.snapshot()
    results = []
    for it in range(COMPRESSED_ITERS):
        def grad(key, count, dtype, it=it):
            rng = np.random.default_rng([RANK, it, zlib.crc32(key.encode())])
            return mx.nd.array(rng.standard_normal(count) * 0.6, dtype=dtype)
        arrays = {k: grad(k, n, t) for k, (n, t) in COMPRESSED.items()}
        group = {k: grad(k, n, t) for k, (n, t) in COMPRESSED_GROUP.items()}
        for i, key in enumerate(arrays):
            kv.pushpull(key, arrays[key], priority=-i)
        kv.pushpull(list(group), list(group.values()), priority=1)
        results.append({k: a.asnumpy() for k, a in list(arrays.items()) + list(group.items())})
    kv.wait()
    counted = debug.since(before, 'schedule')
    kv.close()
    return results, counted


def exact_sum(it, key, count, dtype):
    return sum(np.random.default_rng([r, it, zlib.crc32(key.encode())]).standard_normal(count)
               * 0.6 for r in range(SIZE)).astype(dtype)


def compression():
    variants = [('fp16', {'compression': 'fp16'}, False),
                ('2bit', {}, True),
                ('2bit two-phase', {'two_phase_min_ranks': 2}, True)]
    for name, options, two_bit in variants:
        plain, _ = compressed_run(options, two_bit)
        parted, counted = compressed_run(dict(options, partition_bytes='4K', credit_bytes='8K'),
                                         two_bit)
        if SCHEDULED:
            # Cut: what is over 4 KB on the wire. fp16: 2 bytes a value (c4097, c30011, cg5000
            # and cg_d3000); 2-bit: a sixteenth of float32 (c30011), float64 uncompressed
            # (cg_d3000).
            wire = {'float32': 2 if name == 'fp16' else 0.25,
                    'float64': 2 if name == 'fp16' else 8}
            cut = sum(n * wire[t] > 4096 for n, t in dict(COMPRESSED, **COMPRESSED_GROUP).values())
            assert cut == (4 if name == 'fp16' else 2), cut
            assert counted.get('pieces_cut', 0) == cut * COMPRESSED_ITERS, (name, counted)
            assert counted.get('held_back', 0) > 0, (name, counted)
        for it, (want, got) in enumerate(zip(plain, parted)):
            for key, value in got.items():
                what = '%s, iteration %d, key %s' % (name, it, key)
                same_on_all_ranks(value, what)
                if not np.array_equal(value, want[key]):
                    diff = np.abs(value.astype(np.float64) - want[key])
                    raise AssertionError('rank %d: %s: partitioned differs from unpartitioned '
                                         'in %d elements (max %g)'
                                         % (RANK, what, np.count_nonzero(diff), diff.max()))
                count, dtype = dict(COMPRESSED, **COMPRESSED_GROUP)[key]
                if name == 'fp16' or dtype == 'float64':   # 2-bit leaves float64 exact
                    close(value, exact_sum(it, key, count, dtype), what, rtol=1e-2, atol=1e-2)
                else:   # sums of -0.5, 0 and 0.5 over the ranks, not all 0
                    assert np.array_equal(value * 2, np.round(value * 2)), what
                    assert np.abs(value).max() <= 0.5 * SIZE and value.any(), what


BIG = 1000000          # float32 elements: 4 MB, 62 pieces of 64 KB
PIECE = 64 << 10


# Pieces of the large request that may start after the small one is ready on every rank
# and before it runs: the one round whose agreement was already under way, and one more for
# the clocks of ranks read a few microseconds apart.
IN_FLIGHT = 2


def overtake():
    """A small high-priority request overtakes the large one's pieces that had not started
    when it was ready on every rank. When each rank gets there is up to its main thread and
    engine: on a busy machine one rank may push the small request only after the large
    one's pieces have all run, so the check counts only the pieces started after the last
    rank had it ready (the traces' clocks are each rank's perf_counter, one clock on one
    machine)."""
    kv = mpi_kvstore.create('dist_mpi', design=DESIGN, timeline=TRACE, partition_bytes=PIECE,
                            credit_bytes=PIECE)
    t0 = kv.timeline._t0            # the trace's zero on this rank, in perf_counter seconds
    before = debug.snapshot()
    for it in range(2):
        big = mx.nd.ones((BIG,)) * (RANK + 1 + it)
        small = mx.nd.ones((16,)) * (RANK + 1)
        mx.nd.waitall()                               # both ready when pushed
        kv.pushpull('big', big, priority=-10)
        kv.pushpull('small', small, priority=0)
        kv.wait()
        close(big.asnumpy(), sum(r + 1 + it for r in range(SIZE)), 'big, iteration %d' % it)
        close(small.asnumpy(), SIZE * (SIZE + 1) / 2, 'small, iteration %d' % it)
    counted = debug.since(before, 'schedule')
    kv.close()
    WORLD.Barrier()
    assert counted.get('pieces_cut') == 2 and counted.get('held_back', 0) > 0, counted
    trace = json.load(open(trace_path(TRACE, RANK, SIZE)))
    runs = [e for e in trace['traceEvents']
            if e['ph'] == 'X' and e['name'] == 'mpi_kvstore.allreduce']
    pieces_per_big = -(-BIG * 4 // PIECE)
    bigs = sorted({e['args']['seq'] for e in runs if e['args']['key'] == repr('big')})
    assert len(bigs) == 2, bigs

    def queued(seq):
        return [e for e in trace['traceEvents'] if e['name'] == 'QUEUED' and e['args']['seq'] == seq]
    # when the small request of each iteration (its seq follows the big's) turned ready on
    # the last rank to queue it: the end of its QUEUED phase, from push to ready
    small_queued = WORLD.allgather([t0 + (queued(seq + 1)[0]['ts'] + queued(seq + 1)[0]['dur'])
                                    / 1e6 for seq in bigs])
    overtaken = []
    for it, seq in enumerate(bigs):    # each big's small one was pushed right after it
        pieces = [e for e in runs if e['args']['seq'] == seq]
        smalls = [e for e in runs if e['args']['seq'] == seq + 1]
        assert sorted(e['args']['piece'] for e in pieces) == list(range(pieces_per_big)), (
            it, len(pieces))
        assert {e['args']['key'] for e in pieces} == {repr('big')}
        assert len(smalls) == 1 and smalls[0]['args']['key'] == repr('small'), smalls
        assert 'piece' not in smalls[0]['args']
        # every piece's QUEUED phase is its request's: from the push, before any piece ran
        big_queued = queued(seq)
        assert len(big_queued) == pieces_per_big and len({e['ts'] for e in big_queued}) == 1, \
            big_queued[:2]
        assert big_queued[0]['ts'] <= min(e['ts'] for e in pieces)
        small_end = smalls[0]['ts'] + smalls[0]['dur']
        everywhere = (max(at[it] for at in small_queued) - t0) * 1e6     # on this rank's clock
        later = [e for e in pieces if e['ts'] >= everywhere]
        ahead = [e for e in later if e['ts'] < small_end]
        assert len(ahead) <= IN_FLIGHT, (
            'rank %d, iteration %d: %d pieces of the large request started after every rank '
            'had the small one ready and before it ended' % (RANK, it, len(ahead)))
        overtaken.append(len(later) - len(ahead))
    return counted, overtaken


BASE = 2
STEPS = BASE + SIZE - 1


def join():
    kv = mpi_kvstore.create('dist_mpi', design=DESIGN, partition_bytes='4K', credit_bytes='8K')
    before = debug.snapshot()
    for step in range(STEPS):
        if step >= BASE + RANK:
            break
        active = [r for r in range(SIZE) if step < BASE + r]
        one = mx.nd.ones((5000,)) * (RANK + 1 + step)              # 20 KB: 5 pieces
        pair = [mx.nd.ones((300, 20), dtype='float64') * (RANK + 1),
                mx.nd.arange(3000, dtype='int32') + RANK]
        kv.pushpull('jg', one, priority=-step)
        kv.pushpull(['ja', 'jb'], pair, priority=1)
        close(one.asnumpy(), sum(r + 1 + step for r in active), 'join step %d jg' % step)
        close(pair[0].asnumpy(), sum(r + 1 for r in active), 'join step %d ja' % step)
        close(pair[1].asnumpy(), sum(np.arange(3000) + r for r in active),
              'join step %d jb' % step)
    last = kv.join()
    assert last == SIZE - 1, 'rank %d: join returned %d' % (RANK, last)
    again = mx.nd.ones((5000,)) * (RANK + 1)        # the store goes on after the join
    kv.pushpull('jg', again)
    close(again.asnumpy(), SIZE * (SIZE + 1) / 2, 'pushpull after join')
    kv.wait()
    counted = debug.since(before, 'schedule')
    kv.close()
    if SCHEDULED:       # every rank cut its own or its mirrors of the others' requests
        assert counted.get('pieces_cut', 0) > 0, counted


def main():
    if 'sums' in PARTS:
        for partition, credit, average in (('4K', '8K', False), ('4K', 0, True),
                                           (0, '8K', False)):
            sums(partition, credit, average)
        done('kv_schedule[%s] sums' % DESIGN)
    if 'compression' in PARTS:
        compression()
        done('kv_schedule[%s] compression' % DESIGN)
    if 'overtake' in PARTS and SCHEDULED:
        counted, overtaken = overtake()
        # pieces_cut, held_back; and by iteration, the large request's pieces the small one
        # went ahead of (0 where some rank had it ready only after they had all started)
        done('kv_schedule[%s] overtake' % DESIGN, counted=counted, overtaken=overtaken)
    if 'join' in PARTS:
        join()
        done('kv_schedule[%s] join' % DESIGN)


main()
