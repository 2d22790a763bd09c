"""What crosses the hops between the model repository's steps, the doors, the gateway and the
clients: the error codes and their data (:mod:`contract.errors`), the sampling fields and their
limits (:mod:`contract.sampling`), the truncation inputs (:mod:`contract.truncation`), a model's
configuration as Triton hands it over (:mod:`contract.model_config`) and the one place that reads
other components' words where they give no data (:mod:`contract.prose`).

Light on purpose (the standard library and numpy): the gateway and the clients import it without
the backends' runtimes, and the Python backends import it inside tritonserver's stubs.
"""
