"""Benchmarks that replay real load against Antiphon and a baseline, side by side."""
