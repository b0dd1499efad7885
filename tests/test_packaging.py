"""The package as users get it (docs/ARCHITECTURE.md §13).

- The sdist holds the package, everything the native build needs (csrc/proxy's sources and
  headers, pyproject.toml, setup.py), the bench schema and the README, and nothing else (no tests,
  docs, scripts, venvs, caches, built libraries).
- The wheel puts only ``moe_ep`` (with its native library and the schema) and its dist-info into
  site-packages, and the console script ``moe-ep-bench``. Its library, like the one setup.py
  builds in a checkout, has none of the test hooks (csrc/testing: the tests' build only).
- Installed into a fresh venv, ``moe_ep`` is imported from that venv, the doctor reports its
  version, and the native library was built by setup.py with the flags it records.

``MOE_EP_DIST_DIR``: a directory holding the sdist and the wheel built from it (.ci/run's package
step builds them, then runs this file); without it the sdist is built here (seconds) and the
wheel tests skip (building one compiles the native library). ``MOE_EP_INSTALLED_PYTHON``: the
interpreter of a venv that has the wheel installed (.ci/run's second venv); without it that test
skips.
"""
from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile

import pytest

import native_hooks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIST_DIR = os.environ.get("MOE_EP_DIST_DIR")
INSTALLED_PYTHON = os.environ.get("MOE_EP_INSTALLED_PYTHON")


def _version() -> str:
    """The version pyproject.toml declares (tomllib is 3.11+: a regex over the one line)."""
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        return re.search(r'^version = "([^"]+)"$', f.read(), re.M).group(1)


VERSION = _version()
BASE = f"moe_ep-{VERSION}"


def test_one_version():
    """pyproject.toml's version is ``moe_ep.__version__`` (what the doctor reports)."""
    with open(os.path.join(ROOT, "moe_ep", "__init__.py")) as f:
        assert re.search(r'^__version__ = "([^"]+)"$', f.read(), re.M).group(1) == VERSION


def _checkout_files(pattern: str) -> set[str]:
    """Paths (relative to the checkout, '/'-separated) that the glob matches, caches left out."""
    return {os.path.relpath(p, ROOT).replace(os.sep, "/") for p in glob.glob(os.path.join(ROOT, pattern), recursive=True)
            if "__pycache__" not in p}


def _one(pattern: str) -> str:
    found = glob.glob(os.path.join(DIST_DIR, pattern))
    assert len(found) == 1, f"expected one {pattern} in MOE_EP_DIST_DIR={DIST_DIR}, found {found}"
    return found[0]


@pytest.fixture(scope="module")
def sdist_names(tmp_path_factory) -> set[str]:
    """The sdist's file names, without the leading ``moe_ep-<version>/`` (directories left out)."""
    if DIST_DIR:
        path = _one(f"{BASE}.tar.gz")
    else:  # build it from this checkout with setuptools' PEP 517 hook (no compiler involved)
        out = tmp_path_factory.mktemp("sdist")
        code = f"from setuptools import build_meta; print(build_meta.build_sdist({str(out)!r}))"
        r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
        path = os.path.join(out, r.stdout.strip().splitlines()[-1])
    with tarfile.open(path) as t:
        names = [m.name for m in t.getmembers() if m.isfile()]
    assert all(n.startswith(BASE + "/") for n in names), names
    return {n[len(BASE) + 1:] for n in names}


def test_sdist_holds_the_build_and_only_the_package(sdist_names):
    need = ({"README.md", "pyproject.toml", "setup.py", "MANIFEST.in", "PKG-INFO", "moe_ep/bench/schema.json"}
            | _checkout_files("csrc/proxy/*.cc") | _checkout_files("csrc/proxy/*.h") | _checkout_files("csrc/launch/*.cc")
            | _checkout_files("moe_ep/**/*.py"))
    assert not need - sdist_names, f"missing from the sdist: {sorted(need - sdist_names)}"
    # Beyond those: only what setuptools writes itself (the egg-info, setup.cfg's build tags).
    extra = {n for n in sdist_names - need if not n.startswith("moe_ep.egg-info/") and n != "setup.cfg"}
    assert not extra, f"not part of the package, yet in the sdist: {sorted(extra)}"
    assert not [n for n in sdist_names if n.endswith((".so", ".pyc")) or "__pycache__" in n]


TEST_HOOKS = ("moe_ep_set_fault", "moe_ep_verbs_destroy_qp", "moe_ep_test_memory_type", "moe_ep_imm_stress")


def _test_hooks(library: bytes) -> list:
    """The test hooks (csrc/testing/hooks.cc) whose names a built library holds."""
    return [h for h in TEST_HOOKS if h.encode() in library]


def test_setup_py_builds_no_test_hooks():
    """The library setup.py built into this checkout (pip install -e .) has none of the test hooks,
    which the tests' own build has."""
    built = glob.glob(os.path.join(ROOT, "moe_ep", "native", "_native*.so"))
    if not built:
        pytest.skip("no library built by setup.py in this checkout")
    with open(built[0], "rb") as f:
        assert not _test_hooks(f.read())
    with open(os.path.join(native_hooks.TEST_BUILD, "_native.so"), "rb") as f:  # the tests' build has them
        assert _test_hooks(f.read()) == list(TEST_HOOKS)


@pytest.fixture(scope="module")
def wheel() -> zipfile.ZipFile:
    if not DIST_DIR:
        pytest.skip("no wheel: MOE_EP_DIST_DIR is unset (.ci/run's package step builds one from the sdist)")
    with zipfile.ZipFile(_one(f"{BASE}-*.whl")) as z:
        yield z


def test_wheel_installs_moe_ep_only(wheel, sdist_names):
    names = wheel.namelist()
    dist_info = f"{BASE}.dist-info/"
    assert {n.split("/")[0] + "/" for n in names} == {"moe_ep/", dist_info}, sorted({n.split("/")[0] for n in names})
    py = {n for n in names if n.endswith(".py")}
    assert py == {n for n in sdist_names if n.startswith("moe_ep/") and n.endswith(".py")}
    assert "moe_ep/bench/schema.json" in names
    (lib,) = [n for n in names if re.fullmatch(r"moe_ep/native/_native\.[^/]*so", n)]
    assert not _test_hooks(wheel.read(lib))
    assert wheel.read(dist_info + "top_level.txt").decode().split() == ["moe_ep"]
    scripts = wheel.read(dist_info + "entry_points.txt").decode()
    assert re.search(r"^moe-ep-bench = moe_ep\.bench\.cli:main$", scripts, re.M), scripts
    meta = wheel.read(dist_info + "METADATA").decode()
    for extra, dep in (("bench", "matplotlib"), ("hf", "transformers"), ("hf", "accelerate"), ("test", "pytest")):
        assert f"Provides-Extra: {extra}" in meta and re.search(rf'^Requires-Dist: {dep}\b.*extra == "{extra}"', meta, re.M)
    assert not re.search(r"^Requires-Dist: torch\b", meta, re.M)  # torch is the user's choice (README)


_PROBE = r"""
import importlib.metadata as md, json, os, subprocess, sys, sysconfig
import moe_ep
site = sysconfig.get_paths()["purelib"]
files = [str(f) for f in md.distribution("moe_ep").files]
doctor = subprocess.run([sys.executable, "-m", "moe_ep.tools.doctor", "--json", "--no-torch", "--no-pyverbs"],
                        capture_output=True, text=True, check=True)
print(json.dumps({"file": moe_ep.__file__, "version": moe_ep.__version__, "site": site, "files": files,
                  "host": json.loads(doctor.stdout)["host"]}))
"""


@pytest.mark.skipif(not INSTALLED_PYTHON, reason="no installed venv: MOE_EP_INSTALLED_PYTHON is unset "
                                                 "(.ci/run's package step installs the wheel into one)")
def test_installed_wheel(tmp_path):
    """From outside the checkout: moe_ep comes from the venv, its files are moe_ep/, its dist-info
    and the console script, and the doctor names the version and the setup.py build's flags."""
    env = {k: v for k, v in os.environ.items() if k != "MOE_EP_NATIVE_LIB"}  # the venv's own, not the tests' build
    r = subprocess.run([INSTALLED_PYTHON, "-c", _PROBE], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                       env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["version"] == VERSION and got["host"]["moe_ep"] == VERSION
    assert os.path.realpath(got["file"]).startswith(os.path.realpath(got["site"]) + os.sep), got["file"]
    tops = {f.replace("\\", "/").split("/")[0] for f in got["files"]}
    assert tops == {"moe_ep", f"{BASE}.dist-info", ".."}, tops   # ".." : bin/moe-ep-bench
    assert [f for f in got["files"] if f.startswith("..")] == [os.path.join("..", "..", "..", "bin", "moe-ep-bench")]
    native = got["host"]["native"]
    assert os.path.realpath(native["library"]).startswith(os.path.realpath(got["site"]) + os.sep), native
    assert "(setup.py build_ext)" in native["build"] and "-std=c++17" in native["build"], native
