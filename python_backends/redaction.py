"""Keep secrets out of logs and console output."""

from __future__ import annotations


def redact_url(url: str) -> str:
    """``url`` with its user-info (``user:password@``) replaced by ``***@``."""
    if "@" not in url:
        return url
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "***@" + url.rsplit("@", 1)[1]
    return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"
