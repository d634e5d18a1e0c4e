# setuptools reads everything from pyproject.toml; this file exists only because cffi's
# setuptools integration (cffi_modules) has no pyproject.toml equivalent yet.
from setuptools import setup

setup(cffi_modules=["native/build_vfio.py:ffibuilder", "native/build_cpu_kernels.py:ffibuilder"])
