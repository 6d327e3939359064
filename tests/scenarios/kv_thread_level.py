"""A design needing more MPI thread support than MPI provides is refused, by name.

Run with MPI4PY_RC_THREAD_LEVEL=serialized (mpi4py then initialises MPI so).
"""
from mpi4py import MPI

import mpi_kvstore

from common import done, expect_raises

provided = MPI.Query_thread()
assert provided == MPI.THREAD_SERIALIZED, 'expected MPI_THREAD_SERIALIZED, got %d' % provided
err = expect_raises(mpi_kvstore.ThreadLevelError, mpi_kvstore.create, 'dist_mpi',
                    design='concurrent')
assert 'MPI_THREAD_MULTIPLE' in str(err) and 'MPI_THREAD_SERIALIZED' in str(err), err
for design in ('funneled', 'chained', 'blocking'):
    mpi_kvstore.create('dist_mpi', design=design).close()
done('kv_thread_level', provided=provided, refused=str(err))
