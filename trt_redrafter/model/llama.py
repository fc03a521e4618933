"""Llama decoder, one tensor-parallel rank of it, loaded from TensorRT-LLM checkpoint tensors. Qwen2 and Qwen3 are
this decoder with q/k/v biases (`attn_bias`) or per-head q/k RMSNorms (`qk_layernorm`), families.py.

TP layout (TensorRT-LLM's, so rank files load without re-sharding):
    attention.qkv   column-parallel: this rank's q heads, then its k and v heads      [(nh/tp + 2*nkv_r) * D, H]
    attention.dense row-parallel + all-reduce                                         [H, nh/tp * D]
    mlp.fc (gate_proj, activated), mlp.gate (up_proj)  column-parallel               [I/tp, H]
    mlp.proj        row-parallel + all-reduce                                         [H, I/tp]
    lm_head         vocab-parallel + all-gather, padding rows dropped                 [Vp/tp, H]
nkv_r = nkv/tp k/v heads per rank, or 1 (duplicated) when nkv < tp.

A step feeds [bs, T] tokens (static shapes; see `attention.AttentionMeta`); the model computes on the flat
[bs*T, H] rows and knows nothing about requests, trees or sampling. Every matmul is a `linear.Linear`: `F.linear`,
or on the CPU a oneDNN GEMM over weights prepacked at load (RuntimeConfig.linear).
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..checkpoint.quantization import (Quantization, channel_amax, quantize_per_channel, read_awq, read_fp8,
                                       refuse_preprocessed, require_torch_runs)
from ..config import ModelConfig, torch_dtype
from ..rope import RotaryEmbedding
from .attention import AttentionMeta, torch_tree_attention
from .linear import Fp8Weight, Linear, QuantWeight
from .tp import Dist

# (q [bs, T, nh, D], k_cache, v_cache [slots, kvh, D], meta, scale) -> [bs, T, nh, D]
AttentionImpl = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMeta, float], torch.Tensor]
# what every layer rotates with: (row of each new token [N] long, cos [rows, D], sin [rows, D])
RopeRows = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm, computed in float32 as Hugging Face does."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class TorchLayerOps:
    """The decoder layer's elementwise pieces in PyTorch (CPU, and the oracles of `plugins.fused`)."""

    @staticmethod
    def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (residual + delta, rms_norm(residual + delta) * weight); [N, H] each."""
        if delta is not None:
            residual = residual + delta
        return residual, rms_norm(residual, weight, eps)

    @staticmethod
    def rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, nh: int,
                      nkv: int, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """qkv [N, (nh + 2 nkv) D] -> rotated q [N, nh, D]; rotated k and v stored at cache rows `slots` [N]."""
        N = qkv.shape[0]
        D = k_cache.shape[-1]
        q, k, v = qkv.split([nh * D, nkv * D, nkv * D], dim=-1)
        q = apply_rope(q.view(N, nh, D), positions, cos, sin)
        k = apply_rope(k.view(N, nkv, D), positions, cos, sin)
        k_cache.index_put_((slots,), k)  # in place on the cache tensor itself (see runtime/kv_cache.py)
        v_cache.index_put_((slots,), v.reshape(N, nkv, D))
        return q

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)  # [N, I/tp] each
        return F.silu(gate) * up


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D], positions [N] -> rotated x (GPT-NeoX layout, Hugging Face's rounding order)."""
    c, s = cos.index_select(0, positions).unsqueeze(1), sin.index_select(0, positions).unsqueeze(1)  # [N, 1, D]
    half = x.shape[-1] // 2
    return x * c + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * s


Weight = Union[torch.Tensor, QuantWeight, Fp8Weight]


class Attention(nn.Module):
    def __init__(self, qkv: Weight, dense: Weight, nh: int, nkv: int, head_size: int, dist: Dist,
                 linear: str = "torch", qkv_bias: Optional[torch.Tensor] = None,
                 qk_norm: Optional[tuple[torch.Tensor, torch.Tensor, float]] = None):
        """`qkv_bias` [(nh + 2 nkv) D] (Qwen2); `qk_norm` (q gain [D], k gain [D], eps): each head of q and of k
        RMS-normalized before RoPE (Qwen3)."""
        super().__init__()
        self.qkv = Linear(qkv, qkv_bias, impl=linear)  # [(nh + 2 nkv) D, H]
        self.dense = Linear(dense, impl=linear)  # [H, nh D]
        self.nh, self.nkv, self.D, self.dist = nh, nkv, head_size, dist
        self.scale = head_size ** -0.5
        self.q_norm = self.k_norm = None
        if qk_norm is not None:
            self.q_norm, self.k_norm = _frozen(qk_norm[0]), _frozen(qk_norm[1])
            self.qk_eps = qk_norm[2]

    def _norm_qk(self, qkv: torch.Tensor) -> torch.Tensor:
        """[N, (nh + 2 nkv) D] -> the same with every q and k head RMS-normalized (Hugging Face's Qwen3 order: norm,
        then RoPE)."""
        N, D = qkv.shape[0], self.D
        q, k, v = qkv.split([self.nh * D, self.nkv * D, self.nkv * D], dim=-1)
        q = rms_norm(q.reshape(N, self.nh, D), self.q_norm, self.qk_eps).reshape(N, self.nh * D)
        k = rms_norm(k.reshape(N, self.nkv, D), self.k_norm, self.qk_eps).reshape(N, self.nkv * D)
        return torch.cat([q, k, v], dim=-1)

    def forward(self, x: torch.Tensor, layer: int, meta: AttentionMeta, kv: tuple[list[torch.Tensor], list[torch.Tensor]],
                rope: RopeRows, impl: AttentionImpl, ops) -> torch.Tensor:
        bs, T = meta.positions.shape
        N = bs * T
        k_cache, v_cache = kv[0][layer], kv[1][layer]  # [slots, nkv, D]
        rows, cos, sin = rope
        qkv = self.qkv(x)
        if self.q_norm is not None:
            qkv = self._norm_qk(qkv)
        q = ops.rope_write_kv(qkv, rows, cos, sin, self.nh, self.nkv, k_cache, v_cache,
                              meta.write_slots.reshape(N))  # [N, nh, D]
        out = impl(q.view(bs, T, self.nh, self.D), k_cache, v_cache, meta, self.scale)  # [bs, T, nh, D]
        return self.dist.all_reduce(self.dense(out.reshape(N, self.nh * self.D)))


class MLP(nn.Module):
    def __init__(self, fc_gate: Weight, proj: Weight, dist: Dist, linear: str = "torch"):
        super().__init__()
        self.fc_gate = Linear(fc_gate, impl=linear)  # [2 I/tp, H]: gate_proj rows, then up_proj rows (one matmul)
        self.proj = Linear(proj, impl=linear)  # [H, I/tp]
        self.dist = dist

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        return self.dist.all_reduce(self.proj(ops.silu_mul(self.fc_gate(x))))


class DecoderLayer(nn.Module):
    def __init__(self, ln1: torch.Tensor, attn: Attention, ln2: torch.Tensor, mlp: MLP, eps: float):
        super().__init__()
        self.ln1, self.ln2 = _frozen(ln1), _frozen(ln2)
        self.attn, self.mlp, self.eps = attn, mlp, eps

    def forward(self, residual: torch.Tensor, h: torch.Tensor, layer: int, meta: AttentionMeta, kv,
                rope: RopeRows, impl, ops, next_norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h = ln1(residual) on entry -> (residual after attention and MLP, next_norm(residual)): each residual add
        is fused with the norm that follows it (same roundings as add-then-norm)."""
        residual, h = ops.add_rms_norm(residual, self.attn(h, layer, meta, kv, rope, impl, ops), self.ln2, self.eps)
        return ops.add_rms_norm(residual, self.mlp(h, ops), next_norm, self.eps)


class LlamaRank(nn.Module):
    """Inference-only Llama shard. `forward` maps [bs, T] tokens to final-norm hidden states [bs, T, H].

    `linear`: the linear layers' implementation, "torch", "onednn" or "avx512" (`linear.resolve_linear`).
    `quant`: the checkpoint's quantization (checkpoint/quantization.py). Weight-only W8A16/W4A16 layers are quantized
    here, from the rank's float weights, as TensorRT-LLM's build quantizes them; a row-parallel layer's scales come
    from the whole row (all ranks), so the quantized model does not depend on TP. W4A16_AWQ and FP8 layers are read
    as stored (their scales were taken over the whole layer when the checkpoint was written)."""

    def __init__(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor], dist: Dist, dtype: torch.dtype,
                 max_seq_len: int, linear: str = "torch", quant: Optional[Quantization] = None):
        super().__init__()
        tp = dist.world_size
        self.cfg, self.dist, self.dtype = cfg, dist, dtype
        self.D = cfg.head_size
        self.nh = cfg.num_attention_heads // tp
        self.nkv = max(cfg.num_key_value_heads // tp, 1)
        self.vocab_size = cfg.vocab_size
        dev = dist.device
        require_torch_runs(quant, "engine config.json pretrained_config")

        def take(name: str) -> torch.Tensor:
            return tensors[name].to(device=dev, dtype=dtype).contiguous()

        def weight(module: str, row_parallel: bool = False, source: Optional[str] = None) -> Weight:
            """A linear layer's weight [out, in]: float, or quantized when `quant` names the module."""
            name = source or module + ".weight"
            if quant is None or not quant.quantizes(module):
                return take(name)
            if quant.fp8:  # e4m3 weights and per-tensor scales, as stored
                w8, scale, input_scale = read_fp8(tensors, module, "engine weights")
                return Fp8Weight(w8.to(dev), scale.to(dev), input_scale.to(dev), dtype)
            if quant.stored_quantized:  # W4A16_AWQ: int4 pairs and per-group scales, as stored
                q, scales, pre = read_awq(tensors, module, quant.group_size, "engine weights")
                return QuantWeight(q.to(dev), scales.to(dev), quant.bits, quant.group_size, dtype,
                                   None if pre is None else pre.to(dev))
            refuse_preprocessed(tensors, name, "engine weights")
            w = tensors[name]
            amax = channel_amax(w)
            if row_parallel:  # the rank holds a slice of each row: the row's amax is the max over ranks
                amax = dist.all_reduce_max(amax.to(dev)).cpu()
            q, s = quantize_per_channel(w, quant.bits, torch_dtype(cfg.dtype), amax)
            return QuantWeight(q.to(dev), s.to(dev), quant.bits, w.shape[1], dtype)

        def cat(parts: list[Weight]) -> Weight:
            kind = type(parts[0])
            return kind.cat(parts) if kind in (QuantWeight, Fp8Weight) else torch.cat(parts, dim=0)

        self.embedding = _frozen(take("transformer.vocab_embedding.weight"))  # [V, H] (replicated)
        layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"transformer.layers.{i}."
            qkv = weight(p + "attention.qkv")
            exp_qkv = (self.nh + 2 * self.nkv) * self.D
            assert qkv.shape[0] == exp_qkv, (i, tuple(qkv.shape), exp_qkv)
            # fc = gate_proj (activated), gate = up_proj; fused into one column-parallel matmul
            fc_gate = cat([weight(p + "mlp.fc"), weight(p + "mlp.gate")])
            layers.append(DecoderLayer(
                take(p + "input_layernorm.weight"),
                Attention(qkv, weight(p + "attention.dense", row_parallel=True), self.nh, self.nkv, self.D, dist,
                          linear, take(p + "attention.qkv.bias") if cfg.attn_bias else None,
                          (take(p + "attention.q_layernorm.weight"), take(p + "attention.k_layernorm.weight"),
                           cfg.norm_epsilon) if cfg.qk_layernorm else None),
                take(p + "post_layernorm.weight"),
                MLP(fc_gate, weight(p + "mlp.proj", row_parallel=True), dist, linear),
                cfg.norm_epsilon))
        self.layers = nn.ModuleList(layers)
        self.ln_f = _frozen(take("transformer.ln_f.weight"))
        tied = "lm_head.weight" not in tensors and "lm_head.weights_scaling_factor" not in tensors
        if quant is not None and quant.quantizes("lm_head"):
            lm_head = weight("lm_head", source="transformer.vocab_embedding.weight" if tied else None)
        else:  # tied: the embedding Parameter itself, or (onednn, avx512) a packed copy beside the lookup table
            lm_head = self.embedding if tied else take("lm_head.weight")
        self.lm_head = Linear(lm_head, impl=linear)  # [Vp/tp, H]
        self.rope = RotaryEmbedding(self.D, cfg.rotary_base, cfg.rotary_scaling, cfg.max_position_embeddings,
                                    max(max_seq_len, cfg.max_position_embeddings) + 1, device=dev, dtype=dtype)
        self.attention_impl: AttentionImpl = torch_tree_attention
        self.ops = TorchLayerOps  # or plugins.fused (CUDA): same contracts

    # ---- pieces -----------------------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embedding)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] (final-norm) -> logits [..., V] over the whole vocabulary, in the model dtype.

        Hugging Face computes logits in the model dtype too (then upcasts), so argmax here is argmax there.
        """
        local = self.lm_head(hidden)  # [..., Vp/tp]
        return self.dist.all_gather(local, dim=-1)[..., :self.vocab_size]

    def rope_rows(self, meta: AttentionMeta) -> RopeRows:
        """What the layers rotate this step's tokens with: the table rows at their positions, or in a prompt step of
        a dynamic-NTK model the per-token rows `RotaryEmbedding.prompt_rows` computes (built once per step)."""
        positions = meta.positions.reshape(-1)  # [N]
        if meta.prompt_len is not None and self.rope.dynamic:
            cos, sin = self.rope.prompt_rows(meta.positions, meta.prompt_len)  # [N, D] each
            return torch.arange(positions.shape[0], device=positions.device), cos, sin
        return positions, self.rope.cos, self.rope.sin

    # ---- forward ----------------------------------------------------------------------------------------
    def forward(self, ids: torch.Tensor, meta: AttentionMeta, kv: tuple[list[torch.Tensor], list[torch.Tensor]]
                ) -> torch.Tensor:
        """ids [bs, T] -> final-norm hidden states [bs, T, H]; writes the new tokens' K/V into `kv` (per-layer
        [num_slots, kvh, D] tensors)."""
        bs, T = ids.shape
        if self.attention_impl is torch_tree_attention:
            meta = meta.for_torch()
        eps = self.cfg.norm_epsilon
        rope = self.rope_rows(meta)
        residual, h = self.ops.add_rms_norm(self.embed(ids.reshape(bs * T)), None, self.layers[0].ln1, eps)  # [N, H]
        for li, layer in enumerate(self.layers):
            nxt = self.layers[li + 1].ln1 if li + 1 < len(self.layers) else self.ln_f
            residual, h = layer(residual, h, li, meta, kv, rope, self.attention_impl, self.ops, nxt)
        return h.view(bs, T, -1)
