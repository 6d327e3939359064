"""python -m mpi_kvstore doctor, checked against what this process finds by itself."""
import os

import numba
from mpi4py import MPI

from mpi_kvstore import doctor
from common import RANK, SIZE, done

lines = doctor.report()
text = '\n'.join(lines)
library = ' '.join(MPI.Get_library_version().split('\n')[0].split())
assert 'rank %d of %d' % (RANK, SIZE) in lines[0], lines[0]
assert library in text, (library, text)
assert 'numba:            %s' % numba.__version__ in text, text
assert 'CUDA-aware MPI:   no (asked of the MPI library)' in text, text   # the mpich wheel
chosen = os.environ.get('MPI_KVSTORE_DESIGN', 'funneled')
assert '  * %-10s usable' % chosen in lines, (chosen, text)
if 'MPI_LOCALRANKID' in os.environ:       # hydra sets it
    local = 'local rank %s of %s (from MPI_LOCALRANKID)' % (
        os.environ['MPI_LOCALRANKID'], os.environ['MPI_LOCALNRANKS'])
    assert local in text, (local, text)
done('doctor_report')
