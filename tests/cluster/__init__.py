"""Cluster in a box: see tests/cluster/harness.py."""
