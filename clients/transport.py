"""What the embedding and generation clients share on the wire: protocols and their default
URLs, the endpoint list, tritonclient's modules and connections, the exceptions that mean "this
request failed", and the skeleton of a client (options, retrier, connections, close).

Retries, breakers and failover are clients/resilience.py; turning a failure into the clients'
errors is clients/errors.py.
"""

from __future__ import annotations

import asyncio
import functools
import http.client
from collections.abc import Sequence
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any, Literal, TypeVar

from tritonclient.utils import InferenceServerException

from clients.errors import ClientError, raise_body_data
from clients.resilience import EndpointPool, RetryPolicy, make_retrier, split_urls

Protocol = Literal["http", "grpc"]

DEFAULT_URLS: dict[str, str] = {"http": "127.0.0.1:8000", "grpc": "127.0.0.1:8001"}
PROTOCOLS: tuple[Protocol, ...] = ("http", "grpc")
C = TypeVar("C", bound="ClientBase")
Opts = TypeVar("Opts", bound="ConnectionOptions")


def parse_urls(url: str | Sequence[str] | None, protocol: str) -> tuple[str, ...]:
    """One URL, a comma-separated list or a list of them, as tritonclient's ``host:port``
    (a pasted ``http://host:port/`` is accepted); the protocol's default when none."""
    urls = split_urls(url) or [DEFAULT_URLS[protocol]]
    out = []
    for u in urls:
        if "://" in u:
            # tritonclient wants host:port; accept a pasted http://host:port anyway.
            scheme, _, rest = u.partition("://")
            if scheme not in ("http", "grpc"):
                raise ValueError(f"url {u!r}: only plain http/grpc (no TLS) is supported")
            u = rest
        u = u.rstrip("/")
        if not u:
            raise ValueError("url is empty")
        out.append(u)
    return tuple(dict.fromkeys(out))


@dataclass(frozen=True)
class ConnectionOptions:
    """The options every client takes, checked by ``create``. ``url`` is the first of ``urls``,
    the endpoints the client fails over across; ``retries`` (None: the default policy's) and
    ``deadline_s`` (None: ``timeout_s``) shape the retry policy (clients/resilience.py). Each role
    adds its own fields, defaults and checks (``check``)."""

    url: str
    protocol: Protocol = "http"
    model: str = ""
    model_version: str = ""
    timeout_s: float | None = None
    urls: tuple[str, ...] = ()
    retries: int | None = None
    deadline_s: float | None = None

    @classmethod
    def create(cls: type[Opts], url: str | Sequence[str] | None = None, protocol: str | None = None, **fields: Any) -> Opts:
        """The options, the others than ``url`` and ``protocol`` by name (left out: the defaults),
        checked (ValueError naming the bad one); the URLs default to the protocol's local port."""
        if protocol is not None:
            fields["protocol"] = protocol
        options = cls(url="", **fields)
        options.check()
        if options.protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}, not {options.protocol!r}")
        urls = parse_urls(url, options.protocol)
        if not options.model:
            raise ValueError("model name is empty")
        if options.timeout_s is not None and not options.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, not {options.timeout_s}")
        RetryPolicy.create(options.retries, options.deadline_s)  # the same checks the client's policy makes
        return replace(options, url=urls[0], urls=urls, model_version=str(options.model_version))

    def check(self) -> None:
        """The checks of a role's own fields (ValueError naming the bad one)."""


def tritonclient_module(protocol: str, aio: bool = False) -> ModuleType:
    """The tritonclient module for a protocol, imported on first use (each pulls in gevent,
    grpc or aiohttp, which a caller of the other protocol need not pay for)."""
    if protocol == "http":
        if aio:
            import tritonclient.http.aio as module
        else:
            import tritonclient.http as module
    elif protocol == "grpc":
        if aio:
            import tritonclient.grpc.aio as module
        else:
            import tritonclient.grpc as module
    else:
        raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}, not {protocol!r}")
    return module


def triton_client(protocol: str, url: str, timeout_s: float | None = None, aio: bool = False) -> Any:
    """tritonclient's InferenceServerClient for ``url``. Over HTTP ``timeout_s`` bounds the
    connection (the blocking client's socket timeouts, aiohttp's connect timeout; tritonclient's
    default is 60 s); over gRPC each call carries its own deadline instead."""
    module = tritonclient_module(protocol, aio)
    kwargs: dict[str, Any] = {}
    if protocol == "http" and timeout_s is not None:
        kwargs = {"conn_timeout": timeout_s} if aio else {"connection_timeout": timeout_s, "network_timeout": timeout_s}
    if protocol == "http":
        return _http_client_keeping_data(aio)(url, **kwargs)
    return module.InferenceServerClient(url, **kwargs)


@functools.cache
def _http_client_keeping_data(aio: bool) -> type:
    """tritonclient.http's client (blocking or asyncio) that keeps an error body's data: tritonclient
    makes its exception of the body's ``error`` alone, so an error answer's body is read here first
    (every POST goes through ``_post``) and one with the data as its keys (contract/errors.py) is
    raised as clients.errors.ServerError; any other goes on to tritonclient as it came."""
    base = tritonclient_module("http", aio).InferenceServerClient
    if aio:

        class AsyncDataClient(base):  # type: ignore[misc, valid-type]
            async def _post(self, request_uri, request_body, headers, query_params):
                response = await super()._post(request_uri, request_body, headers, query_params)
                if response.status != 200:
                    raise_body_data(await response.read(), response.status)  # aiohttp keeps the body for tritonclient
                return response

        return AsyncDataClient

    class DataClient(base):  # type: ignore[misc, valid-type]
        def _post(self, request_uri, request_body, headers, query_params):
            response = super()._post(request_uri, request_body, headers, query_params)
            if response.status_code == 200:
                return response
            body = response.read()
            raise_body_data(body, response.status_code)
            return _ReadBody(response, body)

    return DataClient


class _ReadBody:
    """A geventhttpclient response whose body was read: tritonclient reads it again."""

    def __init__(self, response: Any, body: bytes):
        self._response, self._body = response, body

    def read(self, *args: Any) -> bytes:
        return self._body

    def __getattr__(self, name: str) -> Any:
        return getattr(self._response, name)


def request_failures(protocol: str, aio: bool = False) -> tuple[type[BaseException], ...]:
    """The exceptions that mean "this request failed" rather than a bug in the caller: tritonclient's,
    socket errors and timeouts, a response cut short, the clients' own errors; the clients map them
    to their errors, which clients.resilience then retries or not."""
    failures: tuple[type[BaseException], ...] = (
        InferenceServerException,
        ClientError,
        OSError,
        asyncio.TimeoutError,
        http.client.HTTPException,
    )
    if aio and protocol == "http":
        # A refused or dropped connection surfaces as aiohttp's own errors; aiohttp comes
        # with tritonclient's HTTP extra, so it is imported only for that protocol.
        import aiohttp

        failures += (aiohttp.ClientError,)
    return failures


class ClientBase:
    """What every client holds: its checked ``options``, the ``retrier`` over its endpoints,
    and one connection per endpoint, opened on first use by ``_open`` (the asyncio ones inside
    the running loop)."""

    aio = False  # an asyncio client

    def __init__(self, options: ConnectionOptions, policy: RetryPolicy | None = None, pool: EndpointPool | None = None):
        self.options = options
        o = options
        self.retrier = make_retrier(o.urls, o.timeout_s, o.retries, o.deadline_s, policy, pool)
        self._clients: dict[str, Any] = {}
        self._closed = False

    def _open(self, url: str) -> Any:
        raise NotImplementedError

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed")

    def _connection(self, url: str | None = None) -> Any:
        """The connection to ``url`` (default: the first endpoint), opened on first use."""
        self._check_open()
        url = url or self.options.url
        client = self._clients.get(url)
        if client is None:
            client = self._clients[url] = self._open(url)
        return client

    def _take_connections(self) -> list[Any]:
        """Mark the client closed and hand over its connections, to be closed by the caller."""
        self._closed = True
        clients, self._clients = self._clients, {}
        return list(clients.values())

    def _describe(self) -> str:
        o = self.options
        return f"{o.protocol}://{','.join(o.urls)}, model={o.model!r}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._describe()})"


class SyncClient(ClientBase):
    """A blocking client: ``close()`` or a ``with`` block."""

    def close(self) -> None:
        """Close the connections; the client cannot be used afterwards."""
        for client in self._take_connections():
            client.close()

    def __enter__(self: C) -> C:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(ClientBase):
    """An asyncio client: ``await close()`` or an ``async with`` block."""

    aio = True

    async def close(self) -> None:
        """Close the connections; the client cannot be used afterwards."""
        for client in self._take_connections():
            await client.close()

    async def __aenter__(self: C) -> C:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
