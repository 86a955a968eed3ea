"""Load tests and benchmarks for the router (not part of the test suite; see docs/benchmarks.md)."""
