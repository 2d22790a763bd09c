"""The fixed reference texts used by export checks and parity tests."""

from __future__ import annotations

import json
import re
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "reference_texts.json"
_REPEAT = re.compile(r"^\{\{REPEAT:(?P<text>.*):(?P<n>\d+)\}\}$", re.S)


def reference_texts() -> list[str]:
    """Texts with ``{{REPEAT:text:N}}`` expanded (keeps the file short, the texts long)."""
    out = []
    for text in json.loads(DATA.read_text(encoding="utf-8"))["texts"]:
        m = _REPEAT.match(text)
        out.append(m["text"] * int(m["n"]) if m else text)
    return out
