"""Benchmarks: programs that print figures (JSON + a markdown table), never tests."""
