"""Stored responses of ``/v1/responses`` (``store: true``), for ``previous_response_id``, ``GET``
and ``DELETE``: in Redis when the gateway has one (every gateway behind the front door sees the
same responses), else in a SQLite file under ``--responses-store-dir`` (it outlives a restart).

Either store is bounded: a record expires ``ttl_s`` after it was written, and beyond
``max_entries`` the oldest go first. A record is one JSON object: the response and the input
items it was generated from (those of its ``previous_response_id`` chain included).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Protocol

import orjson

log = logging.getLogger("openai_gateway")

SQLITE_FILE = "responses.sqlite3"


def dumps(value: Any) -> bytes:
    """JSON of a response or record: orjson, or json for what orjson refuses (an integer over 64
    bits in a client's schema or metadata)."""
    try:
        return orjson.dumps(value)
    except TypeError:
        return json.dumps(value, ensure_ascii=False).encode("utf-8")


class StoreUnavailable(RuntimeError):
    """The store cannot be reached (Redis down): the caller answers 503."""


class ResponseStore(Protocol):
    async def put(self, response_id: str, record: dict[str, Any]) -> None: ...

    async def get(self, response_id: str) -> dict[str, Any] | None: ...

    async def delete(self, response_id: str) -> bool: ...

    async def close(self) -> None: ...


class SQLiteStore:
    """Records in one SQLite table (WAL: gateways sharing the file read while one writes). Calls
    run in a worker thread, one at a time, so the event loop never waits on the disk. The lock is
    taken in that thread: a caller cancelled while its call runs leaves the call running, and the
    next one still waits for it."""

    def __init__(self, directory: Path, ttl_s: float, max_entries: int):
        self.path = directory / SQLITE_FILE
        self.ttl_s, self.max_entries = ttl_s, max_entries
        self._conn: sqlite3.Connection | None = None  # opened at first use: a gateway that stores nothing writes no file
        self._lock = threading.Lock()

    @property
    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, check_same_thread=False, timeout=5)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, created REAL NOT NULL, body BLOB NOT NULL)")
            db.execute("CREATE INDEX IF NOT EXISTS responses_created ON responses (created)")
            self._conn = db
        return self._conn

    def _locked(self, fn, *args):
        with self._lock:
            return fn(*args)

    async def _run(self, fn, *args):
        try:
            return await asyncio.to_thread(self._locked, fn, *args)
        except (sqlite3.Error, OSError) as exc:
            raise StoreUnavailable(f"the response store ({self.path.name}) failed: {exc}") from exc

    def _put(self, response_id: str, body: bytes) -> None:
        now = time.time()
        with self._db:  # one transaction: the write and the trim
            self._db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?)", (response_id, now, body))
            self._db.execute("DELETE FROM responses WHERE created < ?", (now - self.ttl_s,))
            self._db.execute(
                "DELETE FROM responses WHERE id IN (SELECT id FROM responses ORDER BY created DESC LIMIT -1 OFFSET ?)",
                (self.max_entries,),
            )

    def _get(self, response_id: str) -> bytes | None:
        row = self._db.execute(
            "SELECT body FROM responses WHERE id = ? AND created >= ?", (response_id, time.time() - self.ttl_s)
        ).fetchone()
        return None if row is None else row[0]

    def _delete(self, response_id: str) -> bool:
        with self._db:
            return self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0

    async def put(self, response_id: str, record: dict[str, Any]) -> None:
        await self._run(self._put, response_id, dumps(record))

    async def get(self, response_id: str) -> dict[str, Any] | None:
        body = await self._run(self._get, response_id)
        return None if body is None else orjson.loads(body)

    async def delete(self, response_id: str) -> bool:
        return await self._run(self._delete, response_id)

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    async def close(self) -> None:
        await asyncio.to_thread(self._locked, self._close)


class RedisStore:
    """Records as Redis strings with an expiry (``<prefix>r:<id>``), and a sorted set of their ids
    by time (``<prefix>index``, which no id reaches) that keeps the count at ``max_entries``."""

    def __init__(self, url: str, ttl_s: float, max_entries: int, prefix: str = "gateway:responses:", timeout_s: float = 2.0):
        import redis.asyncio as aioredis

        self.ttl_s, self.max_entries, self.prefix = ttl_s, max_entries, prefix
        self._client = aioredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._index = prefix + "index"

    def _key(self, response_id: str) -> str:
        return self.prefix + "r:" + response_id

    async def _call(self, coro):
        try:
            return await coro
        except Exception as exc:  # noqa: BLE001 - any Redis failure is the store being unavailable
            raise StoreUnavailable(f"the response store (Redis) is unavailable: {exc}") from exc

    async def _put(self, response_id: str, body: bytes) -> None:
        now = time.time()
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.set(self._key(response_id), body, px=int(self.ttl_s * 1000))
            pipe.zadd(self._index, {response_id: now})
            pipe.zremrangebyscore(self._index, "-inf", now - self.ttl_s)
            pipe.zrange(self._index, 0, -self.max_entries - 1)
            pipe.zremrangebyrank(self._index, 0, -self.max_entries - 1)
            *_, evicted, _removed = await pipe.execute()
        if evicted:
            await self._client.delete(*(self._key(i.decode("utf-8")) for i in evicted))

    async def _delete(self, response_id: str) -> bool:
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.delete(self._key(response_id))
            pipe.zrem(self._index, response_id)
            deleted, _ = await pipe.execute()
        return bool(deleted)

    async def put(self, response_id: str, record: dict[str, Any]) -> None:
        await self._call(self._put(response_id, dumps(record)))

    async def get(self, response_id: str) -> dict[str, Any] | None:
        body = await self._call(self._client.get(self._key(response_id)))
        return None if body is None else orjson.loads(body)

    async def delete(self, response_id: str) -> bool:
        return await self._call(self._delete(response_id))

    async def close(self) -> None:
        await self._client.aclose()


def open_store(redis_url: str, directory: Path, ttl_s: float, max_entries: int) -> ResponseStore:
    """Redis at ``redis_url`` when one is given, else the SQLite file in ``directory``."""
    if redis_url:
        return RedisStore(redis_url, ttl_s, max_entries)
    return SQLiteStore(directory, ttl_s, max_entries)
