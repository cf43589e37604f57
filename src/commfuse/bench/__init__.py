"""Measuring and reporting, above the runs: benchmark runners, comparisons of strategies (plain
and fault-tolerant), the simulator's calibration and validation runs, and their tables."""
