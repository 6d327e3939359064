"""Packaging for mpi_kvstore: an MPI KVStore for Apache MXNet 1.9.1."""
import os

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _long_description():
    # The README is written alongside the code; build even before it exists.
    path = os.path.join(HERE, 'README.md')
    if not os.path.exists(path):
        return ''
    with open(path, encoding='utf-8') as f:
        return f.read()


setup(
    name='mpi_kvstore',
    version='0.1.0',
    description=('An MPI KVStore for Apache MXNet 1.9.1: mpi4py collectives '
                 "pushed into MXNet's dependency engine"),
    long_description=_long_description(),
    long_description_content_type='text/markdown',
    license='Apache-2.0',
    packages=find_packages(include=['mpi_kvstore', 'mpi_kvstore.*']),
    python_requires='>=3.8',
    # MXNet comes from an extra: the CPU wheel ('cpu') and the GPU wheels (mxnet-cu11x
    # 1.9.1, brought by the user) install the same 'mxnet' folder, so requiring 'mxnet'
    # here would make pip put the CPU wheel over a GPU one.
    install_requires=[
        # mxnet 1.9.1 still uses aliases (np.bool, ...) that numpy 1.24 removed.
        'numpy<1.24',
        'mpi4py>=3.1',
        # Compiles the engine ops that must not run Python (native.py); 0.60 and 0.68
        # both work beside numpy<1.24.
        'numba>=0.60',
        # bfloat16 for the bf16 wire compression (compression.py); 0.5.4 works with numpy<1.24.
        'ml-dtypes>=0.5',
    ],
    extras_require={
        'cpu': ['mxnet==1.9.1'],
        # The PyPI 'mpich' wheel gives a working mpiexec without root or a system MPI.
        'mpich': ['mpich'],
        'examples': ['tqdm'],
        'bench': ['matplotlib'],
        # ruff and import-linter: the suite checks lint and the layers (tests/test_layout.py).
        'test': ['pytest', 'hypothesis', 'ruff', 'import-linter'],
        # GPU users bring their own mxnet-cu11x 1.9.1 wheel (CUDA 11); the last CuPy
        # wheel for CUDA 11 is cupy-cuda11x 13.6.0 ('cupy' alone is the source package,
        # which needs nvcc).
        'gpu': ['cupy-cuda11x==13.6.0'],
    },
    classifiers=[
        'License :: OSI Approved :: Apache Software License',
        'Programming Language :: Python :: 3',
        'Operating System :: POSIX :: Linux',
        'Topic :: Scientific/Engineering :: Artificial Intelligence',
        'Topic :: System :: Distributed Computing',
    ],
)
