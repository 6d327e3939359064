#!/bin/bash
# One prepared GPU run: the GPU tests, gpu_bandwidth at 1/2/4 ranks, tune with device rows.
set -u
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
# --prefix, not --target: --target drops the mpich wheel's data files (lib/libmpi.so.12)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --ignore-installed --prefix /tmp/mp .whl/*.whl || exit 3
LIB=$(dirname "$(find /tmp/mp -name libmpi.so.12 | head -1)")
SITE=$(dirname "$(find /tmp/mp -path '*/mpi4py/__init__.py' | head -1)")/..
ls $LIB/libmpi.so.12 /tmp/mp/bin/mpiexec || exit 4
export PYTHONPATH=$SITE:$PWD PATH=/tmp/mp/bin:$PATH
export MPI4PY_LIBMPI=$LIB/libmpi.so.12 LD_LIBRARY_PATH=$LIB:${LD_LIBRARY_PATH:-}
L=$OUT/test_gpu.log
{ date -u; nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import sys, numpy, cupy, mpi4py, ml_dtypes, numba; from cupy.cuda import nccl; print(sys.version.split()[0], 'numpy', numpy.__version__, 'cupy', cupy.__version__, 'nccl', nccl.get_version(), 'mpi4py', mpi4py.__version__, 'ml_dtypes', ml_dtypes.__version__, 'numba', numba.__version__)"
  timeout 30 mpiexec -n 2 python3 -c "from mpi4py import MPI; c=MPI.COMM_WORLD; print(c.rank, c.allreduce(c.rank+1), MPI.Get_library_version().splitlines()[0])"
} > $L 2>&1
cat $L
echo "== test_gpu.py + test_benchmarks gpu_bandwidth" | tee -a $L
[ -n "${SKIP_TESTS:-}" ] || MPI_KVSTORE_EXPECT_GPU=1 timeout 290 python3 -m pytest -q -p no:cacheprovider -rA --timeout 110 \
  tests/test_gpu.py tests/test_benchmarks.py::test_gpu_bandwidth 2>&1 | tee -a $L | tail -40
echo "== gpu_bandwidth"
[ -n "${SKIP_BW:-}" ] || for n in 1 2 4; do
  timeout 75 mpiexec -n $n python3 -m benchmarks.gpu_bandwidth --repeats 10 --json $OUT/gpu_bandwidth_$n.json 2>&1 | tee -a $OUT/gpu_bandwidth.log | tail -30
done
echo "== tune"
{ true
  [ -z "${TUNE1:-}" ] || timeout 120 mpiexec -n 1 python3 -m mpi_kvstore tune --sizes 4K,64K,1M,16M,64M --trials 5 --out $OUT/tune_1rank.json
  timeout 120 mpiexec -n 2 python3 -m mpi_kvstore tune --sizes 4K,64K,1M,16M,64M --trials 5 --out $OUT/tune_2ranks.json
  [ -z "${SKIP_TESTS:-}" ] || timeout 120 mpiexec -n 4 python3 -m mpi_kvstore tune --sizes 4K,1M,16M,64M --trials 5 --out $OUT/tune_4ranks.json
} 2>&1 | tee $OUT/tune.log | tail -40
date -u
