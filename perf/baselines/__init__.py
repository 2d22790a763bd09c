"""The systems the served models are measured against: the in-process ceiling (``limit``), the naive
per-request servers and llama.cpp's ``llama-server``."""
