"""Builds the optional C extensions kvx._datapath._native and kvx._datapath._cma (csrc/), and ships
the CUDA kernel sources (csrc/*.cu) in the package.

KVX_ASAN=1 builds it with AddressSanitizer (run with LD_PRELOAD of libasan).
Without a working C compiler the build goes on without the extension, and
kvx runs on the pure-Python twin (kvx/_datapath/io_py.py).
"""

import os
import shutil
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py


class BuildPy(build_py):
    """Ships csrc/*.cu inside the package (kvx/csrc/): kvx._datapath.gpu compiles them at run time."""

    def run(self):
        super().run()
        target = Path(self.build_lib) / "kvx" / "csrc"
        target.mkdir(parents=True, exist_ok=True)
        for source in Path("csrc").glob("*.cu"):
            shutil.copy(source, target / source.name)


cflags = ["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror=implicit-function-declaration"]
ldflags = []
if os.environ.get("KVX_ASAN") == "1":
    cflags += ["-fsanitize=address", "-fno-omit-frame-pointer", "-g", "-O1"]
    ldflags += ["-fsanitize=address"]


def verbs_extension():
    """kvx._verbs (csrc/kvx_verbs.c) where rdma-core's headers exist; it dlopens libibverbs."""
    if not Path("/usr/include/infiniband/verbs.h").exists() and not os.environ.get("KVX_VERBS"):
        return []
    return [
        Extension(
            "kvx._verbs",
            sources=["csrc/kvx_verbs.c"],
            extra_compile_args=cflags,
            extra_link_args=ldflags + ["-ldl"],
            optional=True,
        )
    ]


setup(
    cmdclass={"build_py": BuildPy},
    ext_modules=[
        Extension(
            name,
            sources=[source],
            extra_compile_args=cflags,
            extra_link_args=ldflags,
            optional=os.environ.get("KVX_NATIVE") != "1",
        )
        for name, source in (
            ("kvx._datapath._native", "csrc/kvx_io.c"),
            ("kvx._datapath._cma", "csrc/kvx_cma.c"),
        )
    ]
    + verbs_extension(),
)
