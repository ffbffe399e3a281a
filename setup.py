"""The one compiled part: a guarded copy out of a pool's mapping (mmsched/transport/_guarded_copy.c).

Optional: where it does not build (no C compiler), pooled segments are read with pread,
as before, at about two thirds of the speed (docs/performance.md)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("mmsched.transport._guarded_copy", ["mmsched/transport/_guarded_copy.c"],
                             optional=True)])
