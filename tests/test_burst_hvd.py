"""Horovod's allreduce_ on its one-function prepared path (horovod.ops.allreduce_ ->
store.collectives.Collectives.again): scenarios/burst_hvd.py on every design at 2 ranks.
A burst of 20 tensors (float32, float64, int32) by op Sum and the default Average sums or
averages as numpy does and is prepared from its second step; switching op, scale factors,
Max and the default name stay right; op=True, Adasum, an unregistered process set and
op with average still raise; a burst whose last call differs in shape fails on every rank
naming both shapes, and the prepared calls go on summing right; mpi_kvstore.allreduce_
(the functional API) is prepared likewise and right.
"""
import pytest

from mpi_kvstore.designs import NAMES

from mpi_harness import result, run_designs


def check(out, design, nprocs):
    assert 'burst_hvd[%s]: OK at %d ranks' % (design, nprocs) in out, out[-3000:]
    info = result(out, 'burst_hvd_info')['ranks']
    hit, miss = {'hit': 1}, {'miss': 1}
    switches = {'sum': miss, 'sum again': hit, 'average': miss, 'average again': hit,
                'sum after average': miss, 'prescale': miss, 'postscale': miss,
                'postscale again': hit, 'sum after postscale': miss, 'max': {},
                'default name': miss, 'default name again': hit,
                'sum after the refused calls': hit}
    raised = {'op True': 'ValueError', 'adasum': 'NotImplementedError',
              'unregistered set': 'ValueError', 'average and op': 'ValueError'}
    shapes = ['rank 0 has shape (4,) float32'] + [
        'rank %d has shape (%d,) float32' % (r, 4 + r) for r in range(1, nprocs)]
    for rank, said in enumerate(info):
        assert said['steps'] == [[20, 0]] * 6, (rank, said['steps'])
        assert said['functional'] == [[10, 0]] * 4, (rank, said['functional'])
        assert said['switches'] == switches, (rank, said['switches'])
        assert said['raised'] == raised, (rank, said['raised'])
        assert said['mismatch'] is not None and 'ranks disagree on' in said['mismatch']
        for words in shapes:
            assert words in said['mismatch'], (rank, words, said['mismatch'])
        assert said['mismatch_hits'] == ({'hit': 4} if rank == 0 else {'hit': 3, 'miss': 1})


@pytest.mark.parametrize('design', NAMES)
def test_a_burst_of_horovod_calls_is_prepared_and_right(design, designs):
    out = run_designs(2, 'burst_hvd.py', design, designs, timeout=240)
    check(out, design, 2)
