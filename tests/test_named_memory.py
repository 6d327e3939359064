"""Named collectives in bounded memory: the store keeps at most ``name_cache_capacity``
staging buffers (namecache.NameCache, least recently used out, none whose collective is in
flight), so a script that names a collective per step does not grow.

Before the bound, 20,000 calls of ``mpi_kvstore.allreduce(x, name='metric_%d' % i)`` of
4 KB grew RSS by 69-77 MB over the second 10,000 (8.9 KB a call: a 4 KB buffer and what
MXNet keeps with it).
"""
import numpy as np
import pytest

from mpi_kvstore.store.namecache import NameCache

from mpi_harness import result, run_mpi

# The suite's soak: 8,000 calls (38 s at 2 ranks on 2 cores shared at load 10; 50,000 took
# 189 s, run by hand: kv_named_soak.py funneled 50000). The second half starts 4,000 calls in,
# far past the 1,024 buffers of the default capacity.
SOAK_CALLS = 8000
# Bound on RSS growth over the second half. Bounded, it measured 0.06-0.5 MB at 4,000-20,000
# calls and 1.95 MB at 50,000 (funneled, 2 ranks); with the bound removed, 35.9 MB at 8,000
# (9.4 KB a call).
BOUND_MB = 5.0


class _User:
    """Stands in for a Collective: ``done`` once no op uses the value."""

    def __init__(self, done=True):
        self.done = done


def test_least_recently_used_goes_first():
    cache = NameCache(2)
    cache.keep('a', 1, _User())
    cache.keep('b', 2, _User())
    assert cache.get('a') == 1          # 'a' is now the most recently used
    cache.keep('c', 3, _User())
    assert 'b' not in cache and cache.get('a') == 1 and cache.get('c') == 3
    assert len(cache) == 2
    cache.keep('c', 30, _User())        # kept again: replaced, not added
    assert cache.get('c') == 30 and len(cache) == 2


def test_values_in_flight_stay_past_the_capacity():
    cache = NameCache(1)
    first, second = _User(done=False), _User(done=False)
    cache.keep('a', 1, first)
    cache.keep('b', 2, second)          # 'a' is in flight: it stays
    assert cache.get('a') == 1 and cache.get('b') == 2 and len(cache) == 2
    first.done = True
    cache.keep('c', 3, _User(done=False))
    # 'a' was done: it goes; 'b' still in flight stays, although it is now the oldest
    assert 'a' not in cache and 'b' in cache and 'c' in cache
    second.done = True
    cache.keep('d', 4, _User())         # the value just kept stays, even when done at once
    assert 'b' not in cache and 'c' in cache and cache.get('d') == 4 and len(cache) == 2


def test_capacity_zero_keeps_nothing():
    cache = NameCache(0)
    cache.keep('a', 1, _User(done=False))
    assert len(cache) == 0 and cache.get('a') is None


@pytest.mark.parametrize('bad', [-1, 1.5, '8', True, None])
def test_bad_capacity_is_refused(bad):
    with pytest.raises(ValueError, match='capacity must be an int >= 0'):
        NameCache(bad)


def test_horovod_cache_capacity_variable():
    from mpi_kvstore.horovod import environment_options
    options, ignored = environment_options({'HOROVOD_CACHE_CAPACITY': '16'})
    assert options == {'name_cache_capacity': 16} and ignored == []
    options, _ = environment_options({'HOROVOD_CACHE_CAPACITY': '16',
                                      'MPI_KVSTORE_NAME_CACHE_CAPACITY': '4'})
    assert 'name_cache_capacity' not in options   # the store reads its own variable
    with pytest.raises(ValueError, match='HOROVOD_CACHE_CAPACITY'):
        environment_options({'HOROVOD_CACHE_CAPACITY': 'many'})


def _summary(out):
    return '\n'.join(line for line in out.splitlines() if line.startswith('kv_named_soak'))


def test_rss_flat_over_uniquely_named_allreduces(mpi_available):
    out = run_mpi(2, 'kv_named_soak.py', 'funneled', SOAK_CALLS, BOUND_MB, timeout=300)
    print(_summary(out))
    assert 'kv_named_soak[funneled]: OK at 2 ranks' in out, out[-2000:]
    for report in result(out, 'kv_named_soak[funneled]')['ranks']:
        assert report['calls'] == SOAK_CALLS and report['growth_mb'] < BOUND_MB, report
        # at most the capacity's buffers, and those of the checks still in flight (64); the
        # allreduces run in place and keep a signature per name, at most 4096 of them
        assert report['kept'] <= report['capacity'] + 64, report
        assert 0 < report['signed'] <= 4096, report


@pytest.mark.parametrize('design,capacity', [('chained', 0), ('concurrent', 1)])
def test_names_evicted_and_used_again_sum_right(design, capacity, mpi_available):
    # Names come back after the store dropped their buffers, in the functional API and in
    # mpi_kvstore.horovod (its store takes HOROVOD_CACHE_CAPACITY); 400 uniquely named calls
    # after them. Their RSS bound is loose: the chained design's plans, bounded apart from
    # this (4,096 call shapes, ~1.5 KB each), are still filling up at this count.
    out = run_mpi(2, 'kv_named_soak.py', design, 400, 16.0, capacity, timeout=180,
                  env={'HOROVOD_CACHE_CAPACITY': str(capacity)})
    print(_summary(out))
    assert 'kv_named_soak[%s]: OK at 2 ranks' % design in out, out[-2000:]

    def full(shape, value):       # [shape, sum] of an array of VALUE, as the scenario reports
        return [list(shape), pytest.approx(float(np.prod(shape)) * value)]
    for report in result(out, 'kv_named_soak[%s]' % design)['ranks']:
        seen = report['checked']
        # capacity + 2 names, three rounds: each name dropped and used again; ranks 0 and 1
        # push (rank + 1 + shift), the last rank broadcasts 100 + shift
        for round_ in range(3):
            for j in range(capacity + 2):
                shift = 10 * round_ + j
                for collectives in ('functional', 'horovod'):
                    assert seen['%s reused_%d, round %d' % (collectives, j, round_)] == full(
                        (8,), 3 + 2 * shift)
                assert seen['functional reused_%d broadcast, round %d' % (j, round_)] == full(
                    (5,), 100 + shift)
                assert seen['horovod reused_%d int32 mean, round %d' % (j, round_)] == full(
                    (2, 3), (3 + 2 * shift) // 2)
        # then 400 uniquely named calls, checked 64 at a time: metric_i sums to 3 + 2 i
        assert seen['allreduce of metric_0..63'] == [[64, 1024], pytest.approx(
            1024 * sum(3 + 2 * i for i in range(64)))]
        assert report['kept'] <= capacity + 64, report
