"""Calibration: fit the cost model to a machine from micro-benchmarks or traces."""
