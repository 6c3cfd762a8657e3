"""Waits on the Hub that end: huggingface_hub's client waits for ever on an endpoint that accepts a connection
and never answers, and `datasets` retries every file of a dataset for minutes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import huggingface_hub

HUB_TIMEOUT_S = 60.0  # how long one request to the Hub may go unanswered


@contextlib.contextmanager
def bounded_network(timeout: float) -> Iterator[None]:
    """huggingface_hub's HTTP client, within the context, gives up on a connection that does not answer for
    `timeout` seconds (its default waits for ever)."""
    def factory():
        client = huggingface_hub.utils._http.default_client_factory()
        client.timeout = timeout
        return client

    huggingface_hub.set_client_factory(factory)
    try:
        yield
    finally:
        huggingface_hub.set_client_factory(huggingface_hub.utils._http.default_client_factory)
