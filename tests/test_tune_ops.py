"""The tune table's rows for the other collectives (tuning.OPS), without MPI: a table
round-trips through its JSON, files written before the rows existed still load (and then
every op keeps its default), bad rows name what is wrong, a table of another size is
refused, and broadcast.ByTable picks by the rows, alike for every size on every rank.
"""
import itertools
import json
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpi_kvstore.comm import tuning
from mpi_kvstore.comm.broadcast import ByTable
from mpi_kvstore.comm.tuning import OPS, Choice, Table
from mpi_kvstore.errors import ConfigError

OLD = {'version': 1, 'comm_size': 4, 'measured_ms': {},
       'allreduce': [{'bytes': 4096, 'algorithm': 'mpi'}, {'bytes': 1 << 20, 'algorithm': 'rsag'}]}
OPS_ROWS = {
    'broadcast': [{'bytes': 4096, 'algorithm': 'flat'},
                  {'bytes': 1 << 20, 'algorithm': 'pipelined', 'chunk_bytes': 262144},
                  {'bytes': 16 << 20, 'algorithm': 'chain', 'chunk_bytes': 1 << 20},
                  {'bytes': 64 << 20, 'algorithm': 'hierarchical', 'chunk_bytes': 4 << 20}],
    'allgather': [{'bytes': 4096, 'algorithm': 'mpi'}, {'bytes': 1 << 22, 'algorithm': 'hierarchical'}],
    'reducescatter': [{'bytes': 65536, 'algorithm': 'hierarchical'}],
    'alltoall': [{'bytes': 4096, 'algorithm': 'mpi'}]}
NEW = dict(OLD, ops=OPS_ROWS)


def test_ops_rows_round_trip_through_json():
    table = Table.from_json(json.loads(json.dumps(NEW)))
    again = Table.from_json(json.loads(json.dumps(table.to_json())))
    assert again.to_json()['ops'] == OPS_ROWS
    assert again.to_json()['allreduce'] == OLD['allreduce']
    assert again.choose_op('broadcast', 1 << 20) == Choice('pipelined', 262144)
    assert again.choose_op('broadcast', 100) == Choice('flat', None)
    assert again.choose_op('broadcast', 1 << 30) == Choice('hierarchical', 4 << 20)
    assert again.choose_op('allgather', 1 << 30).algorithm == 'hierarchical'
    assert again.choose_op('reducescatter', 1).algorithm == 'hierarchical'
    assert again.needs_hierarchy


def test_a_table_written_before_the_ops_rows_still_loads(tmp_path):
    path = tmp_path / 'old.json'
    path.write_text(json.dumps(OLD))
    reading = tuning.read(str(path))
    assert reading.error is None, reading.error
    table = Table.from_json(reading.payload)
    assert table.ops == {} and 'ops' not in table.to_json()
    assert [table.choose_op(op, 1 << 20) for op in OPS] == [None] * len(OPS)
    assert table.choose(1 << 20) == 'rsag' and not table.needs_hierarchy


@pytest.mark.parametrize('op, row, words', [
    ('broadcast', {'bytes': 4096, 'algorithm': 'telepathy'}, ["'telepathy'", '4096', 'chain']),
    ('broadcast', {'bytes': 4096, 'algorithm': 'chain'}, ['chain', 'needs chunk_bytes']),
    ('broadcast', {'bytes': 4096, 'algorithm': 'pipelined', 'chunk_bytes': 0},
     ['chunk_bytes', '>= 1', '0']),
    ('allgather', {'bytes': -1, 'algorithm': 'mpi'}, ['allgather', 'bytes', '-1']),
    ('alltoall', {'bytes': 4096, 'algorithm': 'hierarchical'}, ['alltoall', "'hierarchical'"]),
    ('gossip', {'bytes': 4096, 'algorithm': 'mpi'}, ["'gossip'", 'broadcast']),
])
def test_a_bad_ops_row_names_the_op_and_what_is_wrong(tmp_path, op, row, words):
    with pytest.raises(ValueError) as err:
        Table.from_json(dict(OLD, ops={op: [row]}))
    for word in words:
        assert word in str(err.value), (word, str(err.value))
    path = tmp_path / 'bad.json'          # and read() reports it, as load raises it
    path.write_text(json.dumps(dict(OLD, ops={op: [row]})))
    assert words[0] in tuning.read(str(path)).error


class _OneRank:
    """The least of an mpi4py communicator that tuning.load calls, for one rank."""

    def __init__(self, size):
        self.size = size

    def Get_rank(self):
        return 0

    def Get_size(self):
        return self.size

    def bcast(self, obj, root=0):
        return obj


def test_a_table_of_another_size_is_refused_with_its_ops_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(tuning, 'check', lambda *args: None)   # the ranks' agreement: MPI
    path = tmp_path / 'table.json'
    path.write_text(json.dumps(NEW))
    assert tuning.load(str(path), _OneRank(3)) is None
    table = tuning.load(str(path), _OneRank(4))
    assert table.choose_op('broadcast', 20 << 20) == Choice('chain', 1 << 20)
    path.write_text(json.dumps(dict(OLD, ops={'broadcast': [{'bytes': 1, 'algorithm': 'x'}]})))
    with pytest.raises(ConfigError, match="'x'"):
        tuning.load(str(path), _OneRank(4))


def _nearest(rows, nbytes):
    """The row a size takes, by the rule of the module: the nearer size in log scale, the
    larger one on a tie, in exact integers (the rows' sizes are powers of 2, so every
    geometric mean is whole)."""
    taken = rows[0]
    for smaller, larger in itertools.pairwise(rows):
        if nbytes * nbytes >= smaller['bytes'] * larger['bytes']:
            taken = larger
    return taken


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.integers(min_value=0, max_value=1 << 32),
                 st.sampled_from([1 << 16, (1 << 16) - 1, 1 << 22, (1 << 22) - 1, 1 << 25,
                                  (1 << 25) - 1])))   # the edges, and one byte short of them
def test_broadcast_choice_is_the_nearest_row_and_falls_back_without_hosts(nbytes):
    table = Table.from_json(NEW)
    row = _nearest(OPS_ROWS['broadcast'], nbytes)
    want = Choice(row['algorithm'], row.get('chunk_bytes'))
    across = ByTable(None, table, types.SimpleNamespace(active=True, node=None, cross=None))
    assert across.choose(nbytes) == want
    one_host = ByTable(None, table, types.SimpleNamespace(active=False))
    if want.algorithm == 'hierarchical':   # one host: the chunks as Ibcasts
        want = Choice('pipelined', want.chunk_bytes)
    assert one_host.choose(nbytes) == want
    assert ByTable(None, Table.from_json(OLD)).choose(nbytes) == Choice('flat', None)
    assert ByTable(None, None).choose(nbytes) == Choice('flat', None)


def test_choose_op_refuses_an_unknown_op():
    with pytest.raises(ValueError, match=r"'allscatter'.*broadcast"):
        Table.from_json(NEW).choose_op('allscatter', 4)


def test_doctor_shows_each_ops_choice(tmp_path):
    from mpi_kvstore.cli import doctor
    path = tmp_path / 'table.json'
    path.write_text(json.dumps(dict(NEW, ops={'broadcast': OPS_ROWS['broadcast']})))
    text = '\n'.join(doctor._tune_table(types.SimpleNamespace(tune_table=str(path),
                                                              gpu_transport='auto')))
    assert ('  broadcast:      4K flat, 1M pipelined (chunks of 256K), 16M chain (chunks of 1M), '
            '64M hierarchical (chunks of 4M)') in text, text
    for op in ('allgather', 'reducescatter', 'alltoall'):   # no rows: the default, said so
        assert "  %-15s none (the store's default)" % (op + ':') in text, text


@pytest.mark.parametrize('row, python', [
    ({'algorithm': 'flat'}, False),
    ({'algorithm': 'hierarchical'}, False),    # one host, no chunk: one MPI_Bcast after all
    ({'algorithm': 'hierarchical', 'chunk_bytes': 1 << 16}, True),   # pipelined Ibcasts
    ({'algorithm': 'chain', 'chunk_bytes': 1 << 16}, True),
])
def test_chained_runs_a_broadcast_compiled_exactly_where_the_comm_broadcasts_flat(row, python):
    """The chained design's compiled op calls MPI_Bcast; it asks the Comm's own choice
    (ByTable.choose), which falls back from 'hierarchical' on one host, so the two never
    disagree. One rank on COMM_SELF: one host."""
    from mpi4py import MPI

    from mpi_kvstore.comm.host import Comm
    from mpi_kvstore.designs import chained
    table = Table.from_json(dict(OLD, comm_size=1, ops={'broadcast': [dict(row, bytes=4096)]}))
    comm = Comm(MPI.COMM_SELF, 'off', table=table)
    try:
        bucket = [types.SimpleNamespace(nbytes=3000), types.SimpleNamespace(nbytes=5000)]
        assert comm.broadcast_choice(8000) == comm._broadcast.choose(8000)
        assert chained._python_broadcast(comm, bucket) is python
        plain = Comm(MPI.COMM_SELF, 'off')
        assert not chained._python_broadcast(plain, bucket)   # no table: MPI_Bcast
        plain.free()
    finally:
        comm.free()


@pytest.mark.parametrize('grid', [True, False])
def test_shares_take_the_tables_row_else_the_hierarchys_default(grid):
    """Comm._shares_through_hosts: a reduce-scatter or allgather row decides where the
    table has one, the hierarchy's own size threshold where not; never through the hosts
    without a grid (uneven hosts)."""
    from mpi4py import MPI

    from mpi_kvstore.comm.host import Comm
    comm = Comm(MPI.COMM_SELF, 'off')
    real = comm.hierarchy
    try:
        comm.hierarchy = types.SimpleNamespace(
            grid=object() if grid else None, takes_shares=lambda n: grid and n >= 1000)
        for nbytes in (10, 5000):
            assert comm._shares_through_hosts('allgather', nbytes) is (grid and nbytes >= 1000)
        comm._table = Table.from_json(NEW)    # reducescatter: hierarchical from 1 byte on
        assert comm._shares_through_hosts('reducescatter', 10) is grid
        assert comm._shares_through_hosts('allgather', 10) is False    # its 'mpi' row
        assert comm._shares_through_hosts('allgather', 1 << 30) is grid
    finally:
        comm.hierarchy = real
        comm.free()
