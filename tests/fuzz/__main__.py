"""``python -m tests.fuzz`` (``make fuzz``): the whole campaign, endpoints, gateway and atheris
(tests/fuzz/endpoints.py)."""

import sys

from tests.fuzz.endpoints import main

sys.exit(main())
