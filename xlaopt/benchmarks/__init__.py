"""Benchmarks behind `xlaopt bench`: xlaopt and its anchor side by side in one process run."""
