"""Builds the optional C extensions kvx._datapath._native, _cma and _cuda (csrc/), and ships
the CUDA kernel sources (csrc/*.cu) in the package.

kvx._fabric (csrc/kvx_fabric.c and csrc/kvx_post_*.c, the rdma backend's posting layer) is built
only where libfabric's headers are found (<rdma/fabric.h>: Debian's libfabric-dev) and links
-lfabric; elsewhere kvx builds exactly as without it. KVX_FABRIC=0 skips it.

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


def verbs_extension() -> list[Extension]:
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


def have_libfabric() -> bool:
    """Whether <rdma/fabric.h> is on the compiler's include path (CPATH, C_INCLUDE_PATH or the usual)."""
    if os.environ.get("KVX_FABRIC") == "0":
        return False
    dirs = ["/usr/include", "/usr/local/include"]
    for var in ("CPATH", "C_INCLUDE_PATH"):
        dirs += [d for d in os.environ.get(var, "").split(os.pathsep) if d]
    return any((Path(d) / "rdma" / "fabric.h").is_file() for d in dirs)


extensions = [
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
# kvx._datapath._cuda (csrc/kvx_cuda.c): the copy kernel's launch and wait through the CUDA
# driver, which it opens with dlopen at run time: it builds without CUDA.
extensions.append(
    Extension(
        "kvx._datapath._cuda",
        sources=["csrc/kvx_cuda.c"],
        extra_compile_args=cflags,
        extra_link_args=ldflags + ["-ldl"],
        optional=os.environ.get("KVX_NATIVE") != "1",
    )
)
if have_libfabric():
    extensions.append(
        Extension(
            "kvx._fabric",
            sources=["csrc/kvx_fabric.c", "csrc/kvx_post_ofi.c", "csrc/kvx_post_null.c"],
            depends=["csrc/kvx_post.h"],
            extra_compile_args=cflags + ["-pthread"],
            extra_link_args=ldflags + ["-pthread"],
            libraries=["fabric"],
            # Optional like the others: a broken libfabric install must not break kvx's install.
            optional=os.environ.get("KVX_NATIVE") != "1",
        )
    )

setup(
    cmdclass={"build_py": BuildPy},
    ext_modules=extensions + verbs_extension(),
)
