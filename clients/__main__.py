"""``python -m clients``: the ``embed`` command (see clients.cli)."""

from clients.cli import main

raise SystemExit(main())
