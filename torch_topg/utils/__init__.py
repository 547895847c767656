"""Utilities shared by tests, benchmarks and examples."""
