"""The Llama forward pass over a paged KV cache: one batched step of the engine.

Weights are read from a Hugging Face checkpoint folder (``config.json`` and
``model.safetensors``, what ``python -m export.generation`` writes) into plain tensors;
no ``transformers`` model object runs here. One call of :meth:`ModelRunner.execute`
takes the scheduler's plan for a step (decode rows and prefill chunks of many
sequences laid end to end), writes each new token's K/V into the pool at the slots the
block manager gave it, attends through the block tables and returns the logits of the
rows that sample.

Numerics follow ``transformers``' Llama (RMSNorm in FP32, RoPE from FP32 inverse
frequencies, SiLU-gated MLP), so greedy tokens match ``generate()`` on the same weights.
Q/K/V and gate/up projections are fused into one matrix each: fewer, larger matrix
products per layer, which is where a small model's CPU step spends its time. Each product is a
:class:`~python_backends.generation.linear.Linear` in the weights' precision (FP32, BF16 or
INT4 blocks, ``linear.py``); with FP32 weights the numbers are transformers' own.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from contract.errors import ConfigError
from python_backends.generation.linear import HEAD_PRECISION, Linear, kv_cache_dtype, make_linear
from python_backends.generation.paged_attention import PagedKVCache
from python_backends.generation.scheduler import SchedulerOutput

# Qwen2 is Llama with a bias on the query, key and value projections.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ATTN_DTYPE: dict[torch.dtype, torch.dtype] = {torch.bfloat16: torch.bfloat16}


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    qkv_bias: bool = False  # Qwen2's q/k/v projections carry a bias

    @classmethod
    def from_dict(cls, cfg: dict) -> LlamaConfig:
        archs = cfg.get("architectures") or []
        if archs and not set(archs) & set(SUPPORTED_ARCHITECTURES):
            raise ConfigError(f"config.json declares architecture {archs}; this engine runs {', '.join(SUPPORTED_ARCHITECTURES)}")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ConfigError(f"rope type {rope_type!r} is not supported (only the default RoPE)")
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        qwen2 = "Qwen2ForCausalLM" in archs or cfg.get("model_type") == "qwen2"
        for key in ("attention_bias", "mlp_bias"):
            if cfg.get(key):
                raise ConfigError(f"config.json sets {key}; this engine runs Llama without biases")
        if qwen2 and cfg.get("use_sliding_window"):
            raise ConfigError("config.json sets use_sliding_window; this engine attends over the whole context")
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
            qkv_bias=qwen2,
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> LlamaConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path} is missing: export the model first (python -m export.generation)")
        return cls.from_dict(json.loads(path.read_text()))


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: Linear  # [(heads + 2 * kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None  # [(heads + 2 * kv_heads) * head_dim] (Qwen2), in the activations' dtype
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear  # [2 * intermediate, hidden]
    down: Linear


def _load_state_dict(folder: Path, device) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors in {folder}: export the model first (python -m export.generation)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f), device=str(device)))
    return state


class LlamaWeights:
    """The checkpoint's tensors, fused and cast once at load; the products in ``precision``.

    The token embedding stays in ``dtype`` (a lookup reads one row); the output head is its
    own Linear in ``precision`` even when tied to it. The checkpoint's tensors are dropped as
    each layer is built, so a quantized model's resident weights are the quantized ones.
    """

    def __init__(self, config: LlamaConfig, state: dict[str, torch.Tensor], dtype: torch.dtype, device, precision: str = "fp32"):
        self.config = config
        self.precision = precision

        def take(name: str) -> torch.Tensor:
            if name not in state:
                raise ConfigError(f"the checkpoint has no tensor {name!r}")
            return state.pop(name).to(device=device, dtype=dtype)

        def linear(*names: str, precision: str = precision) -> Linear:
            parts = [take(n) for n in names]
            return make_linear(parts[0] if len(parts) == 1 else torch.cat(parts, 0).contiguous(), precision)

        self.embed = take("model.embed_tokens.weight")
        self.norm = take("model.norm.weight")
        if config.tie_word_embeddings or "lm_head.weight" not in state:
            self.lm_head = make_linear(self.embed, HEAD_PRECISION[precision])
        else:
            self.lm_head = linear("lm_head.weight", precision=HEAD_PRECISION[precision])
        expected = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            layer = _Layer(
                input_norm=take(p + "input_layernorm.weight"),
                qkv=linear(*(p + f"self_attn.{n}_proj.weight" for n in "qkv")),
                qkv_bias=torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]) if config.qkv_bias else None,
                o=linear(p + "self_attn.o_proj.weight"),
                post_norm=take(p + "post_attention_layernorm.weight"),
                gate_up=linear(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                down=linear(p + "mlp.down_proj.weight"),
            )
            if (layer.qkv.out_features, layer.qkv.in_features) != (expected, config.hidden_size):
                raise ConfigError(
                    f"q/k/v projections are {[layer.qkv.out_features, layer.qkv.in_features]}, config.json implies "
                    f"{[expected, config.hidden_size]}"
                )
            self.layers.append(layer)

    def nbytes(self) -> int:
        """Bytes of the weights as held (the embedding, the norms and every Linear)."""
        linears = [self.lm_head] + [m for layer in self.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        tensors = [self.embed, self.norm] + [t for layer in self.layers for t in (layer.input_norm, layer.post_norm)]
        tensors += [layer.qkv_bias for layer in self.layers if layer.qkv_bias is not None]
        shared = self.lm_head.nbytes if type(self.lm_head) is Linear and self.lm_head.weight is self.embed else 0
        return sum(t.numel() * t.element_size() for t in tensors) + sum(m.nbytes for m in linears) - shared

    @classmethod
    def from_folder(
        cls, folder: str | Path, dtype: torch.dtype = torch.float32, device="cpu", precision: str = "fp32"
    ) -> LlamaWeights:
        folder = Path(folder)
        config = LlamaConfig.from_folder(folder)
        return cls(config, _load_state_dict(folder, device), dtype, device, precision)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # transformers' LlamaRMSNorm: the statistics in FP32, the weight applied in the input dtype.
    # In FP32 PyTorch's fused rms_norm gives the same numbers in one op instead of eight.
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


class ModelRunner:
    """Owns the weights and the KV pool; runs one batched forward per engine step."""

    def __init__(
        self,
        weights: LlamaWeights,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        device="cpu",
        dtype: torch.dtype = torch.float32,
    ):
        cfg = weights.config
        self.weights = weights
        self.config = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        kv_dtype = kv_cache_dtype(weights.precision, dtype, self.device)
        self.cache = PagedKVCache(
            cfg.num_layers,
            num_blocks,
            block_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            kv_dtype,
            self.device,
            attn_dtype=ATTN_DTYPE.get(kv_dtype, dtype),
        )
        # RoPE tables for every position the engine may run, as transformers computes
        # them: FP32 inverse frequencies times the FP32 position, then cos and sin.
        # inv_freq on the CPU (transformers' buffer is made there), the products and cos/sin
        # on the device as transformers' forward computes them: bitwise equal tables on CUDA.
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim))
        inv_freq = inv_freq.to(self.device)
        positions = torch.arange(max_model_len, dtype=torch.float32, device=self.device)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos = emb.cos().to(device=self.device, dtype=dtype)
        self._sin = emb.sin().to(device=self.device, dtype=dtype)
        # rotate_half(x) * sin == roll(x, D/2) * sin with its first half negated, bit for bit
        # (negation is exact): one roll instead of two slices, a negation and a cat per layer.
        half = cfg.head_dim // 2
        self._sin_rolled = torch.cat((-self._sin[:, :half], self._sin[:, half:]), dim=-1)
        self.max_model_len = max_model_len
        self._scale = 1.0 / math.sqrt(cfg.head_dim)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> torch.Tensor:
        """Run every chunk of ``plan``; return FP32 logits ``[sum of num_logits, vocab]``.

        The rows follow the order of ``plan.chunks`` restricted to chunks with ``samples``:
        one row each, or ``1 + len(draft)`` rows (every position) for a chunk with a draft.
        """
        if plan.copies:  # forked sequences' shared partial blocks, copied before anything is written
            self.cache.copy_blocks(plan.copies)
        chunks = plan.chunks
        if not chunks:
            return torch.empty(0, self.config.vocab_size, device=self.device)
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_rows: list[int] = []
        for c in chunks:
            token_ids.extend(c.token_ids)
            positions.extend(range(c.start, c.end))
            slots.extend(c.slots)
            last_rows.extend(range(len(token_ids) - c.num_logits, len(token_ids)))
        if positions and max(positions) >= self.max_model_len:
            raise ValueError(f"position {max(positions)} is beyond max_model_len {self.max_model_len}")
        # A decode with a draft attends as that many one-token decodes (row j sees positions up
        # to start + j), batched with the other decodes: the numbers each row gets are those of
        # a plain decode at its position, so drafts change how many tokens a step yields, not them.
        tables: list[list[int]] = []
        ends: list[int] = []
        lens: list[int] = []
        for c in chunks:
            if c.draft:
                tables += [c.block_table] * c.num_tokens
                ends += range(c.start + 1, c.end + 1)
                lens += [1] * c.num_tokens
            else:
                tables.append(c.block_table)
                ends.append(c.end)
                lens.append(c.num_tokens)
        attn_plan = self.cache.plan(tables, ends, lens, self.config.num_heads)
        return self.forward(token_ids, positions, slots, attn_plan, last_rows)

    @torch.inference_mode()
    def sequence_logits(self, token_ids: list[int], chunk: int = 256) -> torch.Tensor:
        """FP32 logits after every token of one sequence ``[len, vocab]`` (teacher forcing).

        For gates and tests on a runner that serves nothing: it writes the sequence's K/V into
        the pool's first blocks, in prefill chunks of ``chunk`` tokens as the engine would."""
        n = len(token_ids)
        bs = self.cache.block_size
        table = list(range(-(-n // bs)))
        if not 0 < n <= self.max_model_len or len(table) > self.cache.num_blocks:
            raise ValueError(f"{n} tokens: the runner holds 1..{min(self.max_model_len, self.cache.num_slots)}")
        out = []
        for start in range(0, n, chunk):
            end = min(n, start + chunk)
            plan = self.cache.plan([table], [end], [end - start], self.config.num_heads)
            out.append(
                self.forward(
                    token_ids[start:end], list(range(start, end)), list(range(start, end)), plan, list(range(end - start))
                )
            )
        return torch.cat(out, 0)

    @torch.inference_mode()
    def forward(self, token_ids, positions, slots, attn_plan, last_rows) -> torch.Tensor:
        cfg, w, dev = self.config, self.weights, self.device
        # Slots are checked once here on the host, not by the cache in every layer (a CUDA
        # sync each). Every host-to-device copy comes before the first layer: a blocking copy
        # of a list to CUDA waits for the stream, so one after the layers would wait for them.
        checked = not isinstance(slots, torch.Tensor)
        if checked and slots and (min(slots) < 0 or max(slots) >= self.cache.num_slots):
            raise IndexError(f"slots must be in [0, {self.cache.num_slots}), got {min(slots)}..{max(slots)}")
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=dev)
        pos = torch.as_tensor(positions, dtype=torch.long, device=dev)
        slot_t = torch.as_tensor(slots, dtype=torch.long, device=dev)
        rows = torch.as_tensor(last_rows, dtype=torch.long, device=dev)
        cos = self._cos[pos][:, None, :]  # [T, 1, D]
        sin = self._sin_rolled[pos][:, None, :]
        store = self.cache.store if checked else self.cache.write
        x = F.embedding(ids, w.embed)
        x = self._layers(x, cos, sin, slot_t, attn_plan, store)
        h = _rms_norm(x[rows], w.norm, cfg.rms_norm_eps)
        return w.lm_head(h).float()

    def _layers(self, x, cos, sin, slot_t, attn_plan, store) -> torch.Tensor:
        """Every decoder layer over the residual stream ``x`` [T, hidden], in place."""
        cfg = self.config
        n = x.shape[0]
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        half = d // 2
        for i, layer in enumerate(self.weights.layers):
            h = _rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
            qkv = layer.qkv(h)
            if layer.qkv_bias is not None:
                qkv = qkv + layer.qkv_bias
            # RoPE on the query and key heads together: one set of elementwise ops, not two
            qk = qkv[:, : (hq + hkv) * d].view(n, hq + hkv, d)
            qk = qk * cos + qk.roll(half, -1) * sin
            q, k = qk[:, :hq], qk[:, hq:]
            v = qkv[:, (hq + hkv) * d :].view(n, hkv, d)
            store(i, k, v, slot_t)
            attn = self.cache.attention_planned(i, q, attn_plan, self._scale)
            x += layer.o(attn.reshape(n, hq * d))
            h = _rms_norm(x, layer.post_norm, cfg.rms_norm_eps)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)
            x += layer.down(F.silu(gate) * up)
        return x
