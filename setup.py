"""Builds the native extension `lorafn._ipc` (csrc/ipc/). All metadata lives in pyproject.toml.

The extension needs only a C compiler and Python's headers: it loads the CUDA driver (libcuda.so.1)
at run time with dlopen, so it builds on machines without a GPU or a CUDA toolkit.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "lorafn._ipc",
            sources=["csrc/ipc/ipc.c"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wno-missing-field-initializers"],
            libraries=["dl"],
            # CPU mode needs no native code: a machine without a C compiler still installs lorafn
            # (GPU sharing then says that lorafn._ipc is not built).
            optional=True,
        )
    ],
)
