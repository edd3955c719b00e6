"""The C parts built with the package (docs/native.md): ``pip install .`` compiles them, a
wheel carries them, an editable install builds them in place. Both are optional: where they
cannot be built the install still succeeds and commcheck builds them on first use or uses
its Python paths. Everything else is in pyproject.toml.

Each library carries the key of the sources it was built from (``CC_SOURCE_KEY``), so a
source tree edited since its last build is not served by a stale library
(commcheck/native/loader.py: ``source_key`` computes the same key).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

NATIVE = Path("commcheck/native")
FLAGS = ["-O2"]
OPENMP = ["-fopenmp"]


def source_key(*names: str) -> str:
    return hashlib.sha256(b"\0".join((NATIVE / n).read_bytes() for n in names)).hexdigest()[:20]


def extension(name: str, source: str, *depends: str) -> Extension:
    return Extension(f"commcheck.native.{name}", [str(NATIVE / source)],
                     depends=[str(NATIVE / d) for d in depends],
                     define_macros=[("CC_SOURCE_KEY", f'"{source_key(source, *depends)}"')],
                     extra_compile_args=[*FLAGS, *OPENMP], extra_link_args=OPENMP,
                     optional=True)


class BuildExt(build_ext):
    """OpenMP where the compiler has it, else the same library on one thread (as the
    first-use build does)."""

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception:
            ext.extra_compile_args = FLAGS
            ext.extra_link_args = []
            super().build_extension(ext)


setup(
    ext_modules=[extension("_kernel", "kernel.c"),
                 extension("_hot", "hot.c", "kernel.c", "ccapi.h", "express.c", "gate.c")],
    cmdclass={"build_ext": BuildExt},
)
