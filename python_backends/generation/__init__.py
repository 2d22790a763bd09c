"""Text generation engine: paged KV cache, continuous batching and prefix caching, unit-tested without Triton."""

import os

# PyTorch's OpenMP threads sleep instead of spinning while they wait. Spinning, two threads on
# two cores shared with tritonserver, the front door and other models made a decode step 2-10x
# slower than one thread (docs/performance.md, "Threads"). Read when torch loads libgomp, so it
# must be set before the first `import torch` of the process; an explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
