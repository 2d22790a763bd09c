"""API keys: ``Authorization: Bearer <key>``, compared in constant time, never logged.

Keys come from ``$GATEWAY_API_KEYS`` (comma-separated) or, when that is empty, from a key
file that is created with one new random key (mode 0600) the first time. Logs and metrics
name a key by its id: the first 12 hex digits of its SHA-256, which cannot be turned back
into the key.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

KEY_PREFIX = "sk-triton-"
ANONYMOUS = "-"


def key_id(key: str) -> str:
    """The id of a key in logs and metrics: a short SHA-256 prefix, never the key."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:12]


def ensure_key_file(path: Path) -> list[str]:
    """The keys in ``path`` (one per line); a new file with one new key when it is missing."""
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        # O_EXCL: two gateways starting at once do not overwrite each other's key.
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "w") as f:
                f.write(key + "\n")
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise PermissionError(f"{path} is readable by others (mode {mode:o}); chmod 600 it")
    keys = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    keys = [k for k in keys if k and not k.startswith("#")]
    if not keys:
        raise ValueError(f"{path} holds no API key")
    return keys


class ApiKeys:
    """The accepted keys, held as SHA-256 digests."""

    def __init__(self, keys: list[str] | tuple[str, ...]):
        if not keys:
            raise ValueError("no API keys")
        for k in keys:
            if len(k) < 16:
                raise ValueError(f"an API key must have at least 16 characters (key id {key_id(k)})")
        self._digests = [(hashlib.sha256(k.encode("utf-8")).digest(), key_id(k)) for k in keys]

    def __len__(self) -> int:
        return len(self._digests)

    def check(self, authorization: str | None) -> str | None:
        """The key id of a valid ``Bearer`` header, or None.

        Every stored digest is compared (``hmac.compare_digest``), matched or not, so the
        time taken does not say which key, or how much of one, was right.
        """
        if not authorization:
            return None
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        presented = hashlib.sha256(token.strip().encode("utf-8", "replace")).digest()
        found = None
        for digest, kid in self._digests:
            if hmac.compare_digest(presented, digest):
                found = kid
        return found
