"""MXNet's dependency engine, from the outside: the libmxnet handle (``libmxnet``), array
views and layouts (``arrays``), the engine calls that push ops (``push``), Python functions
as engine ops (``core``), the compiled (numba) ops (``native``, which call C through
``comm.ccall``), the records they share with Python, declared once (``layout``), and their
Python side (``records``).

It may import ``comm`` (the MPI entry points the compiled ops call) and the root modules.
"""
