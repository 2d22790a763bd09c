"""Operations tools for a running server: the repository API client (model load/unload with the
repository token) and the canary rollout command (``python -m ops.rollout``)."""
