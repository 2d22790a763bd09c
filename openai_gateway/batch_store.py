"""The Batch API's durable store: files, batches, and each line's result, in one SQLite file
(``store.sqlite3``) beside the file bodies (``files/<id>.jsonl``) under ``--batch-dir``.

SQLite in WAL mode with ``synchronous=FULL``: a committed result survives a SIGKILL of the
gateway (and a power cut). Every gateway of a host that points at the same folder shares the
jobs; a batch is run by the one gateway holding its lease (``lease_owner``/``lease_until``),
which renews it while it runs and which another takes over once it expires.

Methods are blocking (milliseconds); async code calls them through ``asyncio.to_thread``.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, purpose TEXT NOT NULL, filename TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, created_at INTEGER NOT NULL, status TEXT NOT NULL, body TEXT NOT NULL,
    total INTEGER NOT NULL, key_id TEXT NOT NULL,
    lease_owner TEXT, lease_until REAL NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS results (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, ok INTEGER NOT NULL, record BLOB NOT NULL,
    PRIMARY KEY (batch_id, line)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS attempts (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, n INTEGER NOT NULL,
    PRIMARY KEY (batch_id, line)) WITHOUT ROWID;
"""

# A batch some gateway still has work on; the others are final.
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
# The fields of OpenAI's batch object in its order; a stored object holds only those set (not null).
FIELDS = (
    "id",
    "object",
    "endpoint",
    "errors",
    "input_file_id",
    "completion_window",
    "status",
    "output_file_id",
    "error_file_id",
    "created_at",
    "in_progress_at",
    "expires_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
    "request_counts",
    "metadata",
)


class BatchStore:
    """Files and batches of the Batch API in ``folder`` (created when missing)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.files_dir = folder / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(folder / "store.sqlite3", timeout=30, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        with self._lock:
            self._db.executescript(SCHEMA)

    def close(self) -> None:
        """Close the database."""
        with self._lock:
            self._db.close()

    def _one(self, sql: str, args: tuple = ()) -> Any:
        with self._lock:
            return self._db.execute(sql, args).fetchone()

    def _all(self, sql: str, args: tuple = ()) -> list:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def _write(self, sql: str, args: tuple = ()) -> int:
        with self._lock:
            return self._db.execute(sql, args).rowcount

    # -- files

    def file_path(self, file_id: str) -> Path:
        """Where the body of ``file_id`` lies."""
        return self.files_dir / f"{file_id}.jsonl"

    def add_file(self, file_id: str, purpose: str, filename: str, size: int, created_at: int) -> dict:
        """Record a file whose body is already at ``file_path(file_id)`` (replacing one of that id)."""
        self._write("INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?)", (file_id, purpose, filename, size, created_at))
        return file_object((file_id, purpose, filename, size, created_at))

    def get_file(self, file_id: str) -> dict | None:
        """OpenAI's file object of ``file_id``; None when there is none."""
        row = self._one("SELECT id, purpose, filename, bytes, created_at FROM files WHERE id = ?", (file_id,))
        return None if row is None else file_object(row)

    def list_files(self, purpose: str | None, after: str | None, limit: int, descending: bool) -> tuple[list[dict], bool]:
        """Files (of ``purpose``) by creation, after the file ``after``; and whether more follow."""
        where, args = ["1"], []
        if purpose:
            where.append("purpose = ?")
            args.append(purpose)
        if after:
            cmp = "<" if descending else ">"
            where.append(f"(created_at, id) {cmp} (SELECT created_at, id FROM files WHERE id = ?)")
            args.append(after)
        order = "DESC" if descending else "ASC"
        rows = self._all(
            f"SELECT id, purpose, filename, bytes, created_at FROM files WHERE {' AND '.join(where)} "
            f"ORDER BY created_at {order}, id {order} LIMIT ?",
            (*args, limit + 1),
        )
        return [file_object(r) for r in rows[:limit]], len(rows) > limit

    def delete_file(self, file_id: str) -> bool | str:
        """Forget ``file_id`` and remove its body: True; False when there was none; the id of an
        unfinished batch that reads it (the file is kept). One transaction with ``add_batch``'s
        check, so a batch never starts on a deleted file."""
        marks = ",".join("?" * len(ACTIVE))
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                user = self._db.execute(
                    f"SELECT id FROM batches WHERE status IN ({marks}) AND json_extract(body, '$.input_file_id') = ? LIMIT 1",
                    (*ACTIVE, file_id),
                ).fetchone()
                deleted = user is None and self._db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount > 0
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        if user is not None:
            return str(user[0])
        if deleted:
            self.file_path(file_id).unlink(missing_ok=True)
        return deleted

    # -- batches

    def add_batch(self, batch: dict, total: int, key_id: str) -> bool:
        """Record a new batch (OpenAI's object, without its request counts) of ``total`` lines;
        False (nothing recorded) when its input file is gone."""
        body = {k: v for k, v in batch.items() if k != "request_counts" and v is not None}
        return (
            self._write(
                "INSERT INTO batches (id, created_at, status, body, total, key_id) "
                "SELECT ?, ?, ?, ?, ?, ? WHERE EXISTS (SELECT 1 FROM files WHERE id = ?)",
                (batch["id"], batch["created_at"], batch["status"], json.dumps(body), total, key_id, batch["input_file_id"]),
            )
            > 0
        )

    def get_batch(self, batch_id: str) -> dict | None:
        """OpenAI's batch object of ``batch_id``, its request counts as committed now; None when there is none."""
        row = self._one("SELECT body, total FROM batches WHERE id = ?", (batch_id,))
        return None if row is None else self._with_counts(batch_id, row[0], row[1])

    def _with_counts(self, batch_id: str, body: str, total: int) -> dict:
        done, failed = self.counts(batch_id)
        stored = json.loads(body)
        stored["request_counts"] = {"total": total, "completed": done, "failed": failed}
        return {k: stored.get(k) for k in FIELDS}

    def list_batches(self, after: str | None, limit: int) -> tuple[list[dict], bool]:
        """Batches, newest first, after the batch ``after``; and whether more follow."""
        where, args = "1", tuple[str, ...]()
        if after:
            where, args = "(created_at, id) < (SELECT created_at, id FROM batches WHERE id = ?)", (after,)
        rows = self._all(
            f"SELECT id, body, total FROM batches WHERE {where} ORDER BY created_at DESC, id DESC LIMIT ?", (*args, limit + 1)
        )
        return [self._with_counts(r[0], r[1], r[2]) for r in rows[:limit]], len(rows) > limit

    def batch_row(self, batch_id: str) -> tuple[str, int, str] | None:
        """(status, total lines, key id) of ``batch_id``."""
        return self._one("SELECT status, total, key_id FROM batches WHERE id = ?", (batch_id,))

    def transition(self, batch_id: str, to: str, from_: tuple[str, ...], fields: dict | None = None) -> bool:
        """Move ``batch_id`` to status ``to`` if it is in one of ``from_``, stamping ``<to>_at``
        and setting ``fields`` in its object; False when it was not in ``from_``."""
        patch = {"status": to, f"{to}_at": int(time.time()), **(fields or {})}
        marks = ",".join("?" * len(from_))
        return (
            self._write(
                f"UPDATE batches SET status = ?, body = json_patch(body, ?) WHERE id = ? AND status IN ({marks})",
                (to, json.dumps(patch), batch_id, *from_),
            )
            > 0
        )

    def finalize(
        self, batch_id: str, owner: str, to: str, from_: tuple[str, ...], outputs: list[tuple[str, str, str, int, Path]]
    ) -> bool:
        """Give ``batch_id`` its final status ``to`` with its output files, if ``owner`` still
        holds its lease and it is in one of ``from_``: each ``(field, file_id, filename, size,
        written)`` is moved from ``written`` (a path of this writer's own) to ``file_path(file_id)``
        and recorded, all in one transaction that holds the store's write lock, so a gateway that
        took the lease over cannot commit at the same time. False (nothing moved) otherwise."""
        now = int(time.time())
        patch: dict[str, Any] = {"status": to, f"{to}_at": now}
        marks = ",".join("?" * len(from_))
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                held = self._db.execute(
                    f"SELECT 1 FROM batches WHERE id = ? AND lease_owner = ? AND status IN ({marks})", (batch_id, owner, *from_)
                ).fetchone()
                if held is None:
                    self._db.execute("ROLLBACK")
                    return False
                for field, file_id, filename, size, written in outputs:
                    os.replace(written, self.file_path(file_id))
                    self._db.execute(
                        "INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?)", (file_id, "batch_output", filename, size, now)
                    )
                    patch[field] = file_id
                self._db.execute(
                    "UPDATE batches SET status = ?, body = json_patch(body, ?) WHERE id = ?", (to, json.dumps(patch), batch_id)
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return True

    def fail(self, batch_id: str, owner: str, error: dict) -> bool:
        """Make ``batch_id`` (unfinished, its lease held by ``owner``) ``failed`` with ``error`` in its ``errors.data``."""
        marks = ",".join("?" * len(ACTIVE))
        patch = {"status": "failed", "failed_at": int(time.time()), "errors": {"object": "list", "data": [error]}}
        return (
            self._write(
                f"UPDATE batches SET status = 'failed', body = json_patch(body, ?) WHERE id = ? AND lease_owner = ? "
                f"AND status IN ({marks})",
                (json.dumps(patch), batch_id, owner, *ACTIVE),
            )
            > 0
        )

    def status_counts(self) -> dict[str, int]:
        """How many batches are in each status."""
        return dict(self._all("SELECT status, count(*) FROM batches GROUP BY status"))

    # -- leases

    def take_leases(self, owner: str, lease_s: float, limit: int) -> list[str]:
        """Take (or keep) the lease of up to ``limit`` unfinished batches that no other gateway
        holds, oldest first; the ids whose lease ``owner`` holds now."""
        now = time.time()
        marks = ",".join("?" * len(ACTIVE))
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                rows = self._db.execute(
                    f"SELECT id FROM batches WHERE status IN ({marks}) AND "
                    "(lease_owner IS NULL OR lease_owner = ? OR lease_until < ?) ORDER BY created_at LIMIT ?",
                    (*ACTIVE, owner, now, limit),
                ).fetchall()
                ids = [r[0] for r in rows]
                self._db.executemany(
                    "UPDATE batches SET lease_owner = ?, lease_until = ? WHERE id = ?", [(owner, now + lease_s, i) for i in ids]
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return ids

    def renew_lease(self, owner: str, batch_id: str, lease_s: float) -> bool:
        """Extend ``owner``'s lease of ``batch_id``; False when another gateway took it over."""
        return (
            self._write(
                "UPDATE batches SET lease_until = ? WHERE id = ? AND lease_owner = ?", (time.time() + lease_s, batch_id, owner)
            )
            > 0
        )

    def release_lease(self, owner: str, batch_id: str) -> None:
        """Give up ``owner``'s lease of ``batch_id`` (at shutdown, so another gateway resumes it at once)."""
        self._write("UPDATE batches SET lease_owner = NULL, lease_until = 0 WHERE id = ? AND lease_owner = ?", (batch_id, owner))

    # -- lines

    def done_lines(self, batch_id: str) -> set[int]:
        """The lines of ``batch_id`` whose result is committed."""
        return {r[0] for r in self._all("SELECT line FROM results WHERE batch_id = ?", (batch_id,))}

    def start_attempt(self, batch_id: str, line: int) -> None:
        """Count one execution of ``line`` (committed before the request is sent)."""
        self._write(
            "INSERT INTO attempts VALUES (?, ?, 1) ON CONFLICT (batch_id, line) DO UPDATE SET n = n + 1", (batch_id, line)
        )

    def add_result(self, batch_id: str, line: int, ok: bool, record: bytes) -> bool:
        """Commit ``line``'s output record; False when it already had one (it is kept)."""
        return self._write("INSERT OR IGNORE INTO results VALUES (?, ?, ?, ?)", (batch_id, line, int(ok), record)) > 0

    def counts(self, batch_id: str) -> tuple[int, int]:
        """(completed, failed) lines of ``batch_id``."""
        row = self._one(
            "SELECT coalesce(sum(ok), 0), count(*) - coalesce(sum(ok), 0) FROM results WHERE batch_id = ?", (batch_id,)
        )
        return int(row[0]), int(row[1])

    def result_rows(self, batch_id: str) -> Iterator[tuple[int, bool, bytes]]:
        """(line, ok, record) of the committed results of ``batch_id`` by line: one statement
        (one snapshot) on a connection of its own, row by row, so neither every record in memory
        nor the store's lock is held while the finalizer writes the files."""
        db = sqlite3.connect(self.folder / "store.sqlite3", timeout=30)
        try:
            rows = db.execute("SELECT line, ok, record FROM results WHERE batch_id = ? ORDER BY line", (batch_id,))
            for line, ok, record in rows:
                yield line, bool(ok), bytes(record)
        finally:
            db.close()


def file_object(row: tuple) -> dict:
    """OpenAI's file object of a ``files`` row."""
    file_id, purpose, filename, size, created_at = row
    return {
        "id": file_id,
        "object": "file",
        "bytes": size,
        "created_at": created_at,
        "filename": filename,
        "purpose": purpose,
        "status": "processed",
        "status_details": None,
        "expires_at": None,
    }
