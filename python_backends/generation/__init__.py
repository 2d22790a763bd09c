"""Text generation engine: paged KV cache, continuous batching and prefix caching, unit-tested without Triton."""
