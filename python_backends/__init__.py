"""Library behind the Triton Python models of this repository.

Nothing here imports Triton's ``triton_python_backend_utils``; the model.py shims under
``model_repository/`` (and the Python-based ``onnxruntime`` backend under
``python_backends/triton_backends/``) are the only Triton-facing code.
"""
