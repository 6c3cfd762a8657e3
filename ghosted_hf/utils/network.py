"""Waits that end: huggingface_hub's client waits for ever on an endpoint that accepts a connection and never
answers, `datasets` retries every file of a dataset for minutes, and every timeout a user gives must be one."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import huggingface_hub

from ..errors import GhostedError

HUB_TIMEOUT_S = 60.0  # how long one request to the Hub may go unanswered


@contextlib.contextmanager
def bounded_network(timeout: float) -> Iterator[None]:
    """Within the context, huggingface_hub gives up on a connection silent for `timeout` seconds (not for ever)."""
    def factory():
        client = huggingface_hub.utils._http.default_client_factory()
        client.timeout = timeout
        return client

    huggingface_hub.set_client_factory(factory)
    try:
        yield
    finally:
        huggingface_hub.set_client_factory(huggingface_hub.utils._http.default_client_factory)


def check_timeout(seconds: float, what: str = "timeout") -> float:
    """A timeout that is a wait: positive and finite (0, a negative number, NaN or infinity is refused)."""
    if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0):
        raise GhostedError(f"{what} must be a positive, finite number of seconds, got {seconds}.")
    return float(seconds)
