"""Where the host's time goes in the README command's steps (issue 20): cProfile over
`bench/chooser_trace.py MODE TOKENS` in this process, then graphrt's functions by own
time and the launch path's callees by cumulative time.

Run: python bench/host_profile.py [auto|no-draft] [tokens, default 2000]
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys

import chooser_trace

mode = sys.argv[1] if len(sys.argv) > 1 else "auto"
tokens = sys.argv[2] if len(sys.argv) > 2 else "2000"
sys.argv = ["chooser_trace.py", mode, tokens]
profiler = cProfile.Profile()
profiler.enable()
try:
    chooser_trace.main()
finally:
    profiler.disable()
out = io.StringIO()
stats = pstats.Stats(profiler, stream=out)
stats.sort_stats("tottime").print_stats(
    r"graphrt|main/(core|spec|devices)|torch/cuda/graphs|torch/_tensor", 40
)
stats.sort_stats("cumulative").print_callees(r"_launch_round|_launch_plain|_launch_ahead")
print(out.getvalue()[-24000:])
