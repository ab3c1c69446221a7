"""The graphrt command line: generate, bench, info."""
