"""``python -m clients``: ``generate`` and ``chat`` (clients/generation/cli.py) when the first
argument names one; otherwise the ``embed`` command (clients/embeddings/cli.py)."""

import sys

from clients.embeddings import cli as embed_cli
from clients.generation import cli as generation_cli

if sys.argv[1:2] and sys.argv[1] in generation_cli.COMMANDS:
    raise SystemExit(generation_cli.main(sys.argv[1:]))
raise SystemExit(embed_cli.main())
