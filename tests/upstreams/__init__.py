"""Fault-injecting fake model servers on loopback, for gateway tests and benchmarks."""
