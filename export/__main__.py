"""`python -m export [--force] [--model NAME] [--repository DIR]`: export the served models."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from export import text_encoder

ROOT = Path(__file__).resolve().parent.parent
EXPORTERS = {"text_encoder": text_encoder.export}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m export", description=__doc__)
    parser.add_argument("--model", choices=sorted(EXPORTERS), action="append", help="export only this model (repeatable)")
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository", help="model repository to write into")
    parser.add_argument("--force", action="store_true", help="rebuild even when up to date")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s export %(message)s", datefmt="%H:%M:%S")
    failed = []
    for name in args.model or sorted(EXPORTERS):
        try:
            EXPORTERS[name](args.repository, force=args.force)
        except Exception as exc:  # noqa: BLE001 - report every model, then fail
            logging.getLogger("export").error("%s: %s", name, exc)
            failed.append(name)
    if failed:
        print(f"export failed for: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
