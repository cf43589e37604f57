"""Benchmark runners and reports (nccl-tests style)."""
