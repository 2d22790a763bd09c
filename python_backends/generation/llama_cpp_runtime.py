"""The engine's forward pass on llama.cpp: the ``llama_*`` variants of ``text_generation``.

Everything the engine adds around the model stays as it is (scheduler, block manager and prefix
cache, sampling, penalties, logit bias, logprobs, guides, ``n`` choices, preemption, speculative
drafts, metrics): this runner only replaces :class:`~python_backends.generation.model_runner.ModelRunner`.
Its :meth:`LlamaCppRunner.execute` takes the same plan and returns the same FP32 logits rows, so
one ``llama_decode`` over a ``llama_batch`` computes every chunk of a step, on llama.cpp's CPU
kernels for the GGUF's quantized weights (Q4_0 has repacked x86 kernels) instead of PyTorch eager.

The KV cache is llama.cpp's (one unified buffer of cells, each cell tagged with the sequence ids
that see it). The block manager keeps deciding what is cached and shared; the runner mirrors its
decisions into llama.cpp's sequence ids (:class:`_Mirror`):

* every running sequence of the engine gets a llama.cpp sequence id, whose cells are exactly the
  positions the engine has computed for it;
* a physical block of the block manager has one *owner*, a llama.cpp sequence whose cells at that
  block's positions hold its contents (the last one that wrote or took it);
* a sequence admitted with prefix-cache hits, a choice forked from its prompt (``n`` > 1) or a copy
  on write gets those cells with ``llama_memory_seq_cp`` from the owners: the cells are shared, not
  copied, and no prompt token is computed twice;
* a finished, cancelled or preempted sequence is *retired*: its id keeps only the cells of the
  blocks it owns that are still in the prefix cache; a block evicted and written again, or taken
  by a live sequence, is dropped from the retired id. An id that owns nothing goes back to the pool.

So llama.cpp never holds more cells than the block manager counts in use or cached, and the block
manager's figures (KV usage, prefix hits) are what runs.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from contract.errors import ConfigError

log = logging.getLogger(__name__)

# variant -> the GGUF file type llama-quantize makes from the FP32 export (export/llama_cpp.py).
LLAMA_PRECISIONS = {
    "llama_q4_0": "Q4_0",  # the peers' CPU format: llama.cpp's repacked x86 kernels
    "llama_q4_1": "Q4_1",  # the packaged GGUF's own blocks, recovered exactly from the FP32 export
    "llama_q8_0": "Q8_0",
    "llama_bf16": "BF16",
    "llama_f16": "F16",
}
LLAMA_CPP_VERSION = "0.3.36"  # PyPI llama-cpp-python: its bindings and its vendored llama.cpp
LLAMA_MAX_SEQ = 256  # llama.cpp's LLAMA_MAX_SEQ: sequence ids are 0..255
# The CPU features the ggml CPU backend picks kernels by (GGML_NATIVE): a build is per feature set.
CPU_FEATURES = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx_vnni",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
)
# How llama.cpp is built besides GGML_NATIVE (export/llama_cpp.py), part of the cache key. Without
# OpenMP ggml runs its own thread pool: with it, ggml shares the libgomp that torch loaded first
# (one libgomp.so.1 per process), which python_backends.generation makes sleep at once
# (OMP_WAIT_POLICY=PASSIVE, for torch's threads), and a one-stream llama_bf16 step took 26 ms
# instead of 12-13.
BUILD_OPTIONS = ("GGML_OPENMP=OFF",)
KV_TYPES = {"f16": 1, "q8_0": 8, "f32": 0}  # GGML_TYPE_*
KV_TYPE_BYTES = {"f16": 2.0, "q8_0": 34 / 32, "f32": 4.0}
ROOT = Path(__file__).resolve().parents[2]


def cpu_features() -> list[str]:
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return [f for f in CPU_FEATURES if f in flags]


def build_key(features: list[str] | None = None) -> str:
    """The llama.cpp version, this CPU's features and the build options, e.g. ``0.3.36-1f2e3d4c``: a
    build made for one CPU is never run on another (its kernels may need instructions this one lacks)."""
    described = " ".join([*(cpu_features() if features is None else features), *BUILD_OPTIONS])
    digest = hashlib.sha256(described.encode()).hexdigest()[:8]
    return f"{LLAMA_CPP_VERSION}-{digest}"


def build_dir() -> Path:
    """Where llama.cpp's shared libraries and tools (llama-server) for this CPU live:
    ``$LLAMA_CPP_HOME`` (a container's), else the checkout's git-ignored ``.cache/llama.cpp/<key>``."""
    home = os.environ.get("LLAMA_CPP_HOME")
    return Path(home) if home else ROOT / ".cache" / "llama.cpp" / build_key()


def gguf_file(precision: str) -> str:
    return f"model-{LLAMA_PRECISIONS[precision].lower()}.gguf"


_lib: Any = None
_lib_lock = threading.Lock()


def load_library():
    """llama-cpp-python's ctypes bindings on this CPU's build (``llama_backend_init`` done once)."""
    global _lib
    with _lib_lock:
        if _lib is None:
            lib_dir = build_dir()
            if not (lib_dir / "libllama.so").is_file():
                raise ConfigError(
                    f"llama.cpp is not built for this CPU ({lib_dir}/libllama.so is missing): "
                    "run `python -m export.llama_cpp build` (make serve and make test do)"
                )
            os.environ["LLAMA_CPP_LIB_PATH"] = str(lib_dir)
            import llama_cpp.llama_cpp as lib  # the low-level bindings only: no chat formats, no server

            lib.llama_backend_init()

            global _log_callback
            _log_callback = lib.llama_log_callback(_quiet_log)  # referenced as long as llama.cpp may call it
            lib.llama_log_set(_log_callback, None)
            _lib = lib
        return _lib


_log_callback: Any = None


def _quiet_log(level: int, text: bytes, user_data) -> None:  # llama.cpp's log: warnings and errors only
    if level in (3, 4) and text:  # GGML_LOG_LEVEL_WARN, GGML_LOG_LEVEL_ERROR
        log.warning("llama.cpp: %s", text.decode(errors="replace").rstrip())


@dataclass
class GGUFWeights:
    """The GGUF a ``llama_*`` variant serves, with the exported folder's config.json (the engine
    reads vocabulary size, EOS ids and the context window from it, as for the PyTorch weights)."""

    config: Any
    path: Path
    precision: str

    def nbytes(self) -> int:
        return self.path.stat().st_size

    @classmethod
    def from_folder(cls, folder: str | Path, precision: str) -> GGUFWeights:
        from python_backends.generation.model_runner import LlamaConfig

        if precision not in LLAMA_PRECISIONS:
            raise ConfigError(f"weights_precision {precision!r}: expected one of {', '.join(LLAMA_PRECISIONS)}")
        path = Path(folder) / gguf_file(precision)
        if not path.is_file():
            raise ConfigError(f"{path} is missing: export it first (python -m export)")
        return cls(LlamaConfig.from_folder(folder), path, precision)


def kv_bytes_per_block(config, block_size: int, kv_type: str = "f16") -> int:
    return int(config.num_layers * 2 * config.num_kv_heads * config.head_dim * KV_TYPE_BYTES[kv_type] * block_size)


@dataclass(eq=False)
class _LSeq:
    """One llama.cpp sequence id: a running engine sequence's cells, or a retired one's kept blocks."""

    lid: int
    end: int = 0  # its cells cover positions [0, end) while running
    table: list[int] = field(default_factory=list)  # the engine sequence's block table, as last run
    owned: set[int] = field(default_factory=set)  # the physical blocks it owns (_owner says at which index)


class LlamaCppRunner:
    """A llama.cpp context behind :class:`~python_backends.generation.model_runner.ModelRunner`'s interface."""

    def __init__(
        self,
        weights: GGUFWeights,
        block_manager,
        max_model_len: int,
        max_batch_tokens: int,
        num_threads: int | None = None,
        kv_type: str = "f16",
        flash_attn: bool = True,
        prefix_cells: int = 512,
    ):
        self.lib = lib = load_library()
        self.prefix_cells = int(prefix_cells)
        self.weights = weights
        self.config = weights.config
        self.bm = block_manager
        self.block_size = block_manager.block_size
        self.max_model_len = max_model_len
        self.vocab = int(weights.config.vocab_size)
        if kv_type not in KV_TYPES:
            raise ConfigError(f"kv_cache_type {kv_type!r}: expected one of {', '.join(KV_TYPES)}")
        mparams = lib.llama_model_default_params()
        mparams.use_mmap = True
        self._model = lib.llama_model_load_from_file(str(weights.path).encode(), mparams)
        if not self._model:
            raise ConfigError(f"llama.cpp could not load {weights.path}")
        n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self._model))
        if n_vocab != self.vocab:
            raise ConfigError(f"{weights.path.name} has {n_vocab} tokens, config.json {self.vocab}")
        threads = int(num_threads or os.cpu_count() or 1)
        self.num_cells = block_manager.num_blocks * self.block_size
        self.batch_capacity = max(64, int(max_batch_tokens))
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = self.num_cells + self.batch_capacity  # what the block manager counts, and a step's room
        cparams.n_batch = self.batch_capacity
        cparams.n_ubatch = self.batch_capacity
        cparams.n_seq_max = LLAMA_MAX_SEQ
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.kv_unified = True  # one buffer: sequences share cells (prefix hits, forks)
        cparams.type_k = cparams.type_v = KV_TYPES[kv_type]
        cparams.flash_attn_type = 1 if flash_attn else 0
        cparams.no_perf = True
        self._ctx = lib.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            lib.llama_model_free(self._model)
            raise ConfigError(f"llama.cpp could not make a context of {cparams.n_ctx} cells for {weights.path.name}")
        self._mem = lib.llama_get_memory(self._ctx)
        self.kv_type = kv_type
        self._kv_nbytes = kv_bytes_per_block(self.config, self.block_size, kv_type) * block_manager.num_blocks
        # The batch: llama.cpp reads these numpy arrays in place (one sequence id per token).
        n = self.batch_capacity
        self._tok = np.zeros(n, np.int32)
        self._pos = np.zeros(n, np.int32)
        self._nseq = np.ones(n, np.int32)
        self._seq = np.zeros(n, np.int32)
        self._out = np.zeros(n, np.int8)
        i32p = ctypes.POINTER(ctypes.c_int32)
        base = self._seq.ctypes.data
        self._seq_ptrs = (i32p * n)(*[ctypes.cast(base + 4 * i, i32p) for i in range(n)])
        self._batch = lib.llama_batch()
        self._batch.token = self._tok.ctypes.data_as(i32p)
        self._batch.embd = ctypes.POINTER(ctypes.c_float)()
        self._batch.pos = self._pos.ctypes.data_as(i32p)
        self._batch.n_seq_id = self._nseq.ctypes.data_as(i32p)
        self._batch.seq_id = self._seq_ptrs
        self._batch.logits = self._out.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        # Sequence ids: LLAMA_MAX_SEQ - 1 is the gate's scratch sequence (sequence_logits).
        self._free_ids: list[int] = list(range(LLAMA_MAX_SEQ - 2, -1, -1))
        self._scratch = LLAMA_MAX_SEQ - 1
        self._running: dict[Any, _LSeq] = {}  # engine seq id -> its llama.cpp sequence
        self._retired: OrderedDict[int, _LSeq] = OrderedDict()  # oldest first
        self._owner: dict[int, tuple[_LSeq, int]] = {}  # physical block -> (owner, block index)
        self._suspect = False  # the last decode failed: cells past the recorded ends may exist
        self.num_threads = threads
        log.info(
            "llama.cpp runner: %s (%.0f MiB), %d KV cells (%s, %.0f MiB), batch %d, %d threads, flash attention %s",
            weights.path.name,
            weights.nbytes() / 2**20,
            self.num_cells,
            kv_type,
            self._kv_nbytes / 2**20,
            n,
            threads,
            "on" if flash_attn else "off",
        )

    def kv_nbytes(self) -> int:
        return self._kv_nbytes

    def close(self) -> None:
        if getattr(self, "_ctx", None):
            self.lib.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            self.lib.llama_model_free(self._model)
            self._model = None

    def __del__(self):  # noqa: D105 - frees llama.cpp's context and weights with the runner
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # ---- the mirror of the block manager's decisions -------------------------------------
    def _rm(self, ls: _LSeq, p0: int, p1: int) -> None:
        self.lib.llama_memory_seq_rm(self._mem, ls.lid, p0, p1)

    def _new_lseq(self) -> _LSeq:
        if not self._free_ids:  # every id keeps cached blocks: the oldest retired one gives them up
            _, oldest = self._retired.popitem(last=False)
            for b in list(oldest.owned):
                self._owner.pop(b, None)
                self.bm.uncache(b)
            self._release_id(oldest)
        return _LSeq(self._free_ids.pop())

    def _release_id(self, ls: _LSeq) -> None:
        self._rm(ls, -1, -1)
        ls.owned.clear()
        self._free_ids.append(ls.lid)

    def _disown(self, b: int, new: tuple[_LSeq, int] | None) -> None:
        """Block ``b`` changes owner: a retired previous owner drops its cells of it."""
        prev = self._owner.get(b)
        if prev is not None and prev != new:
            old, j = prev
            old.owned.discard(b)
            if old.lid in self._retired:
                self._rm(old, j * self.block_size, (j + 1) * self.block_size)
                if not old.owned:
                    del self._retired[old.lid]
                    self._release_id(old)
        if new is None:
            self._owner.pop(b, None)
        else:
            self._owner[b] = new
            new[0].owned.add(b)

    def release(self, seq_id) -> None:
        """The engine sequence finished, was cancelled or preempted (Scheduler's release hook):
        its llama.cpp id keeps only the cells of blocks it owns that the prefix cache still holds."""
        ls = self._running.pop(seq_id, None)
        if ls is None:
            return
        bs = self.block_size
        kept: set[int] = set()  # block indices whose cells stay
        for b in list(ls.owned):
            if self.bm.is_cached(b):
                kept.add(self._owner[b][1])
            else:
                ls.owned.discard(b)
                del self._owner[b]
        if not kept:
            self._release_id(ls)
            return
        start = None
        for j in range(-(-ls.end // bs) + 1):  # drop every run of positions outside the kept blocks
            if j not in kept and j * bs < ls.end:
                start = j * bs if start is None else start
            elif start is not None:
                self._rm(ls, start, j * bs)
                start = None
        if start is not None:
            self._rm(ls, start, -1)
        self._retired[ls.lid] = ls
        self._trim_retired()

    def _trim_retired(self) -> None:
        """Finished sequences keep at most ``prefix_cells`` cells: the oldest give theirs up (and the prefix
        cache those blocks). llama.cpp attends over every cell up to the highest one in use, so cached
        cells left all over the pool cost every step of every sequence (filled 1 GiB pool: prefill
        200 tokens/s against 552)."""
        kept = sum(len(ls.owned) for ls in self._retired.values()) * self.block_size
        while kept > self.prefix_cells and self._retired:
            _, oldest = self._retired.popitem(last=False)
            kept -= len(oldest.owned) * self.block_size
            for b in list(oldest.owned):
                self._owner.pop(b, None)
                self.bm.uncache(b)
            self._release_id(oldest)

    def _attach(self, chunk, copies: dict[int, tuple[int, int]]) -> _LSeq:
        """The llama.cpp sequence of ``chunk``'s engine sequence, with cells for positions
        ``[0, chunk.start)`` (prefix hits, a fork's prompt, copies on write taken from their owners)."""
        ls = self._running.get(chunk.seq_id)
        bs = self.block_size
        if ls is None:
            ls = self._new_lseq()
            self._running[chunk.seq_id] = ls
            try:
                for j in range(-(-chunk.start // bs)):
                    b = chunk.block_table[j]
                    src = copies.get(b, (b, bs))[0]
                    owner = self._owner.get(src)
                    if owner is None or owner[1] != j:
                        raise RuntimeError(f"llama.cpp runner: block {src} at index {j} of {chunk.seq_id!r} has no cells")
                    self.lib.llama_memory_seq_cp(self._mem, owner[0].lid, ls.lid, j * bs, min((j + 1) * bs, chunk.start))
                    # A shared block's newest holder owns it; a copy's destination is its own (its source keeps its owner).
                    self._disown(b, (ls, j))
                    ls.end = min((j + 1) * bs, chunk.start)
            except Exception:
                self.release(chunk.seq_id)  # what it took stays consistent; a retry attaches afresh
                raise
            ls.end = chunk.start
        elif chunk.start < ls.end or self._suspect:  # a rejected draft, or a step that failed
            self._rm(ls, chunk.start, -1)
            ls.end = chunk.start
        elif chunk.start > ls.end:
            raise RuntimeError(f"llama.cpp runner: {chunk.seq_id!r} resumes at {chunk.start} with cells up to {ls.end}")
        ls.table = list(chunk.block_table)
        for j in range(chunk.start // bs, -(-chunk.end // bs)):  # the blocks this chunk writes are its own
            self._disown(chunk.block_table[j], (ls, j))
        return ls

    # ---- running a step ----------------------------------------------------------------
    def execute(self, plan) -> torch.Tensor:
        """Run every chunk of ``plan`` in one ``llama_decode``; FP32 logits ``[rows, vocab]`` in
        :meth:`ModelRunner.execute`'s order. The rows are llama.cpp's buffer, valid until the next step."""
        chunks = plan.chunks
        if not chunks:
            return torch.empty(0, self.vocab)
        copies = {dst: (src, n) for src, dst, n in plan.copies}
        n = 0
        for c in chunks:
            if c.end > self.max_model_len:
                raise ValueError(f"position {c.end - 1} is beyond max_model_len {self.max_model_len}")
            ls = self._attach(c, copies)
            k = c.end - c.start
            if n + k > self.batch_capacity:
                raise ValueError(f"a step of more than {self.batch_capacity} tokens")
            self._tok[n : n + k] = c.token_ids
            self._pos[n : n + k] = np.arange(c.start, c.end, dtype=np.int32)
            self._seq[n : n + k] = ls.lid
            self._out[n : n + k] = 0
            if c.num_logits:
                self._out[n + k - c.num_logits : n + k] = 1
            n += k
        self._suspect = False
        rows = self._decode(n)
        for c in chunks:
            self._running[c.seq_id].end = c.end
        return rows

    def _decode(self, n: int) -> torch.Tensor:
        self._batch.n_tokens = n
        outputs = int(self._out[:n].sum())
        status = self.lib.llama_decode(self._ctx, self._batch)
        if status != 0:
            self._suspect = True
            raise RuntimeError(f"llama_decode failed with status {status} on {n} tokens")
        if outputs == 0:
            return torch.empty(0, self.vocab)
        ptr = self.lib.llama_get_logits(self._ctx)
        return torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(outputs, self.vocab)))

    def sequence_logits(self, token_ids: list[int], chunk: int = 256) -> torch.Tensor:
        """Teacher-forced FP32 logits of every position of ``token_ids`` (the gate), run in
        chunks of ``chunk`` tokens on a scratch sequence; ``[len, vocab]``."""
        n = len(token_ids)
        if not 0 < n <= self.max_model_len:
            raise ValueError(f"{n} tokens: the runner holds 1..{self.max_model_len}")
        chunk = min(chunk, self.batch_capacity)
        scratch = _LSeq(self._scratch)
        self._rm(scratch, -1, -1)
        out = []
        try:
            for start in range(0, n, chunk):
                end = min(n, start + chunk)
                k = end - start
                self._tok[:k] = token_ids[start:end]
                self._pos[:k] = np.arange(start, end, dtype=np.int32)
                self._seq[:k] = scratch.lid
                self._out[:k] = 1
                out.append(self._decode(k).clone())
        finally:
            self._rm(scratch, -1, -1)
        return torch.cat(out)
