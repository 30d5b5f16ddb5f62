"""Domain errors of the decode engine: the project's own (one Overloaded everywhere),
mapped to RPC status codes in one place, `easerve.rpc.errors`."""
from __future__ import annotations

from easerve.errors import InvalidRequest, Overloaded, RequestTooLarge

__all__ = ["InvalidRequest", "Overloaded", "RequestTooLarge"]
