"""comm.broadcast against flat MPI_Bcast and numpy, bitwise: flat, pipelined (Ibcast
chunks), chain, and hierarchical (its steps as chains, and as Ibcasts), the last on this
job's real hosts (Hierarchical.build) and on
"hosts" made by splitting COMM_WORLD (in blocks, interleaved, and uneven: one host of one
rank), so that both of its shapes run (across then inside; and inside the root's host,
across the leaders, inside the rest). Every root, dtypes of 1-16 bytes (bfloat16 from
ml-dtypes, bool, complex), odd sizes and zero, chunks that do not divide the buffer, one
request in flight and several. Then ByTable, the store's entry point, from a tune table
whose broadcast rows send these sizes through each of the four (flat, pipelined, chain,
hierarchical on split "hosts"; on the real hosts, pipelined where the hierarchy does not
apply), counted by debug so each is seen to run. The data are random bytes (NaN payloads included), so a
conversion anywhere would show. Then what bad input raises.

usage: kv_broadcast.py [active]   (active: the job's real hosts must make the hierarchy
apply, as across test hosts with 2 ranks on one of them)
"""
import sys

# No MXNet: nothing here needs it (the MXNet-free contract), and each rank starts about
# 3 s of CPU sooner.
sys.modules.setdefault('mxnet', None)

from types import SimpleNamespace  # noqa: E402

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from mpi_kvstore import debug  # noqa: E402
from mpi_kvstore.comm import broadcast  # noqa: E402
from mpi_kvstore.comm.broadcast import ByTable, Hierarchical  # noqa: E402
from mpi_kvstore.comm.tuning import Table  # noqa: E402

from common import RANK, SIZE, WORLD, done, expect_raises  # noqa: E402

DTYPES = ['float32', 'float64', 'int32', 'int8', 'float16', ml_dtypes.bfloat16, 'complex64',
          'bool']
COUNTS = [0, 1, 7, 1023, 25013]
# (chunk_bytes, window): one chunk for everything, odd chunks, chunks of 4 KB
CHUNKINGS = [(1 << 30, 4), (997, 1), (4096, 3)]
VERIFIED = {}     # for the test: broadcasts each way found bitwise equal to flat and numpy


def expected(root, count, dtype, salt):
    """The root's buffer: random bytes of (root, count, dtype, salt), the same on every rank."""
    dtype = np.dtype(dtype)
    rng = np.random.RandomState((root * 7919 + count * 31 + salt) % 2 ** 31)
    raw = rng.randint(0, 256, size=count * dtype.itemsize).astype(np.uint8)
    if dtype == np.bool_:
        raw &= 1            # numpy's bool is 0 or 1; other bytes are not a bool
    return raw.view(dtype)


def start(root, count, dtype, salt):
    """This rank's buffer before the broadcast: the root's data at the root, garbage elsewhere."""
    if RANK == root:
        return expected(root, count, dtype, salt).copy()
    return np.full(count * np.dtype(dtype).itemsize, 0xA5, np.uint8).view(dtype)


def mpi_reference(root, count, dtype, salt):
    """What a flat MPI_Bcast gives, through mpi4py's own typed buffer where it has the type."""
    buf = start(root, count, dtype, salt)
    typed = buf if np.dtype(dtype).char in 'fdilbFD?' else buf.view(np.uint8)
    WORLD.Bcast(typed, root=root)
    return buf


def same(got, want, what):
    if got.dtype != want.dtype or got.shape != want.shape or not np.array_equal(
            got.view(np.uint8), want.view(np.uint8)):
        diff = np.flatnonzero(got.view(np.uint8) != want.view(np.uint8))
        raise AssertionError('rank %d: %s: %d bytes differ, first at byte %s'
                             % (RANK, what, diff.size, diff[:3]))


def check(name, run, salt, chunkings=CHUNKINGS, dtypes=DTYPES):
    for i, dtype in enumerate(dtypes):
        for j, count in enumerate(COUNTS):
            # One root a (dtype, count), turning: every count meets every root across the
            # dtypes, and every dtype across the counts, at a quarter of the broadcasts
            # that every root of every pair took at 4 ranks.
            root = (i + j) % SIZE
            want = expected(root, count, dtype, salt)
            flat = mpi_reference(root, count, dtype, salt)
            same(flat, want, 'flat MPI_Bcast of %s[%d] from %d' % (np.dtype(dtype), count, root))
            for chunk, window in chunkings:
                if chunk < 4096 and count * np.dtype(dtype).itemsize > 20000:
                    continue   # thousands of tiny chunks: slow, and no new case
                buf = start(root, count, dtype, salt)
                out = run(buf, root, chunk, window)
                what = '%s of %s[%d] from %d, chunks %d, window %d' % (
                    name, np.dtype(dtype), count, root, chunk, window)
                assert out is buf, what
                same(buf, flat, what + ' (against flat MPI_Bcast)')
                same(buf, want, what + ' (against numpy)')
                VERIFIED[name] = VERIFIED.get(name, 0) + 1
            salt += 1
    return salt


def fake_hosts(host_of):
    """(node, cross) of 'hosts' host_of(rank) split from COMM_WORLD, as hierarchy.py
    splits the real ones: by host, then by local rank, keyed by rank."""
    node = WORLD.Split(host_of(RANK), key=RANK)
    cross = WORLD.Split(node.Get_rank(), key=RANK)
    return node, cross


# Broadcast rows that split check()'s sizes (0 B to 400 KB) four ways: < 8 B flat, < 512 B
# pipelined chunks of 997 B, < 16 KB a chain of 4 KB chunks, the rest through the hosts in
# 8 KB chunks (the edges: integer geometric means of neighbouring rows).
TABLE = Table([4], ['mpi'], SIZE, ops={'broadcast': [
    (1, 'flat', None), (64, 'pipelined', 997), (4096, 'chain', 4096),
    (65536, 'hierarchical', 8192)]})


def by_table(comm, hierarchy, salt):
    """ByTable over ``hierarchy`` against flat and numpy (check), and which ran. -> salt"""
    entry = ByTable(comm, TABLE, hierarchy)
    before = debug.snapshot()
    salt = check('ByTable (hosts active: %s)' % hierarchy.active,
                 lambda b, r, c, w: entry(b, r), salt,
                 chunkings=[(1 << 30, 0)],   # one pass: the table gives the chunks
                 dtypes=[ml_dtypes.bfloat16, 'float32', 'complex64'])   # 2, 4, 8 bytes
    ran = {name.split()[-1] for name in debug.since(before, 'algorithm')}
    want = {'flat', 'pipelined', 'chain'} | ({'hierarchical'} if hierarchy.active else set())
    assert ran == want, (ran, want)
    return salt


def bad_input(comm):
    buf = np.zeros(10, np.float32)
    expect_raises(ValueError, broadcast.flat, comm, buf, root=SIZE, contains='root=%d' % SIZE)
    expect_raises(ValueError, broadcast.pipelined, comm, buf, root=-1, contains='root=-1')
    expect_raises(ValueError, broadcast.pipelined, comm, buf, 0, chunk_bytes=0,
                  contains='chunk_bytes=0')
    expect_raises(ValueError, broadcast.chain, comm, buf, 0, window=0, contains='window=0')
    expect_raises(ValueError, broadcast.chain, comm, buf, 0, chunk_bytes='4K',
                  contains="chunk_bytes='4K'")
    expect_raises(ValueError, broadcast.flat, comm, buf, root=True, contains='root=True')
    expect_raises(ValueError, broadcast.chain, comm, np.zeros((4, 4))[:, 1], 0,
                  contains='C-contiguous')
    frozen = np.zeros(3)
    frozen.flags.writeable = False
    expect_raises(ValueError, broadcast.flat, comm, frozen, 0, contains='read-only')
    expect_raises(TypeError, broadcast.flat, comm, [1.0, 2.0], 0, contains='numpy array, not list')
    expect_raises(TypeError, broadcast.pipelined, comm, np.array([None]), 0, contains='object')


def main():
    comm = WORLD.Dup()
    salt = check('flat', lambda b, r, c, w: broadcast.flat(comm, b, r), 0)
    salt = check('pipelined', lambda b, r, c, w: broadcast.pipelined(comm, b, r, c, w), salt)
    salt = check('chain', lambda b, r, c, w: broadcast.chain(comm, b, r, c, w), salt)
    # a buffer of several default chunks (1 MB), odd in size
    for root in {0, SIZE - 1}:
        for name, fn in (('pipelined', broadcast.pipelined), ('chain', broadcast.chain)):
            buf = start(root, 1_300_007, 'float32', 99)
            fn(comm, buf, root)
            same(buf, expected(root, 1_300_007, 'float32', 99), '%s of 5.2 MB' % name)
    real, hierarchy = Hierarchical.build(comm)
    if sys.argv[1:] == ['active']:
        assert real.active and hierarchy.nodes == 2, (real.active, hierarchy.nodes)
    layouts = {'real hosts': real}
    for layout, host_of in (('blocks of 2', lambda r: r // 2),
                            ('interleaved', lambda r: r % 2),
                            ('uneven', lambda r: int(r == SIZE - 1))):
        layouts[layout] = Hierarchical(comm, *fake_hosts(host_of))
    for layout, hier in layouts.items():
        salt = check('hierarchical (%s)' % layout,
                     lambda b, r, c, w, h=hier: h(b, r, c if c < (1 << 30) else None, w), salt)
    uneven = layouts['uneven']
    salt = by_table(comm, hierarchy, salt)
    salt = by_table(comm, SimpleNamespace(active=True, node=uneven.node, cross=uneven.cross),
                    salt)
    for layout in ('interleaved', 'uneven'):   # the steps as Ibcasts instead of chains
        salt = check('hierarchical Ibcasts (%s)' % layout,
                     lambda b, r, c, w, h=layouts[layout]: h(b, r, c, w, how='ibcast'), salt)
    # Both shapes ran: 'uneven' at 3+ ranks sends a root of local rank 1 through the leaders.
    if SIZE >= 3:
        if RANK < SIZE - 1:   # the root's host: inside it, then rank 0 across the leaders
            want = [uneven.node] + ([uneven.cross] if RANK == 0 else [])
        else:                 # the other host: across the leaders, then inside
            want = [uneven.cross, uneven.node]
        assert [c for c, _ in uneven.steps(1)] == want, uneven.steps(1)
        assert [c for c, _ in uneven.steps(0)][-1] == uneven.node   # across, then inside
    bad_input(comm)
    expect_raises(ValueError, real, np.zeros(3), SIZE + 2, contains='root=%d' % (SIZE + 2))
    expect_raises(ValueError, real, np.zeros(3), 0, 4, how='tree', contains="how='tree'")
    hierarchy.free()
    done('kv_broadcast', verified=VERIFIED, hosts=hierarchy.nodes)


main()
