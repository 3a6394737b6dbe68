"""Benchmark drivers and performance scripts."""
