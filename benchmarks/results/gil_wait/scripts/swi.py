"""Run benchmarks.overlap with the interpreter's GIL switch interval set (argv[1], seconds)."""
import os
import runpy
import sys

sys.path.insert(0, os.getcwd())
sys.setswitchinterval(float(sys.argv[1]))
sys.argv = ['benchmarks.overlap'] + sys.argv[2:]
runpy.run_module('benchmarks.overlap', run_name='__main__', alter_sys=True)
