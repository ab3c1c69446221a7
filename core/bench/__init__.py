"""Benchmarks behind `graphrt bench`: decode step latency against the bandwidth floor."""
