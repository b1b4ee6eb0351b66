"""``asgi-generate`` (or any module run with ``-m``) under cProfile, for
profile_hop.py --tool cprofile.

Run as ``python bench/_profiled.py -m asgi_generate serve ...`` (or with
a script's path for ``-m MODULE``). SIGUSR1
starts profiling the event loop's thread; SIGUSR2 stops it and writes the
pstats file named by ``PROFILED_OUT``. Call counts are exact; times carry
the profiler's own overhead, so read them as shares, not microseconds.
"""

from __future__ import annotations

import cProfile
import os
import runpy
import signal
import sys

_profile = cProfile.Profile()


def _start(*_: object) -> None:
    _profile.enable()


def _stop(*_: object) -> None:
    _profile.disable()
    _profile.dump_stats(os.environ["PROFILED_OUT"])


signal.signal(signal.SIGUSR1, _start)
signal.signal(signal.SIGUSR2, _stop)

if __name__ == "__main__":
    if sys.argv[1] == "-m":
        sys.argv = sys.argv[2:]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = sys.argv[1:]
        runpy.run_path(sys.argv[0], run_name="__main__")
