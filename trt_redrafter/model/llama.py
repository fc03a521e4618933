"""Llama decoder, one tensor-parallel rank of it, loaded from TensorRT-LLM checkpoint tensors.

TP layout (TensorRT-LLM's, so rank files load without re-sharding):
    attention.qkv   column-parallel: this rank's q heads, then its k and v heads      [(nh/tp + 2*nkv_r) * D, H]
    attention.dense row-parallel + all-reduce                                         [H, nh/tp * D]
    mlp.fc (gate_proj, activated), mlp.gate (up_proj)  column-parallel               [I/tp, H]
    mlp.proj        row-parallel + all-reduce                                         [H, I/tp]
    lm_head         vocab-parallel + all-gather, padding rows dropped                 [Vp/tp, H]
nkv_r = nkv/tp k/v heads per rank, or 1 (duplicated) when nkv < tp.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..rope import RotaryEmbedding
from ..runtime.distributed import Dist
from ..runtime.kv_cache import PagedKVCache
from .attention import AttentionBatch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm, computed in float32 as Hugging Face does."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


class LlamaRank:
    """Inference-only Llama shard. `forward` maps flat tokens to final-norm hidden states."""

    def __init__(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor], dist: Dist, dtype: torch.dtype,
                 max_seq_len: int):
        tp = dist.world_size
        self.cfg, self.dist, self.dtype = cfg, dist, dtype
        self.D = cfg.head_size
        self.nh = cfg.num_attention_heads // tp
        self.nkv = max(cfg.num_key_value_heads // tp, 1)
        self.vocab_size = cfg.vocab_size
        dev = dist.device

        def take(name: str) -> torch.Tensor:
            return tensors[name].to(device=dev, dtype=dtype).contiguous()

        self.embedding = take("transformer.vocab_embedding.weight")  # [V, H] (replicated)
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"transformer.layers.{i}."
            layer = {
                "ln1": take(p + "input_layernorm.weight"),
                "qkv": take(p + "attention.qkv.weight"),
                "dense": take(p + "attention.dense.weight"),
                "ln2": take(p + "post_layernorm.weight"),
                # fc = gate_proj (activated), gate = up_proj; fused into one column-parallel matmul
                "fc_gate": torch.cat([take(p + "mlp.fc.weight"), take(p + "mlp.gate.weight")], dim=0),
                "proj": take(p + "mlp.proj.weight"),
            }
            exp_qkv = (self.nh + 2 * self.nkv) * self.D
            assert layer["qkv"].shape[0] == exp_qkv, (i, tuple(layer["qkv"].shape), exp_qkv)
            self.layers.append(layer)
        self.ln_f = take("transformer.ln_f.weight")
        lm = tensors.get("lm_head.weight")
        self.lm_head = take("lm_head.weight") if lm is not None else self.embedding  # [Vp/tp, H]
        self.rope = RotaryEmbedding(self.D, cfg.rotary_base, cfg.rotary_scaling, cfg.max_position_embeddings,
                                    max(max_seq_len, cfg.max_position_embeddings) + 1, device=dev, dtype=dtype)
        self.scale = self.D ** -0.5

    # ---- pieces -----------------------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embedding)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [M, H] (final-norm) -> float32 logits [M, V] over the whole vocabulary."""
        local = F.linear(hidden, self.lm_head).float()  # [M, Vp/tp]
        return self.dist.all_gather(local, dim=-1)[:, :self.vocab_size]

    def _attention(self, x: torch.Tensor, layer: dict, li: int, batch: AttentionBatch,
                   cache: PagedKVCache) -> torch.Tensor:
        N = x.shape[0]
        qkv = F.linear(x, layer["qkv"])  # [N, (nh + 2 nkv) D]
        q, k, v = qkv.split([self.nh * self.D, self.nkv * self.D, self.nkv * self.D], dim=-1)
        q = self.rope.apply(q.view(N, self.nh, self.D), batch.positions)  # [N, nh, D]
        k = self.rope.apply(k.view(N, self.nkv, self.D), batch.positions)  # [N, nkv, D]
        cache.k[li, batch.write_slots] = k
        cache.v[li, batch.write_slots] = v.view(N, self.nkv, self.D)
        keys = cache.k[li][batch.kv_slots].transpose(1, 2)  # [bs, nkv, S, D]
        vals = cache.v[li][batch.kv_slots].transpose(1, 2)
        qp = q[batch.q_index].transpose(1, 2)  # [bs, nh, T, D]
        out = F.scaled_dot_product_attention(qp, keys, vals, attn_mask=batch.mask, scale=self.scale,
                                             enable_gqa=self.nh != self.nkv)  # [bs, nh, T, D]
        bs, _, T, _ = out.shape
        out = out.transpose(1, 2).reshape(bs * T, self.nh * self.D)[batch.unpad_index]  # [N, nh*D]
        return self.dist.all_reduce(F.linear(out, layer["dense"]))

    def _mlp(self, x: torch.Tensor, layer: dict) -> torch.Tensor:
        gate, up = F.linear(x, layer["fc_gate"]).chunk(2, dim=-1)  # [N, I/tp] each
        return self.dist.all_reduce(F.linear(F.silu(gate) * up, layer["proj"]))

    # ---- forward ----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, batch: AttentionBatch, cache: PagedKVCache) -> torch.Tensor:
        """ids [N] flat tokens of the step -> final-norm hidden states [N, H]."""
        eps = self.cfg.norm_epsilon
        x = self.embed(ids)  # [N, H]
        for li, layer in enumerate(self.layers):
            x = x + self._attention(rms_norm(x, layer["ln1"], eps), layer, li, batch, cache)
            x = x + self._mlp(rms_norm(x, layer["ln2"], eps), layer)
        return rms_norm(x, self.ln_f, eps)
