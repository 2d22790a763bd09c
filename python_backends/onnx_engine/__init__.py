"""The engine behind the onnxruntime backend: ONNX Runtime sessions planned from a Triton model
config (session.py) and batched execution that isolates a failing request (batching.py)."""
