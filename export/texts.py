"""Fixed text sets used by export checks, parity tests and precision gates.

- ``reference_texts()``: export parity checks and parity tests.
- ``heldout_texts()``: precision gates (INT8, FP16); never used to tune or calibrate.
- ``calibration_texts()``: static-quantization calibration; disjoint from the held-out set.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"
DATA = DATA_DIR / "reference_texts.json"
HELDOUT = DATA_DIR / "heldout_texts.json"
CALIBRATION = DATA_DIR / "calibration_texts.json"
_REPEAT = re.compile(r"^\{\{REPEAT:(?P<text>.*):(?P<n>\d+)\}\}$", re.S)


def _load(path: Path) -> list[str]:
    out = []
    for text in json.loads(path.read_text(encoding="utf-8"))["texts"]:
        m = _REPEAT.match(text)
        out.append(m["text"] * int(m["n"]) if m else text)
    return out


def reference_texts() -> list[str]:
    """Texts with ``{{REPEAT:text:N}}`` expanded (keeps the file short, the texts long)."""
    return _load(DATA)


def heldout_texts() -> list[str]:
    """Held-out texts for precision gates, ``{{REPEAT:text:N}}`` expanded like ``reference_texts()``."""
    return _load(HELDOUT)


def calibration_texts() -> list[str]:
    """Calibration texts for static quantization, expanded the same way; none is held out."""
    return _load(CALIBRATION)
