"""engine.native.copy_out, the copy of a reduced bucket from the fuse buffer into its arrays
(fuse.py's fused runs, run_bucket's several arrays): a float's Average or factor multiplied
in the copy's one pass, an integer's floor division and truncated factor applied in place
first, as layout.SCALES / FACTORS say. Checked against numpy, per array, on a record built
here with the layout's words (no MPI, no engine op). One process."""
import numpy as np
import pytest

from mpi_kvstore.engine import layout as L
from mpi_kvstore.engine import native, records

pytestmark = pytest.mark.unit

COUNTS = (5, 1, 4096, 33)     # the bucket's arrays, one after the other in the fuse buffer


def _expected(summed, dtype, average, factor, size):
    """What the arrays hold after the scale (reduce.scale's rules), by numpy."""
    if np.dtype(dtype).kind == 'f':
        scale = factor / size if average else factor
        return summed * np.dtype(dtype).type(scale)
    value = summed // size if average else summed
    if factor == 1.0:
        return value
    return (value.astype(np.float64) * factor).astype(dtype)   # truncated toward zero


def _record(outs, how, factor):
    n = len(outs)
    rec = np.zeros(L.HEADER + L.SLOT * n + L.BSLOT, dtype=np.int64)
    rec[L.SELF], rec[L.COUNT], rec[L.NBUCKETS] = rec.ctypes.data, n, 1
    rec[L.FNS] = records.function_table().ctypes.data       # copy_arrays' memcpy
    for i, out in enumerate(outs):
        slot = L.HEADER + L.SLOT * i
        rec[slot + L.A_DATA], rec[slot + L.A_OFFSET] = out.ctypes.data, 0
        rec[slot + L.A_NBYTES] = out.nbytes
    s = L.HEADER + L.SLOT * n
    rec[s + L.B_SCALE], rec[s + L.B_FIRST], rec[s + L.B_ARRAYS] = how, 0, n
    rec[s + L.B_COUNT] = sum(out.size for out in outs)
    rec[s + L.B_FACTOR:s + L.B_FACTOR + 1].view(np.float64)[0] = factor
    return rec, s


@pytest.mark.parametrize('dtype', ['float32', 'float64', 'int32', 'int64'])
@pytest.mark.parametrize('average, factor', [(False, 1.0), (True, 1.0), (False, 0.37),
                                             (True, 3.0), (True, -0.6)])
def test_copy_out_scales_each_array_as_numpy(dtype, average, factor):
    size = 3
    how = (L.SCALES[np.dtype(dtype)] if average else
           L.FACTORS[np.dtype(dtype)] if factor != 1.0 else 0)
    rng = np.random.default_rng(7)
    summed = (rng.integers(-1000, 1000, sum(COUNTS)) * (1.37 if dtype[0] == 'f' else 1)
              ).astype(dtype)
    fused = summed.copy()
    outs = [np.full(c, 99, dtype=dtype) for c in COUNTS]
    rec, s = _record(outs, how, factor)
    native.copy_out(rec, s, fused.ctypes.data, size)
    want = _expected(summed, dtype, average, factor, size)
    at = 0
    for out in outs:
        np.testing.assert_array_equal(out, want[at:at + out.size])
        at += out.size
