"""mpi_kvstore.horovod: Horovod's MXNet API on the store (tests/scenarios/hvd_*.py), its
environment variables, and examples/horovod_style.py."""
import os

import numpy as np
import pytest

from mpi_harness import result, run_mpi

SCENARIOS = os.path.join(os.path.dirname(__file__), 'scenarios')


def scenario(name):
    return os.path.join(SCENARIOS, name)


def test_environment_options():
    from mpi_kvstore.horovod import environment_options
    options, ignored = environment_options({
        'HOROVOD_FUSION_THRESHOLD': '65536', 'HOROVOD_HIERARCHICAL_ALLREDUCE': '1',
        'HOROVOD_STALL_CHECK_TIME_SECONDS': '30', 'HOROVOD_CYCLE_TIME': '5',
        'HOROVOD_AUTOTUNE': '1', 'HOROVOD_LOG_LEVEL': 'info', 'PATH': '/bin'})
    assert options == {'fusion_threshold': 65536, 'hierarchical': 'on', 'stall_warning': 30.0}
    assert ignored == ['HOROVOD_AUTOTUNE', 'HOROVOD_CYCLE_TIME']
    # the store's own variable wins; DYNAMIC gets a file to start from
    options, _ = environment_options({'HOROVOD_FUSION_THRESHOLD': '1',
                                      'MPI_KVSTORE_FUSION_THRESHOLD': '2',
                                      'HOROVOD_TIMELINE': 'DYNAMIC',
                                      'HOROVOD_STALL_CHECK_DISABLE': '1'})
    assert 'fusion_threshold' not in options and options['stall_warning'] == 0.0
    assert options['timeline'].endswith('.json')
    with pytest.raises(ValueError, match='HOROVOD_FUSION_THRESHOLD'):
        environment_options({'HOROVOD_FUSION_THRESHOLD': 'lots'})


def _data(rank):
    """What rank RANK holds in scenarios/hvd_ops.py: 5 x 3 values, all different."""
    return 1.0 + 0.1 * rank + 0.01 * np.arange(15, dtype=np.float64).reshape(5, 3)


def test_ops_at_two_ranks(mpi_available):
    out = run_mpi(2, scenario('hvd_ops.py'), timeout=120)
    assert 'hvd_ops: OK at 2 ranks' in out
    every = [_data(r) for r in range(2)]
    for report in result(out, 'hvd_ops')['ranks']:
        seen = report['checked']
        assert seen['default average'] == [[5, 3], pytest.approx(np.mean(every, 0).sum())]
        assert seen['average=False'] == [[5, 3], pytest.approx(np.sum(every))]
        assert seen['allgather'] == [[10, 3], pytest.approx(np.sum(every))]
        # rank r gives r + 1 rows of r
        assert seen['allgather ragged'] == [[3, 2], pytest.approx(4.0)]
        for root in range(2):
            assert seen['broadcast root %d' % root] == [[5, 3], pytest.approx(every[root].sum())]
        # Adasum, twice, is not implemented; bad ops, roots, splits and sets are ValueErrors
        assert report['raised'].count('NotImplementedError') == 2, report['raised']
        assert set(report['raised']) == {'ValueError', 'NotImplementedError'}, report['raised']


def test_ops_at_three_ranks_with_horovod_environment(tmp_path, mpi_available):
    trace = str(tmp_path / 'trace.json')
    env = {'HOROVOD_TIMELINE': 'DYNAMIC', 'HOROVOD_FUSION_THRESHOLD': '65536',
           'HOROVOD_CYCLE_TIME': '5'}
    out = run_mpi(3, scenario('hvd_ops.py'), trace, timeout=120, env=env)
    assert 'hvd_ops: OK at 3 ranks' in out
    assert 'ignored: HOROVOD_CYCLE_TIME' in out
    assert out.count('these Horovod variables have no meaning') == 1


@pytest.mark.parametrize('nprocs', [1, 2, 3])
def test_trainers_average_as_horovod(nprocs, mpi_available):
    out = run_mpi(nprocs, scenario('hvd_train.py'), timeout=180)
    assert 'hvd_train: OK at %d ranks' % nprocs in out
    for report in result(out, 'hvd_train')['ranks']:
        # every uncompressed trainer's parameters, and Module.fit's, equal one process's on the
        # whole batch (fp16, bf16 and 2-bit are held by the scenario to their own tolerances)
        names = [what for what in report['checked']
                 if (what.startswith('NoneCompressor ') and what.endswith('vs one process'))
                 or what.startswith('Module.fit with')]
        assert len(names) >= 4 and any(n.startswith('Module.fit') for n in names), names
        for what in names:
            (shape, got), (want_shape, want) = report['checked'][what], report['expected'][what]
            assert shape == want_shape, what
            assert got == pytest.approx(want, rel=1e-3, abs=1e-4 * np.prod(shape)), what


def test_example_horovod_style(mpi_available):
    """Averaged gradients learn; the ranks end with the same weights."""
    from test_examples import check_epochs
    out = run_mpi(2, 'examples/horovod_style.py', '--epochs', 2, timeout=180)
    assert 'horovod_style: 2 rank(s)' in out, out[-3000:]
    first, second = check_epochs(out, 2)
    assert second['loss'] < first['loss'] and second['val_acc'] > 0.4, (first, second)
    assert 'weights identical on all 2 ranks: True' in out, out[-3000:]


def test_example_horovod_style_fp16(mpi_available):
    from test_examples import check_epochs
    out = run_mpi(2, 'examples/horovod_style.py', '--epochs', 1, '--steps', 5,
                  '--fp16-allreduce', '--gradient-predivide-factor', 2, timeout=180)
    check_epochs(out, 1)
    assert 'weights identical on all 2 ranks: True' in out, out[-3000:]
