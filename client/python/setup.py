"""Build steps pyproject.toml cannot declare: the version, read from the
top-level CMakeLists.txt (`project(mlaverify VERSION ...)`, the version the
server reports), the gRPC stubs, generated from
proto/mlaverify/v1/verify.proto into the built package (never into the
source tree, never committed), and, when asked, the native library.

The stubs come from `protoc` and `grpc_python_plugin` on PATH (Debian's
protobuf-compiler and protobuf-compiler-grpc, which the C++ build uses too,
so both builds make the same files), or else from the `grpc_tools` module.

An sdist (`python3 setup.py sdist`) carries its own copy of the .proto
(proto/ beside this file) and the version (VERSION), so that it builds away
from a checkout; built from a checkout, the package reads the repository's
files two folders up.

MLAVERIFY_NATIVE_LIB_PATH=/path/to/libmlaverify_native.so (the CMake build
writes it into build/client/python/mlaverify/lib/): the library goes into
the package as mlaverify/lib/libmlaverify_native.so, where mlaverify.native
looks for it, and the wheel is tagged for this platform (py3-none-<platform>:
the library is loaded with ctypes, so no Python ABI is tied to it). Without
the variable the wheel is pure Python (py3-none-any).
"""

import os
import re
import shutil
import subprocess
import sys

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

try:  # setuptools >= 70.1 has its own; before that, the wheel package's
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:
    try:
        from wheel.bdist_wheel import bdist_wheel
    except ImportError:  # no wheel support at all: only sdist and install work
        bdist_wheel = None

HERE = os.path.dirname(os.path.abspath(__file__))
# An unpacked sdist has PKG-INFO at its top (a checkout never does): it
# builds from the copies it carries, even when unpacked inside some other
# checkout whose files two folders up are not the ones it was made from.
IN_SDIST = os.path.exists(os.path.join(HERE, "PKG-INFO"))
# In a checkout, client/python lives two levels under the repository root.
ROOT = HERE if IN_SDIST else os.path.normpath(os.path.join(HERE, "..", ".."))
PROTO_DIR = os.path.join(ROOT, "proto")
PROTO_NAME = os.path.join("mlaverify", "v1", "verify.proto")
PROTO = os.path.join(PROTO_DIR, PROTO_NAME)
CMAKE_LISTS = os.path.join(ROOT, "CMakeLists.txt")
VERSION_FILE = os.path.join(HERE, "VERSION")  # the sdist's copy of the version

NATIVE_ENV = "MLAVERIFY_NATIVE_LIB_PATH"
NATIVE_LIBRARY = "libmlaverify_native.so"  # the name mlaverify/native.py loads


def project_version() -> str:
    if IN_SDIST:
        try:
            return open(VERSION_FILE).read().strip()
        except OSError as e:
            sys.exit(f"mlaverify: this sdist has no VERSION file ({e}); make the sdist with "
                     "`python3 setup.py sdist` from a checkout")
    try:
        text = open(CMAKE_LISTS).read()
    except OSError as e:
        sys.exit(f"mlaverify: {CMAKE_LISTS} is needed for the version ({e}); build from a "
                 "checkout of the repository or from an sdist")
    match = re.search(r"project\(\s*mlaverify\s+VERSION\s+([0-9][0-9.]*)", text)
    if not match:
        sys.exit(f"mlaverify: no `project(mlaverify VERSION ...)` in {CMAKE_LISTS}")
    return match.group(1)


def native_library():
    """The library named by MLAVERIFY_NATIVE_LIB_PATH, None when unset."""
    path = os.environ.get(NATIVE_ENV)
    if not path:
        return None
    if not os.path.isfile(path):
        sys.exit(f"mlaverify: {NATIVE_ENV}={path}: no such file (the CMake build writes "
                 f"build/client/python/mlaverify/lib/{NATIVE_LIBRARY})")
    return os.path.abspath(path)


def protoc_command(out: str):
    """The command that writes verify_pb2.py and verify_pb2_grpc.py under `out`."""
    protoc, plugin = shutil.which("protoc"), shutil.which("grpc_python_plugin")
    if protoc and plugin:
        return [protoc, f"--plugin=protoc-gen-grpc_python={plugin}", f"--proto_path={PROTO_DIR}",
                f"--python_out={out}", f"--grpc_python_out={out}", PROTO]
    try:
        import grpc_tools  # noqa: F401
    except ImportError:
        sys.exit("mlaverify: generating the gRPC stubs needs protoc and grpc_python_plugin on "
                 "PATH (Debian: apt-get install protobuf-compiler protobuf-compiler-grpc) or "
                 "the grpc_tools module")
    return [sys.executable, "-m", "grpc_tools.protoc", f"--proto_path={PROTO_DIR}",
            f"--python_out={out}", f"--grpc_python_out={out}", PROTO]


class BuildWithStubs(build_py):
    """build_py, then the stubs, _version.py and (when asked) the native
    library written into the build tree."""

    def run(self):
        # pip builds in the source tree: a module removed since the last
        # build (or a native library a previous build put in) must not
        # linger in build/lib and be installed again.
        shutil.rmtree(os.path.join(self.build_lib, "mlaverify"), ignore_errors=True)
        super().run()
        if not os.path.exists(PROTO):
            sys.exit(f"mlaverify: {PROTO} not found; build from a checkout of the repository "
                     "or from an sdist")
        out = os.path.abspath(self.build_lib)
        os.makedirs(os.path.join(out, "mlaverify", "v1"), exist_ok=True)
        subprocess.run(protoc_command(out), check=True)
        open(os.path.join(out, "mlaverify", "v1", "__init__.py"), "w").close()
        with open(os.path.join(out, "mlaverify", "_version.py"), "w") as f:
            f.write(f'"""Generated at build time from CMakeLists.txt."""\n\n'
                    f'__version__ = "{project_version()}"\n')
        library = native_library()
        if library:
            lib_dir = os.path.join(out, "mlaverify", "lib")
            os.makedirs(lib_dir, exist_ok=True)
            # Under the name native.py loads, whatever the build called it.
            shutil.copyfile(library, os.path.join(lib_dir, NATIVE_LIBRARY))
            os.chmod(os.path.join(lib_dir, NATIVE_LIBRARY), 0o755)


class SdistWithSources(sdist):
    """sdist, with the .proto and the version the build reads from the
    checkout copied in (written into the release tree only, so the source
    folder stays as committed)."""

    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        proto = os.path.join(base_dir, "proto", PROTO_NAME)
        version = os.path.join(base_dir, "VERSION")
        for path in (proto, version):
            # The release tree may hard-link the sources (an sdist made from
            # an sdist lists these): writing through the link would write
            # into the source folder.
            if os.path.lexists(path):
                os.remove(path)
        os.makedirs(os.path.dirname(proto), exist_ok=True)
        shutil.copyfile(PROTO, proto)
        with open(version, "w") as f:
            f.write(project_version() + "\n")


cmdclass = {"build_py": BuildWithStubs, "sdist": SdistWithSources}


class MaybeBinaryDistribution(Distribution):
    """A distribution that counts as binary while it carries the native
    library: the wheel is then not pure (its files go to platlib, its tag
    names the platform) though there is no extension module to build."""

    def has_ext_modules(self):
        return native_library() is not None


if bdist_wheel is not None:
    class PlatformWheel(bdist_wheel):
        """bdist_wheel, tagged py3-none-<platform> when the native library is
        in the package (it only runs where it was built for), py3-none-any
        otherwise."""

        def get_tag(self):
            python, abi, platform = super().get_tag()
            if native_library():
                # ctypes loads the library: any Python 3 and ABI will do.
                return "py3", "none", platform
            return python, abi, platform

    cmdclass["bdist_wheel"] = PlatformWheel

setup(version=project_version(), cmdclass=cmdclass, distclass=MaybeBinaryDistribution)
