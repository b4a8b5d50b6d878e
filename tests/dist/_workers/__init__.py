"""Subprocess workers and their harness for the multi-process layer-1 tests."""
