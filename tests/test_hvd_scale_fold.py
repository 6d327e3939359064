"""Horovod's Average and scale factors folded into the reduction (issue 43): one engine op a
call where the factors were 1-3 more.

scenarios/hvd_scale_fold.py on every design at 2 ranks: float32, float64, int32, int64 and
float16 through Sum and Average with prescale and postscale factors, by hvd.allreduce_,
hvd.allreduce, hvd.grouped_allreduce_ and hvd.grouped_allreduce, 3 calls a case on the same
arrays and names (a changed factor on a prepared name), right as numpy computes Horovod's
postscale * op(prescale * x); the debug counter hvd 'scale_op' shows no engine op of its own
for float32 and float64 (where each call's factors made 1-2 before: `tensor *= factor`), and
only an integer's or a float16's prescale, which cannot fold, keeps its op. Ranks giving
different factors under one name fail with RankMismatchError on every rank.

The unit tests check the scaling itself, compiled (engine/native.py _scale, what the chained
design runs) and in numpy (comm/reduce.py scale, the other designs), against Horovod's
formula in float64, and the records' factor word.
"""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpi_kvstore.designs import NAMES

from mpi_harness import result, run_designs

DTYPES = ('float32', 'float64', 'int32', 'int64', 'float16')
# scenarios/hvd_scale_fold.py's CASES: (average, prescale, postscale)
CASES = ((False, 1.0, 1.0), (True, 1.0, 1.0), (False, 0.5, 1.0), (False, 1.0, 3.0),
         (True, 0.5, 3.0), (True, 2.0, 0.25), (False, 3.0, 0.5), (True, 1.0, 0.5),
         (False, 1.0, 1.0))
STEPS = 3


def scale_ops(dtype, case):
    """Engine ops of their own in one call of one tensor: float32 and float64 fold both
    factors; an integer's and a float16's prescale stays an op (horovod.ops._fold)."""
    return 0 if dtype in ('float32', 'float64') or case[1] == 1.0 else 1


@pytest.mark.parametrize('design', NAMES)
def test_scale_factors_are_folded_and_right(design, designs):
    out = run_designs(2, 'hvd_scale_fold.py', design, designs, timeout=300)
    name = 'hvd_scale_fold[%s]' % design
    assert '%s: OK at 2 ranks' % name in out, out[-3000:]
    for rank in result(out, name)['ranks']:
        for dtype in DTYPES:
            # per case: [scale ops of allreduce_ and allreduce over 3 steps, fastpath hits
            # of allreduce_'s steps 2-3 (the prepared call, keyed by the factors), again
            # 'copy' of allreduce's steps 2-3 (only where nothing is left as an op)]
            assert rank['single'][dtype] == [
                [2 * STEPS * scale_ops(dtype, c), 2, 2 if scale_ops(dtype, c) == 0 else 0]
                for c in CASES], (dtype, rank['single'][dtype])
        assert rank['groups'] == [
            [STEPS * sum(scale_ops(d, c) for d in DTYPES),
             2 if all(scale_ops(d, c) == 0 for d in DTYPES) else 0] for c in CASES]
        assert rank['unnamed'] == 2   # an unnamed call with factors: prepared from its 2nd
        said = rank['mismatch']
        assert 'ranks disagree' in said, said
        assert 'rank 0 has scale factor 2.0, rank 1 has scale factor 3.0' in said, said
        # the last step's checks (the scenario checks every step, and records the last)
        assert len(rank['checked']) == len(DTYPES) * len(CASES) * 3 + 3
        for what, (shape, total) in rank['checked'].items():
            assert shape == rank['expected'][what][0], what
            assert total == pytest.approx(rank['expected'][what][1], rel=1e-2, abs=1e-2), what


def horovod(summed, dtype, average, factor, size):
    """The scaling after the sum as horovod.ops did it as an engine op before the fold:
    floats multiplied in their own precision, integers in float64 and truncated."""
    dtype = np.dtype(dtype)
    if dtype.kind == 'f':
        return summed * dtype.type(factor / size if average else factor)
    out = summed // size if average else summed.copy()
    return (out.astype(np.float64) * factor).astype(dtype) if factor != 1.0 else out


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(['float32', 'float64', 'int32', 'int64']),
       average=st.booleans(),
       factor=st.sampled_from([1.0, 0.5, 3.0, 0.25, 1 / 3, -2.0, 1e-3]),
       size=st.integers(1, 5),
       values=st.lists(st.integers(-10 ** 6, 10 ** 6), min_size=0, max_size=40))
def test_the_compiled_and_numpy_scaling_agree_with_horovods(dtype, average, factor, size,
                                                           values):
    from mpi_kvstore.comm.reduce import scale
    from mpi_kvstore.engine import layout, native
    summed = np.array(values, dtype=dtype)
    want = horovod(summed, dtype, average, factor, size)
    mine = summed.copy()
    scale(mine, average, factor, size)
    np.testing.assert_array_equal(mine, want)
    compiled = summed.copy()
    how = (layout.SCALES[np.dtype(dtype)] if average
           else layout.FACTORS[np.dtype(dtype)] if factor != 1.0 else 0)
    native.scale(compiled.ctypes.data, compiled.size, how, size, factor)
    np.testing.assert_array_equal(compiled, want)


def test_a_factor_joins_the_signature_and_keeps_requests_apart_in_fusion():
    """Ranks that scale differently must not fuse alike (fusion plans from agreed metadata),
    and Horovod calls different factors a mismatch: the factor is in the signature (a plain
    sum's signature is as before) and requests with different factors share no bucket."""
    from mpi_kvstore.comm import fusion
    from mpi_kvstore.comm.collective import Collective
    f32 = np.dtype('float32')
    plain = Collective('allreduce', 'x', f32, (4,))
    same = Collective('allreduce', 'x', f32, (4,), factor=1.0)
    half = Collective('allreduce', 'x', f32, (4,), factor=0.5)
    third = Collective('allreduce', 'x', f32, (4,), factor=1 / 3)
    assert plain.sig == same.sig and len({plain.sig, half.sig, third.sig}) == 3
    assert (plain.factor, half.factor) == (1.0, 0.5)
    assert half.renewed().factor == 0.5 and half.renewed().sig == half.sig
    assert fusion._compatible(half, Collective('allreduce', 'y', f32, (2,), factor=0.5))
    assert not fusion._compatible(half, plain) and not fusion._compatible(half, third)


def test_three_ranks_fold_alike_on_the_native_op():
    """The chained design's compiled op (engine/native.py, fuse.py) at 3 ranks: an Average
    divides by 3, an integer's truncation differs from a floor there."""
    out = run_designs(3, 'hvd_scale_fold.py', 'chained', ('chained',), timeout=300)
    assert 'hvd_scale_fold[chained]: OK at 3 ranks' in out, out[-3000:]
