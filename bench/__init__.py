"""Benchmarks and benchmark harnesses (run as scripts; importable as ``bench.*`` from the repo root)."""
