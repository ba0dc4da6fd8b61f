"""An error answer of the fake KFP API server: the status a real server gives, with a ``google.rpc.Status``-like JSON
body ``{"error", "code", "message", "details"}`` (server.py writes it)."""

from __future__ import annotations

# google.rpc.Code for each HTTP status the fake answers with (grpc-gateway's mapping, inverted).
GRPC_CODES = {400: 3, 401: 16, 403: 7, 404: 5, 405: 12, 409: 6, 411: 3, 429: 8, 500: 13, 501: 12, 503: 14, 504: 4}


class KfpError(Exception):
    """An error answer: HTTP status and message; ``violation`` puts it in :attr:`FakeKfp.errors` too."""

    def __init__(self, status: int, message: str, *, violation: bool | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.violation = status == 400 if violation is None else violation
