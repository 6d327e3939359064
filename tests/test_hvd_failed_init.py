"""An hvd.init that raises leaves hvd as before the call, in one process (a world of one): not
initialized, every store it built closed, the communicator it split freed; the next init
starts anew and its allreduce is right. tests/test_elastic_build.py has the elastic world's
(the next init re-forms the world the failed one formed).
"""
import mxnet as mx
import pytest

import mpi_kvstore.horovod as hvd
from mpi_kvstore.comm.mpiabi import MPI
from mpi_kvstore.horovod import basics
from mpi_kvstore.store.kvstore import MPIKVStore

pytestmark = pytest.mark.unit


@pytest.fixture
def stores(monkeypatch):
    """(the stores built, the stores closed) from now on."""
    built, closed = [], []
    real_init, real_close = MPIKVStore.__init__, MPIKVStore.close

    def init(store, *args, **kwargs):
        real_init(store, *args, **kwargs)
        built.append(store)

    def close(store):
        closed.append(store)
        real_close(store)
    monkeypatch.setattr(MPIKVStore, '__init__', init)
    monkeypatch.setattr(MPIKVStore, 'close', close)
    yield built, closed
    hvd.shutdown()


def _as_before():
    assert not hvd.is_initialized() and basics._state == {}
    assert hvd.global_process_set._store is None and hvd.global_process_set.ranks == []


def _works():
    hvd.init()
    assert (hvd.rank(), hvd.size(), hvd.local_size(), hvd.cross_size()) == (0, 1, 1, 1)
    got = hvd.allreduce(mx.nd.array([1.5, -2.0, 4.0]), op=hvd.Sum)
    assert got.asnumpy().tolist() == [1.5, -2.0, 4.0]   # the sum over one rank
    assert hvd.allreduce(mx.nd.array([3.0]), op=hvd.Max).asnumpy().tolist() == [3.0]


def test_a_bad_process_set_found_after_the_store_was_built(stores):
    built, closed = stores
    with pytest.raises(ValueError, match=r'ranks \[0, 3\] must be distinct ranks in \[0, 1\)'):
        hvd.init(process_sets=[[0, 3]])
    assert len(built) == 1 and closed == built
    _as_before()
    _works()


def test_a_bad_process_sets_word_is_found_before_any_store(stores):
    built, _ = stores
    with pytest.raises(ValueError, match="a list of ProcessSets or 'dynamic'"):
        hvd.init(process_sets='static')
    assert built == []
    _as_before()
    _works()


def test_an_init_that_fails_after_its_store_closes_it_and_frees_its_split(stores, monkeypatch):
    """A failure injected where init places its ranks (after the store), on a communicator
    init split from a list of ranks: the store closed, the communicator freed."""
    built, closed = stores
    given, identify = [], basics._identify

    def failing(comm, wait=None):
        given.append(comm)
        monkeypatch.setattr(basics, '_identify', identify)   # once
        raise RuntimeError('injected')
    monkeypatch.setattr(basics, '_identify', failing)
    with pytest.raises(RuntimeError, match='injected'):
        hvd.init(comm=[0])
    assert len(built) == 1 and closed == built
    assert given[0] == MPI.COMM_NULL   # freed (mpi4py nulls a freed handle)
    _as_before()
    _works()
    assert len(built) == 2 and closed == built[:1]
