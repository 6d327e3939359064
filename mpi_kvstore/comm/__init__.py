"""The host side of communication, without MXNet: mpi4py's handle and the MPI facts
(``mpiabi``), the request type a design runs (``collective``), buffers and shares
(``fusion``), the host communicator (``host``) with its reduction (``reduce``), hierarchy,
device routing and ``transports/``, the agreement and consensus messages, the tune table
(``tuning``) and the topology it is keyed by, the timeline writer, and the wait that polls
MPI without the GIL (``progress``, calling C through ``ccall``).

It may import only the package's root modules (``config``, ``errors``, ``debug``), mpi4py,
numpy and numba: the GPU machine imports it with CuPy and without MXNet.
"""
