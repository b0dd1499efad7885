"""Build script. Metadata lives in pyproject.toml; this file finds the packages (``moe_ep`` and
its subpackages, nothing else at top level: the bench harness is ``moe_ep.bench``) and the native
proxy engine (csrc/proxy, plain C++17 with a C API loaded through ctypes: no CUDA, no RDMA
libraries needed: libibverbs is opened at run time when present; Python's headers only for the
one launch function of csrc/launch/launch.cc, in the stable ABI)."""
import glob
import json

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext


class BuildExt(build_ext):
    """build_ext that records the compile flags in the library: the compiler's own (Python's
    CFLAGS, the environment's) and the extension's, as the string MOE_EP_BUILD_FLAGS that
    ``moe_ep_build_info()`` returns (``python -m moe_ep.doctor`` reports it)."""

    def build_extensions(self):
        base = getattr(self.compiler, "compiler_so", None) or ["?"]
        for ext in self.extensions:
            flags = " ".join([*base[1:], *ext.extra_compile_args])
            ext.define_macros.append(("MOE_EP_BUILD_FLAGS", json.dumps(f"{flags} (setup.py build_ext)")))
        super().build_extensions()


native = Extension(
    "moe_ep.native._native",
    sources=sorted(glob.glob("csrc/proxy/*.cc") + glob.glob("csrc/launch/*.cc")),  # one library: proxy and launcher
    depends=sorted(glob.glob("csrc/proxy/*.h") + glob.glob("csrc/launch/*.h")),
    language="c++",
    extra_compile_args=["-O2", "-std=c++17", "-pthread", "-fvisibility=hidden"],
    extra_link_args=["-pthread", "-ldl"],  # dlopen of libibverbs at run time (libdl is a stub on glibc >= 2.34)
)

setup(packages=find_packages(include=["moe_ep", "moe_ep.*"]),
      package_data={"moe_ep.bench": ["schema.json"]}, ext_modules=[native], cmdclass={"build_ext": BuildExt})
