"""``python -m stepwatch.agents.profiling summarize TRACE STEPS [GZ_OUT]`` (see :func:`.summary._main`)."""
import sys

from .summary import _main

sys.exit(_main(sys.argv[1:]))
