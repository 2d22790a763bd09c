"""The sizes and limits of one generation engine (:class:`EngineConfig`), checked where they enter.

The Triton model fills it from config.pbtxt (``python_backends/generation/entry.py``); the export gate,
the benchmarks and the tests build it directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from contract.errors import ConfigError
from python_backends.generation.linear import PRECISIONS
from python_backends.generation.llama_cpp_runtime import KV_TYPES, LLAMA_PRECISIONS
from python_backends.generation.model_runner import DTYPES
from python_backends.generation.openvino_runtime import OV_PRECISIONS


@dataclass
class EngineConfig:
    """Sizes and limits of one engine; the Triton model fills it from config.pbtxt."""

    model_dir: str | Path
    device: str = "cpu"
    dtype: str = "float32"
    # The matrix products' weights (python_backends/generation/linear.py): fp32, bf16 or int4_bf16; or a
    # llama_* variant, the whole forward on llama.cpp over the exported GGUF (llama_cpp_runtime.py); or an
    # ov_* variant, the whole forward on OpenVINO's paged-attention model (openvino_runtime.py).
    weights_precision: str = "fp32"
    # llama_* variants: the K/V cells' type (f16, q8_0) and flash attention.
    kv_cache_type: str = "f16"
    flash_attn: bool = True
    # llama_* variants: at most this many cells of finished sequences stay in llama.cpp for the prefix
    # cache (oldest given up first). Its attention reads every cell up to the highest in use, so cells
    # kept over the whole pool make every step pay for the whole pool (llama_cpp_runtime.py).
    llama_prefix_cells: int = 512
    block_size: int = 16
    # The pool: num_blocks when given, else as many blocks as kv_cache_bytes holds.
    kv_cache_bytes: int = 256 * 2**20
    num_blocks: int | None = None
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_waiting: int = 256
    # Bulk requests (priority_class bulk) take at most this many places in the running batch
    # (0: no cap), so interactive arrivals find room without a preemption.
    max_running_bulk: int = 0
    max_model_len: int = 4096
    max_tokens_limit: int = 2048
    default_max_tokens: int = 16
    # The sampling fields a request that leaves them out gets (sampling.sampling_defaults).
    sampling_defaults: dict = field(default_factory=dict)
    enable_prefix_caching: bool = True
    # Prompt-lookup speculative decoding (speculative.py): greedy requests' decodes carry a draft
    # of up to this many tokens found earlier in their context, verified in the same step; only
    # while at most speculative_max_seqs sequences decode. 0: off.
    num_speculative_tokens: int = 0
    speculative_max_seqs: int = 2
    # The most prompt tokens a step spends while it also carries decodes (0: the whole
    # max_num_batched_tokens): bounds the inter-token gap a new prompt adds to running streams.
    prefill_tokens_with_decodes: int = 0
    num_threads: int | None = None
    # Admission window of EngineLoop: when a burst may be arriving (the loop woke from idle, or
    # the step just finished requests whose clients send their next ones), wait up to this long
    # for the rest of it, so the burst shares one prefill step instead of its first request
    # taking a step alone and the others waiting that whole step. 0: no window.
    admission_window_ms: float = 0.0
    # ... ending early once no request arrived for this long (or the batch is full).
    admission_quiet_ms: float = 15.0

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r}: expected one of {', '.join(DTYPES)}")
        if self.weights_precision not in (*PRECISIONS, *LLAMA_PRECISIONS, *OV_PRECISIONS):
            choices = ", ".join((*PRECISIONS, *LLAMA_PRECISIONS, *OV_PRECISIONS))
            raise ConfigError(f"weights_precision {self.weights_precision!r}: expected one of {choices}")
        if self.llama_prefix_cells < 0:
            raise ConfigError(f"llama_prefix_cells must be >= 0, got {self.llama_prefix_cells}")
        if self.kv_cache_type not in KV_TYPES:
            raise ConfigError(f"kv_cache_type {self.kv_cache_type!r}: expected one of {', '.join(KV_TYPES)}")
        if self.weights_precision in LLAMA_PRECISIONS and self.device != "cpu":
            raise ConfigError(f"weights_precision {self.weights_precision} runs on the CPU (llama.cpp's CPU build)")
        if self.weights_precision in OV_PRECISIONS and self.device != "cpu":
            raise ConfigError(f"weights_precision {self.weights_precision} runs on the CPU (OpenVINO's CPU plugin)")
        for name in (
            "block_size",
            "kv_cache_bytes",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "max_tokens_limit",
        ):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.num_speculative_tokens <= 16:
            raise ConfigError(f"num_speculative_tokens must be in [0, 16], got {self.num_speculative_tokens}")
        if self.prefill_tokens_with_decodes < 0:
            raise ConfigError(f"prefill_tokens_with_decodes must be >= 0, got {self.prefill_tokens_with_decodes}")
        if self.speculative_max_seqs < 0:
            raise ConfigError(f"speculative_max_seqs must be >= 0, got {self.speculative_max_seqs}")
        if self.max_waiting < 0:
            raise ConfigError(f"max_waiting must be >= 0, got {self.max_waiting}")
        if self.max_running_bulk < 0:  # above max_num_seqs it caps nothing
            raise ConfigError(f"max_running_bulk must be >= 0, got {self.max_running_bulk}")
        for name in ("admission_window_ms", "admission_quiet_ms"):
            if not 0 <= float(getattr(self, name)) <= 1000:
                raise ConfigError(f"{name} must be in [0, 1000], got {getattr(self, name)}")
