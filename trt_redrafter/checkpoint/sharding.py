"""Tensor-parallel sharding of Llama-family (Llama, Qwen2, Qwen3) + drafter weights, by TensorRT-LLM's rules. Pure functions, no I/O.

TP is data: a `Mapping(tp_size, rank)` and functions from full tensors to the rank's slice (and back, for tests
and for tools that need full weights). The rules follow TensorRT-LLM's LLaMA converter (`load_weights_from_hf_model`
and the unified `ModelWeightsLoader`) and the ReDrafter converter's `hf_drafter`:

- column-parallel linears (qkv, mlp.fc, mlp.gate, lm_head, every drafter linear) split the output dim 0;
- row-parallel linears (attention.dense, mlp.proj) split the input dim 1;
- norms and the vocabulary embedding are replicated (no `use_parallel_embedding`);
- q, k and v (weights, and Qwen2's biases) are split separately and concatenated per rank `[q/tp ; k/tp ; v/tp]`; when num_kv_heads < tp each KV
  head is first repeated tp/num_kv_heads times in place (`dup_kv_weight`), so rank r holds kv head r*nkv//tp;
- the base lm_head is zero-padded to Vp = ceil(V/tp)*tp rows before its dim-0 split; the drafter lm_head is not
  padded (TensorRT-LLM splits it as is, so V % tp == 0 is required; see `check_tp`).

Names: HF -> TensorRT-LLM in `BASE_LAYER_MAP` / `BASE_GLOBAL_MAP` / `DRAFTER_MAP`, declared once and applied by one
generic function. Note TensorRT-LLM's GatedMLP naming: `fc` takes the activation (= HF gate_proj) and `gate` is the
multiplier (= HF up_proj).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping as TMapping, Optional

import torch

from ..config import DrafterConfig, ModelConfig
from ..errors import UserError

# split dim per TensorRT-LLM tensor; None = replicated on every rank
COLUMN, ROW, REPLICATED = 0, 1, None

# per decoder layer: (TensorRT-LLM suffix under transformer.layers.{i}., HF suffix under model.layers.{i}., dim)
BASE_LAYER_MAP: tuple[tuple[str, str, Optional[int]], ...] = (
    ("input_layernorm.weight", "input_layernorm.weight", REPLICATED),
    ("attention.dense.weight", "self_attn.o_proj.weight", ROW),
    ("post_layernorm.weight", "post_attention_layernorm.weight", REPLICATED),
    ("mlp.fc.weight", "mlp.gate_proj.weight", COLUMN),
    ("mlp.gate.weight", "mlp.up_proj.weight", COLUMN),
    ("mlp.proj.weight", "mlp.down_proj.weight", ROW),
)
QKV_NAME = "attention.qkv.weight"
QKV_HF = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
# Qwen2 (ModelConfig.attn_bias): q/k/v biases, fused and split per rank as the weight's rows
QKV_BIAS_NAME = "attention.qkv.bias"
QKV_BIAS_HF = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
# Qwen3 (ModelConfig.qk_layernorm): one RMSNorm gain per head dimension for q and one for k, replicated
QK_NORM_MAP: tuple[tuple[str, str, Optional[int]], ...] = (
    ("attention.q_layernorm.weight", "self_attn.q_norm.weight", REPLICATED),
    ("attention.k_layernorm.weight", "self_attn.k_norm.weight", REPLICATED),
)

# whole-model tensors other than lm_head (which is padded first, see `shard_base`)
BASE_GLOBAL_MAP: tuple[tuple[str, str, Optional[int]], ...] = (
    ("transformer.vocab_embedding.weight", "model.embed_tokens.weight", REPLICATED),
    ("transformer.ln_f.weight", "model.norm.weight", REPLICATED),
)
LM_HEAD = ("lm_head.weight", "lm_head.weight")

DRAFTER_PREFIX = "drafter."


@dataclass(frozen=True)
class Mapping:
    """Which slice of the model a rank holds (TensorRT-LLM's `Mapping`, TP only)."""

    tp_size: int = 1
    rank: int = 0

    def __post_init__(self):
        assert self.tp_size >= 1 and 0 <= self.rank < self.tp_size, (self.tp_size, self.rank)


# ---- elementary transforms ------------------------------------------------------------------------------------

def split(w: torch.Tensor, tp: int, rank: int, dim: Optional[int]) -> torch.Tensor:
    """The rank-th of tp equal contiguous chunks of w along dim (dim None: the whole tensor). Always a new tensor."""
    if dim is None or tp == 1:
        return w.clone().contiguous()
    assert w.shape[dim] % tp == 0, f"cannot split shape {tuple(w.shape)} on dim {dim} into {tp}"
    size = w.shape[dim] // tp
    return w.narrow(dim, rank * size, size).clone().contiguous()


def unsplit(shards: list[torch.Tensor], dim: Optional[int]) -> torch.Tensor:
    """Inverse of `split` over all ranks; replicated tensors must be identical on every rank."""
    if dim is None:
        for s in shards[1:]:
            assert torch.equal(s, shards[0]), "a replicated tensor differs between ranks"
        return shards[0]
    return torch.cat(shards, dim=dim)


def pad_vocab(w: torch.Tensor, tp: int) -> torch.Tensor:
    """[V, H] -> [Vp, H], zero rows appended so Vp is a multiple of tp (TensorRT-LLM's `pad_vocab_size`)."""
    vp = -(-w.shape[0] // tp) * tp
    if vp == w.shape[0]:
        return w
    return torch.cat([w, w.new_zeros(vp - w.shape[0], *w.shape[1:])], dim=0)


def dup_kv(w: torch.Tensor, num_kv_heads: int, tp: int) -> torch.Tensor:
    """[nkv*D, H] -> [tp*D, H]: each KV head repeated tp/nkv times consecutively (TensorRT-LLM `dup_kv_weight`)."""
    assert tp % num_kv_heads == 0, (tp, num_kv_heads)
    reps = tp // num_kv_heads
    d = w.shape[0] // num_kv_heads
    return w.reshape(num_kv_heads, 1, d, -1).expand(num_kv_heads, reps, d, w.shape[-1]).reshape(-1, w.shape[-1])


def undup_kv(w: torch.Tensor, num_kv_heads: int, tp: int) -> torch.Tensor:
    """Inverse of `dup_kv`, checking that the copies agree."""
    reps = tp // num_kv_heads
    d = w.shape[0] // tp
    heads = w.reshape(num_kv_heads, reps, d, -1)  # [nkv, reps, D, H]
    assert torch.equal(heads, heads[:, :1].expand_as(heads)), "duplicated kv heads differ"
    return heads[:, 0].reshape(num_kv_heads * d, -1)


def shard_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_kv_heads: int, m: Mapping) -> torch.Tensor:
    """q [nh*D, H], k/v [nkv*D, H] -> this rank's fused [(nh/tp + 2*max(nkv/tp, 1))*D, H]; biases ([nh*D],
    [nkv*D]) the same way, one value per row."""
    if q.dim() == 1:
        return shard_qkv(q[:, None], k[:, None], v[:, None], num_kv_heads, m)[:, 0].contiguous()
    if num_kv_heads < m.tp_size:
        k, v = dup_kv(k, num_kv_heads, m.tp_size), dup_kv(v, num_kv_heads, m.tp_size)
    return torch.cat([split(t, m.tp_size, m.rank, COLUMN) for t in (q, k, v)], dim=0).contiguous()


def unshard_qkv(shards: list[torch.Tensor], cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rebuild full q, k, v (weights, or biases) from every rank's fused qkv."""
    if shards[0].dim() == 1:
        return tuple(t[:, 0] for t in unshard_qkv([s[:, None] for s in shards], cfg))
    tp, d = len(shards), cfg.head_size
    nq = cfg.num_attention_heads // tp * d  # q rows per rank
    nkv = max(cfg.num_key_value_heads // tp, 1) * d  # k (and v) rows per rank
    for s in shards:
        assert s.shape[0] == nq + 2 * nkv, (tuple(s.shape), nq, nkv)
    q = torch.cat([s[:nq] for s in shards])
    k = torch.cat([s[nq:nq + nkv] for s in shards])
    v = torch.cat([s[nq + nkv:] for s in shards])
    if cfg.num_key_value_heads < tp:
        k, v = undup_kv(k, cfg.num_key_value_heads, tp), undup_kv(v, cfg.num_key_value_heads, tp)
    return q, k, v


# ---- whole-model tables ---------------------------------------------------------------------------------------

def base_name_table(cfg: ModelConfig) -> list[tuple[str, str, Optional[int]]]:
    """Every (TensorRT-LLM name, HF name, split dim) of the base model except the fused qkv and lm_head."""
    rows = list(BASE_GLOBAL_MAP)
    layer_map = BASE_LAYER_MAP + (QK_NORM_MAP if cfg.qk_layernorm else ())
    for i in range(cfg.num_hidden_layers):
        rows += [(f"transformer.layers.{i}.{t}", f"model.layers.{i}.{h}", dim) for t, h, dim in layer_map]
    return rows


def qkv_table(cfg: ModelConfig) -> list[tuple[str, tuple[str, str, str]]]:
    """(TensorRT-LLM suffix, HF q/k/v suffixes) of the fused q/k/v tensors of a layer: the weight, and the bias where
    the family has one."""
    return [(QKV_NAME, QKV_HF)] + ([(QKV_BIAS_NAME, QKV_BIAS_HF)] if cfg.attn_bias else [])


def base_hf_names(cfg: ModelConfig) -> list[str]:
    """HF tensor names the base conversion reads (lm_head may come from the embedding when tied)."""
    names = [h for _, h, _ in base_name_table(cfg)]
    names += [f"model.layers.{i}.{h}" for i in range(cfg.num_hidden_layers) for _, hs in qkv_table(cfg) for h in hs]
    return names


def shard_base(get: Callable[[str], torch.Tensor], cfg: ModelConfig, m: Mapping,
               cast: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    """One rank's TensorRT-LLM base tensors. `get(hf_name)` returns a full HF tensor (lm_head.weight resolved)."""
    out: dict[str, torch.Tensor] = {}
    for trt, hf, dim in base_name_table(cfg):
        out[trt] = cast(split(get(hf), m.tp_size, m.rank, dim))
    for i in range(cfg.num_hidden_layers):
        for trt, hfs in qkv_table(cfg):
            q, k, v = (get(f"model.layers.{i}.{h}") for h in hfs)
            out[f"transformer.layers.{i}.{trt}"] = cast(shard_qkv(q, k, v, cfg.num_key_value_heads, m))
    out[LM_HEAD[0]] = cast(split(pad_vocab(get(LM_HEAD[1]), m.tp_size), m.tp_size, m.rank, COLUMN))  # [Vp/tp, H]
    return out


def unshard_base(ranks: list[TMapping[str, torch.Tensor]], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Full HF-named base tensors rebuilt from every rank's TensorRT-LLM tensors (inverse of `shard_base`)."""
    full: dict[str, torch.Tensor] = {}
    for trt, hf, dim in base_name_table(cfg):
        full[hf] = unsplit([r[trt] for r in ranks], dim)
    for i in range(cfg.num_hidden_layers):
        for trt, hfs in qkv_table(cfg):
            q, k, v = unshard_qkv([r[f"transformer.layers.{i}.{trt}"] for r in ranks], cfg)
            for h, t in zip(hfs, (q, k, v)):
                full[f"model.layers.{i}.{h}"] = t
    lm = unsplit([r[LM_HEAD[0]] for r in ranks], COLUMN)  # [Vp, H]
    assert not lm[cfg.vocab_size:].any(), "vocab padding rows of lm_head are not zero"
    full[LM_HEAD[1]] = lm[:cfg.vocab_size]
    return full


DRAFT_VOCAB = "draft_vocab"  # FR-Spec draft vocabulary: int64 token ids, replicated on every rank, never cast


def drafter_name_table(d: DrafterConfig) -> list[tuple[str, str]]:
    """(TensorRT-LLM name, canonical Apple name) of every drafter weight; all split on dim 0. The draft
    vocabulary (`draft_vocab`, when the drafter has one) is not a weight and not in this table."""
    rows = []
    if d.has_input_proj:
        rows += [("input_proj.weight", "input_proj.weight"), ("input_proj.bias", "input_proj.bias")]
    for j in range(d.num_draft_layers):
        rows += [(f"layers.{j}.linear.{p}", f"lm_head.{j}.linear.{p}") for p in ("weight", "bias")]
    rows.append(("lm_head.weight", f"lm_head.{d.num_draft_layers}.weight"))
    if d.rnn:
        rows += [("rnn_u.weight", "rnn_u.weight"), ("rnn_u.bias", "rnn_u.bias"), ("rnn_w.weight", "rnn_w.weight")]
    return [(DRAFTER_PREFIX + t, a) for t, a in rows]


def shard_drafter(tensors: TMapping[str, torch.Tensor], d: DrafterConfig, m: Mapping,
                  cast: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    """One rank's `drafter.*` tensors: every weight split on dim 0 (ColumnLinear with gather_output), or whole for a
    replicated drafter; the draft vocabulary, if any, whole on every rank (the gathered head rows are in its order)."""
    tp = 1 if d.replicated else m.tp_size
    out = {trt: cast(split(tensors[apple], tp, 0 if d.replicated else m.rank, COLUMN))
           for trt, apple in drafter_name_table(d)}
    if d.draft_vocab_size:
        out[DRAFTER_PREFIX + DRAFT_VOCAB] = tensors[DRAFT_VOCAB].to(torch.int64).contiguous()
    return out


def unshard_drafter(ranks: list[TMapping[str, torch.Tensor]], d: DrafterConfig) -> dict[str, torch.Tensor]:
    """Canonical Apple-named drafter tensors rebuilt from every rank (inverse of `shard_drafter`)."""
    held = ranks[:1] if d.replicated else ranks  # a replicated drafter: rank 0 holds it whole
    out = {apple: unsplit([r[trt] for r in held], COLUMN) for trt, apple in drafter_name_table(d)}
    if d.draft_vocab_size:
        out[DRAFT_VOCAB] = ranks[0][DRAFTER_PREFIX + DRAFT_VOCAB]
    return out


# ---- what TP sizes a model admits -----------------------------------------------------------------------------

def drafter_needs(drafter: DrafterConfig) -> list[tuple[str, int, str]]:
    """The drafter dimensions a TP size must divide to split the drafter as TensorRT-LLM does."""
    return [
        ("drafter exit_dim", drafter.exit_dim, "every drafter ResBlock linear is split on its output dim"),
        ("drafter draft_vocab_size", drafter.draft_vocab_size, "the drafter lm_head is split without padding")
        if drafter.draft_vocab_size else
        ("drafter vocab_size", drafter.vocab_size, "TensorRT-LLM splits the drafter lm_head without padding it"),
        ("drafter hidden_size", drafter.hidden_size, "the drafter rnn_u/rnn_w split it"),
    ]


def drafter_splits(tp: int, drafter: DrafterConfig) -> bool:
    """Whether `tp` ranks can split the drafter (else `convert` replicates it on every rank)."""
    return all(value % tp == 0 for _, value, _ in drafter_needs(drafter))


def check_tp(tp: int, model: ModelConfig, drafter: DrafterConfig | None = None) -> None:
    """Raise UserError naming the first dimension that TensorRT-LLM cannot split tp ways, and why."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise UserError(f"--tp must be a positive integer, got {tp!r}.")
    if tp == 1:
        return
    needs = [
        ("num_attention_heads", model.num_attention_heads, "query heads are split across ranks"),
        ("hidden_size", model.hidden_size, "row-parallel attention.dense and the drafter rnn_u/rnn_w split it"),
        ("intermediate_size", model.intermediate_size, "mlp.fc/mlp.gate/mlp.proj split it"),
    ]
    if drafter is not None and not drafter.replicated:
        needs += drafter_needs(drafter)
    for what, value, why in needs:
        if value % tp:
            raise UserError(f"--tp {tp} does not divide {what}={value} ({why}); choose a TP size that divides it.")
    nkv = model.num_key_value_heads
    if nkv % tp and tp % nkv:
        raise UserError(f"--tp {tp} cannot shard num_key_value_heads={nkv}: TensorRT-LLM needs the kv heads to be "
                        f"divisible by tp or to divide tp (then it duplicates them); choose such a TP size.")
