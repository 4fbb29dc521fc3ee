"""Only the optional C extension lives here; everything else is in pyproject.toml.

``stepwatch.agents.probe._probefast`` is the probe's hot path (see agents/probe/_probefast.c, with _probefast_wrap.c,
_probefast_pack.c, _probefast_exit.c and _probefast.h). ``optional=True``:
where no C compiler or Python headers exist the build goes on without it and the probe runs its
pure-Python path (same records, more cost per step); ``stepwatch bench overhead`` says which one ran.
"""
from setuptools import Extension, setup

_SRC = "agents/probe/"
setup(ext_modules=[Extension("stepwatch.agents.probe._probefast",
                             [_SRC + "_probefast.c", _SRC + "_probefast_wrap.c", _SRC + "_probefast_pack.c",
                              _SRC + "_probefast_exit.c"],
                             depends=[_SRC + "_probefast.h"], optional=True,
                             extra_compile_args=["-O2", "-Wall", "-Wno-missing-field-initializers"])])
