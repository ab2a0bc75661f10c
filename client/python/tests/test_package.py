"""The package as users get it: its version is the server's, it is typed
(py.typed), every public function and class is documented, the asyncio
classes have the synchronous ones' methods, and the typed results cover
every field of their messages."""

import dataclasses
import importlib
import importlib.metadata
import inspect
import os
import pkgutil
import sys

import pytest

import mlaverify
from mlaverify import types
from mlaverify.v1 import verify_pb2


def test_version_is_the_servers(client):
    assert mlaverify.__version__ == client.server_info().version


def test_installed_where_expected():
    """Under tests/python_package_test.sh the package is the one pip put in
    the fresh venv (not a source folder), with its metadata."""
    if not os.environ.get("MLAVERIFY_EXPECT_INSTALLED"):
        pytest.skip("the package is not pip-installed here (tests/python_package_test.sh does)")
    assert mlaverify.__file__.startswith(sys.prefix), (mlaverify.__file__, sys.prefix)
    assert importlib.metadata.version("mlaverify") == mlaverify.__version__


def test_py_typed_is_shipped():
    assert os.path.exists(os.path.join(os.path.dirname(mlaverify.__file__), "py.typed"))


def public_modules():
    # The private modules too: their public names (VerifyItem, Geometry...)
    # are part of the API.
    for info in pkgutil.iter_modules(mlaverify.__path__):
        if info.name not in ("v1", "_version"):
            yield importlib.import_module(f"mlaverify.{info.name}")
    yield mlaverify


def own(obj, module):
    return getattr(obj, "__module__", None) == module.__name__


def test_every_public_function_and_class_is_documented():
    missing, checked = [], 0
    for module in public_modules():
        if not (module.__doc__ or "").strip():
            missing.append(module.__name__)
        for name, obj in vars(module).items():
            if name.startswith("_") or not own(obj, module):
                continue
            if inspect.isfunction(obj) or inspect.isclass(obj):
                checked += 1
                if not (obj.__doc__ or "").strip():
                    missing.append(f"{module.__name__}.{name}")
            if inspect.isclass(obj):
                for member, value in vars(obj).items():
                    if member.startswith("_"):
                        continue
                    fn = value.fget if isinstance(value, property) else value
                    if isinstance(fn, (staticmethod, classmethod)):
                        fn = fn.__func__
                    if inspect.isfunction(fn):
                        checked += 1
                        if not (fn.__doc__ or "").strip():
                            missing.append(f"{module.__name__}.{name}.{member}")
    assert checked > 100, checked  # the walk found the package's functions
    assert missing == [], f"undocumented: {missing}"


def public_methods(cls):
    return {n for n, _ in inspect.getmembers(cls) if not n.startswith("_")}


def test_asyncio_classes_have_the_same_methods():
    from mlaverify.aio import AsyncVerifyClient, AsyncVerifyStream
    from mlaverify.client import VerifyClient, VerifyStream
    from mlaverify.replicas import AsyncReplicaSet, ReplicaSet
    for sync, aio in ((VerifyClient, AsyncVerifyClient), (VerifyStream, AsyncVerifyStream),
                      (ReplicaSet, AsyncReplicaSet)):
        # The native path (mlaverify.native) blocks in C++ for its calls: the
        # synchronous client's only.
        native = {"native_verify", "native_bind", "native_stream"} if sync is VerifyClient \
            else set()
        assert public_methods(sync) - native == public_methods(aio), (sync.__name__, aio.__name__)
        assert len(public_methods(sync)) >= 4
    # The same parameters, in the same order, for every method and the constructor.
    for name in public_methods(AsyncVerifyClient) | {"__init__"}:
        s, a = getattr(VerifyClient, name), getattr(AsyncVerifyClient, name)
        if isinstance(s, property) or isinstance(a, property):
            continue
        assert list(inspect.signature(s).parameters) == list(inspect.signature(a).parameters), name


def test_typed_results_cover_every_field():
    for cls, message in ((types.ServerInfo, verify_pb2.ServerInfo),
                         (types.DeviceInfo, verify_pb2.DeviceInfo),
                         (types.PoolInfo, verify_pb2.PoolInfo),
                         (types.SystemSharedMemoryStatus, verify_pb2.SystemSharedMemoryRegion),
                         (types.CudaSharedMemoryStatus, verify_pb2.CudaSharedMemoryRegion)):
        assert [f.name for f in dataclasses.fields(cls)] == \
            [f.name for f in message.DESCRIPTOR.fields], cls.__name__


def test_server_info_is_typed(client):
    info = client.server_info()
    assert isinstance(info, types.ServerInfo)
    assert isinstance(info.pools[0], types.PoolInfo) and info.pools[0].total_pages > 0
    assert info.draft_buckets == [1, 2, 4, 8] and info.batch_buckets == [1, 2, 4]
    assert info.free_pages == sum(p.free_pages for p in info.pools)
