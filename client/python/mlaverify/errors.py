"""The one exception type of the client: a failed call with its gRPC code."""

from __future__ import annotations

import grpc


class VerifyError(Exception):
    """A call the server (or gRPC) failed, or a stream request answered with
    an in-band error. ``code`` is a ``grpc.StatusCode``; ``details`` is the
    server's message (it names sizes, limits and sequence ids)."""

    def __init__(self, code: grpc.StatusCode, details: str, rpc: str = ""):
        self.code = code
        self.details = details
        self.rpc = rpc
        where = f"{rpc}: " if rpc else ""
        super().__init__(f"{where}{code.name}: {details}")


_CODE_BY_NUMBER = {c.value[0]: c for c in grpc.StatusCode}


def code_from_number(number: int) -> grpc.StatusCode:
    """google.rpc.Code numbering (VerifyResponse.error_code) -> StatusCode."""
    return _CODE_BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)


def from_rpc_error(error: grpc.RpcError, rpc: str) -> VerifyError:
    """The VerifyError of a failed call of `rpc`."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    return VerifyError(code, details or "", rpc)
