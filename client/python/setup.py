"""Build steps pyproject.toml cannot declare: the version, read from the
top-level CMakeLists.txt (`project(mlaverify VERSION ...)`, the version the
server reports), and the gRPC stubs, generated from
proto/mlaverify/v1/verify.proto into the built package (never into the
source tree, never committed).

The stubs come from `protoc` and `grpc_python_plugin` on PATH (Debian's
protobuf-compiler and protobuf-compiler-grpc, which the C++ build uses too,
so both builds make the same files), or else from the `grpc_tools` module.
"""

import os
import re
import shutil
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
# client/python lives two levels under the repository root.
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
PROTO_DIR = os.path.join(ROOT, "proto")
PROTO = os.path.join(PROTO_DIR, "mlaverify", "v1", "verify.proto")
CMAKE_LISTS = os.path.join(ROOT, "CMakeLists.txt")


def project_version() -> str:
    try:
        text = open(CMAKE_LISTS).read()
    except OSError as e:
        sys.exit(f"mlaverify: {CMAKE_LISTS} is needed for the version ({e}); build from a "
                 "checkout of the repository")
    match = re.search(r"project\(\s*mlaverify\s+VERSION\s+([0-9][0-9.]*)", text)
    if not match:
        sys.exit(f"mlaverify: no `project(mlaverify VERSION ...)` in {CMAKE_LISTS}")
    return match.group(1)


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
    """build_py, then the stubs and _version.py written into the build tree."""

    def run(self):
        # pip builds in the source tree: a module removed since the last
        # build must not linger in build/lib and be installed again.
        shutil.rmtree(os.path.join(self.build_lib, "mlaverify"), ignore_errors=True)
        super().run()
        if not os.path.exists(PROTO):
            sys.exit(f"mlaverify: {PROTO} not found; build from a checkout of the repository")
        out = os.path.abspath(self.build_lib)
        os.makedirs(os.path.join(out, "mlaverify", "v1"), exist_ok=True)
        subprocess.run(protoc_command(out), check=True)
        open(os.path.join(out, "mlaverify", "v1", "__init__.py"), "w").close()
        with open(os.path.join(out, "mlaverify", "_version.py"), "w") as f:
            f.write(f'"""Generated at build time from CMakeLists.txt."""\n\n'
                    f'__version__ = "{project_version()}"\n')


setup(version=project_version(), cmdclass={"build_py": BuildWithStubs})
