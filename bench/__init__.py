"""Benchmarks: each prints its figures and the command that reproduces them."""
