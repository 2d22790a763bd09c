"""The systems the served models are measured against: the in-process ceiling (``limit``), the naive
per-request server, llama.cpp's ``llama-server``, OpenVINO GenAI and infinity-emb."""
