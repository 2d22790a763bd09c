"""``python -m perf.fuzz`` (``make fuzz``): the whole campaign, endpoints, gateway and atheris
(perf/fuzz/endpoints.py)."""

import sys

from perf.fuzz.endpoints import main

sys.exit(main())
