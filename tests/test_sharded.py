"""The sharded optimizer (shard_optimizer, issue 22) under mpiexec: 8 gluon steps with SGD +
momentum, Adam and LAMB, and float16 multi_precision pushpulls (SGD, LAMB), equal an unsharded store and one
process (numpy for float16) with 1/N of the optimizer state on each rank; the fp16 and bf16
wire casts reduce-scatter with compress-once's sums (numpy); states saved
sharded at 2 ranks resume at 3 and 4, sharded and unsharded; the collectives cut in
priority pieces (partition_bytes) give the same weights; Module and gluon's own
scenarios with MPI_KVSTORE_SHARD_OPTIMIZER=1; bad input and join. Scenarios:
scenarios/kv_sharded.py, kv_module.py, kv_gluon.py.
"""
import numpy as np
import pytest

from mpi_harness import result, run_joint, run_mpi

SHARDED = {'MPI_KVSTORE_SHARD_OPTIMIZER': '1'}
ALL = ('funneled', 'chained', 'concurrent', 'blocking')


def _joint(batch_dir):
    """(script, args, designs, sizes) of the tests below that set no environment: at each
    size, one job runs them all (mpi_harness.run_joint), instead of one job a test whose
    ranks' start-up (MXNet's import) costs more than most of these scenarios."""
    return (
        ('kv_sharded.py', ('train',), ('funneled',), (2, 4)),
        ('kv_sharded.py', ('train',), ALL, (3,)),
        ('kv_sharded.py', ('clip',), ('funneled',), (2,)),
        ('kv_sharded.py', ('clip',), ('chained',), (3,)),
        ('kv_sharded.py', ('errors', batch_dir), ('funneled', 'chained'), (2,)),
        ('kv_sharded.py', ('join', batch_dir), ALL, (3,)),
        ('kv_sharded.py', ('compressed',), ('funneled',), (3,)),
        ('kv_sharded.py', ('compressed',), ('chained',), (2,)),
        ('kv_sharded.py', ('partitioned',), ('funneled',), (2, 3)),
        ('kv_sharded.py', ('partitioned',), ('concurrent',), (4,)),
    )


# the same for the tests with the optimizer sharded by the environment, all at 3 ranks
SHARDED_JOINT = (
    ('kv_module.py', ('1',), ('funneled', 'chained'), (3,)),
    ('kv_gluon.py', (), ('concurrent',), (3,)),
    ('kv_module.py', ('1', 'clip'), ('funneled',), (3,)),
)


def _ok(out, name, nprocs):
    """Each rank's report of scenario NAME after its OK (scenarios/common.done): 'checked'
    and 'expected', {what: [shape, sum]} of what each close() got and of the numpy or
    one-process value it was held to, 'raised', the exceptions that expect_raises saw."""
    assert '%s: OK at %d ranks' % (name, nprocs) in out, out[-3000:]
    report = result(out, name)
    assert report['size'] == nprocs and len(report['ranks']) == nprocs, report
    return report['ranks']


def _agree(ranks, label, at_least):
    """Every array whose check is named with LABEL (e.g. 'vs one process') has its
    reference's shape and, to float32's rounding over its elements, sum; every rank holds
    the same ones, and there are AT_LEAST of them."""
    for rank in ranks:
        names = [what for what in rank['checked'] if label in what]
        assert len(names) >= at_least, (label, sorted(rank['checked']))
        for what in names:
            (shape, got), (want_shape, want) = rank['checked'][what], rank['expected'][what]
            assert shape == want_shape, what
            assert got == pytest.approx(want, rel=1e-3, abs=1e-3 * np.prod(shape)), what
            assert rank['checked'][what] == ranks[0]['checked'][what], what


@pytest.mark.parametrize('design,nprocs', [('funneled', 2), ('funneled', 3), ('funneled', 4),
                                           ('chained', 3), ('concurrent', 3),
                                           ('blocking', 3)])
def test_sharded_training_equals_unsharded_and_one_process(design, nprocs, designs, batch_dir):
    ranks = _ok(run_joint(nprocs, 'kv_sharded.py', design, designs, 'train', timeout=240,
                          joint=_joint(batch_dir)),
                'kv_sharded[%s] train' % design, nprocs)
    sizes = ranks[0]['sizes']                        # the net's parameters, in elements
    _agree(ranks, 'sharded vs one process', 3 * len(sizes))      # SGD, Adam, LAMB
    _agree(ranks, 'sharded vs unsharded store', 3 * len(sizes))
    _agree(ranks, ', vs numpy', 1)                               # float16 multi_precision
    for rank, r in enumerate(ranks):
        # 1/N of each key's state on each rank (numpy's array_split; keys of fewer elements
        # than ranks whole): one array a weight for momentum, two for Adam and LAMB
        share = sum(len(np.array_split(np.arange(size), nprocs)[rank]) if size >= nprocs
                    else size for size in sizes)
        for name, per_weight in (('sgd', 1), ('adam', 2), ('lamb', 2)):
            assert r['state'][name]['sharded'] == per_weight * share, (name, r['state'])
            assert r['state'][name]['unsharded'] == per_weight * sum(sizes), name


def test_states_saved_sharded_resume_at_other_sizes_sharded_and_not(tmp_path, mpi_available):
    saved = _ok(run_mpi(2, 'kv_sharded.py', 'funneled', 'save', str(tmp_path), timeout=180),
                'kv_sharded[funneled] save', 2)
    _agree(saved, 'saved state of key', 2)       # sharded states saved = unsharded ones
    for nprocs, design in ((3, 'chained'), (4, 'concurrent')):
        ranks = _ok(run_mpi(nprocs, 'kv_sharded.py', design, 'load', str(tmp_path),
                            timeout=180), 'kv_sharded[%s] load' % design, nprocs)
        # the weights a 2-rank run reached after all its steps, from its half-way states
        for shard in (0, 1):
            _agree(ranks, 'resumed at %d ranks (shard_optimizer=%d)' % (nprocs, shard), 2)


@pytest.mark.parametrize('design', ['funneled', 'chained'])
def test_module_fit_sharded_equals_one_process(design, designs):
    ranks = _ok(run_joint(3, 'kv_module.py', design, designs, '1', timeout=180, env=SHARDED,
                          joint=SHARDED_JOINT),
                'kv_module[%s, MXNET_UPDATE_ON_KVSTORE=1]' % design, 3)
    _agree(ranks, 'vs single process', 4)        # conv1 and fc, weight and bias each


def test_gluon_scenario_sharded_equals_one_process(mpi_available):
    ranks = _ok(run_joint(3, 'kv_gluon.py', 'concurrent', ['concurrent'], timeout=180,
                          env=SHARDED, joint=SHARDED_JOINT),
                'kv_gluon[concurrent]', 3)
    _agree(ranks, 'vs single process', 2 * 6)     # 6 parameters, update_on_kvstore or not


@pytest.mark.parametrize('design,nprocs', [('funneled', 2), ('chained', 3)])
def test_global_norm_clipping_in_the_store_equals_one_process(design, nprocs, batch_dir,
                                                              mpi_available):
    ranks = _ok(run_joint(nprocs, 'kv_sharded.py', design, [design], 'clip', timeout=240,
                          joint=_joint(batch_dir)),
                'kv_sharded[%s] clip' % design, nprocs)
    _agree(ranks, 'clipped in the store vs one process', 2 * 2 * 2)  # SGD, Adam; sharded or not
    for rank in ranks:
        seen = rank['checked']
        # a grouped step is clipped alike for both keys; an unclipped step adds its whole sum
        assert 'a clipped grouped step (w)' in seen and 'an unclipped step (b)' in seen
        _agree([rank], 'step (', 4)
        # Module, max_norm, update_on_kvstore, no optimizer, empty, repeated, unfinished step,
        # a key not in the group, a bad shape
        assert rank['raised'][:2] == ['TypeError', 'ValueError'], rank['raised']
        assert 'MPIKVStoreError' in rank['raised'] and len(rank['raised']) >= 8


def test_module_fit_clipped_in_the_store_equals_one_process(mpi_available):
    ranks = _ok(run_joint(3, 'kv_module.py', 'funneled', ['funneled'], '1', 'clip', timeout=180,
                          env=SHARDED, joint=SHARDED_JOINT),
                'kv_module[funneled, MXNET_UPDATE_ON_KVSTORE=1, clipped]', 3)
    _agree(ranks, 'vs single process', 4)
    clipped = ranks[0]['clipped']                 # one process: whether each step clipped
    assert sum(clipped) > len(clipped) // 2, clipped           # most steps clip


@pytest.mark.parametrize('design', ['funneled', 'chained'])
def test_bad_input_is_refused_and_the_store_goes_on(design, designs, batch_dir):
    ranks = _ok(run_joint(2, 'kv_sharded.py', design, designs, 'errors', batch_dir,
                          timeout=120, joint=_joint(batch_dir)), 'kv_sharded[%s] errors' % design, 2)
    for rank in ranks:
        assert rank['raised'] == ['ValueError', 'ValueError']    # LARS; another model's states
    # then two momentum steps and a 2-bit one, each numpy's: the store went on
    _agree(ranks, 'after a refused load', 2)
    _agree(ranks, 'a 2-bit compressed sharded step', 1)


@pytest.mark.parametrize('design', ['funneled', 'chained', 'concurrent', 'blocking'])
def test_a_joined_rank_goes_on_updating_its_shares(design, designs, batch_dir):
    ranks = _ok(run_joint(3, 'kv_sharded.py', design, designs, 'join', batch_dir,
                          timeout=180, joint=_joint(batch_dir)), 'kv_sharded[%s] join' % design, 3)
    _agree(ranks, 'after the join, sharded vs numpy', 1)
    _agree(ranks, 'after the join, sharded vs unsharded', 2)
    # LAMB and clipping need every rank: the active ranks are refused once the last joined
    assert [rank['raised'] for rank in ranks] == [['JoinError', 'JoinError']] * 2 + [[]]


@pytest.mark.parametrize('design,nprocs', [('funneled', 3), ('chained', 2)])
def test_compressed_reduce_scatter_is_compress_once(design, nprocs, batch_dir, mpi_available):
    ranks = _ok(run_joint(nprocs, 'kv_sharded.py', design, [design], 'compressed', timeout=240,
                          joint=_joint(batch_dir)),
                'kv_sharded[%s] compressed' % design, nprocs)
    _agree(ranks, 'one sharded step vs numpy', 2)               # fp16 and bf16


@pytest.mark.parametrize('design,nprocs', [('funneled', 3), ('concurrent', 4),
                                           ('funneled', 2)])
def test_partitioned_sharded_exchange_equals_whole_shares(design, nprocs, batch_dir,
                                                           mpi_available):
    ranks = _ok(run_joint(nprocs, 'kv_sharded.py', design, [design], 'partitioned', timeout=240,
                          joint=_joint(batch_dir)),
                'kv_sharded[%s] partitioned' % design, nprocs)
    _agree(ranks, 'partitioned vs whole shares', 2)
    _agree(ranks, 'partitioned vs one process', 2)
