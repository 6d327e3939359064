"""An alpha-beta model of a data-parallel training step, calibrated on the test bed.

model (the formulas), fit (calibration, validation and the learned overlap), report (tables
and the plot); ``python -m benchmarks.cost_model`` (__main__) runs them. The formulas, what
each constant is fitted on and the stated assumptions: docs/cost-model.md.
"""
