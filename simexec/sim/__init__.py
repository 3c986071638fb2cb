"""The simulator: a discrete-event engine (SimPy) over a cost model of the cluster.

`engine` runs a program (one process per rank and stream); `machine` is the hardware it runs on,
built from `compute` (roofline costs) and `network` (links, fair sharing, collective algorithms);
`memory` and `breakdown` read the recorded times afterwards; `profile` applies calibrated costs.
`simexec.sim.simulate.simulate` ties them together.
"""
