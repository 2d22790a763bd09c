"""``python -m clients``: ``generate`` and ``chat`` (clients.generation_cli) when the first
argument names one; otherwise the ``embed`` command (clients.cli)."""

import sys

from clients import cli, generation_cli

if sys.argv[1:2] and sys.argv[1] in generation_cli.COMMANDS:
    raise SystemExit(generation_cli.main(sys.argv[1:]))
raise SystemExit(cli.main())
