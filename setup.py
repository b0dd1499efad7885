"""Build script. Metadata lives in pyproject.toml; this file lists the packages (and, later, the
native proxy extension under csrc/)."""
from setuptools import setup

setup(packages=["moe_ep", "moe_ep.kernels", "moe_ep.proxy", "bench"])
