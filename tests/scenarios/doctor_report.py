"""python -m mpi_kvstore doctor, checked against what this process finds by itself."""
import json
import os
import tempfile

import numba
from mpi4py import MPI

from mpi_kvstore.cli import doctor

from common import RANK, SIZE, done

lines = doctor.report()
first = lines        # for the test
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
assert 'tune table:       none' in text, text

# With a table: its rows as the store would read them, device rows included.
path = os.path.join(tempfile.mkdtemp(prefix='doctor_'), 'table.json')
with open(path, 'w') as fh:
    json.dump({'version': 1, 'comm_size': SIZE, 'measured_ms': {},
               'allreduce': [{'bytes': 4096, 'algorithm': 'mpi'},
                             {'bytes': 16 << 20, 'algorithm': 'rsag'}],
               'device': [{'bytes': 4096, 'transport': 'nccl'},
                          {'bytes': 64 << 20, 'transport': 'staged'}]}, fh)
os.environ['MPI_KVSTORE_TUNE_TABLE'] = path
text = '\n'.join(doctor.report())
assert 'tune table:       %s, measured on %d ranks\n' % (path, SIZE) in text, text
assert '  allreduce:      4K mpi, 16M rsag' in text, text
assert '  GPU allreduce:  4K nccl, 64M staged' in text, text
with open(path, 'w') as fh:
    fh.write('{"version": 1}')
assert 'cannot be used: KeyError' in '\n'.join(doctor.report())
done('doctor_report', report=first, with_table=text.splitlines())
