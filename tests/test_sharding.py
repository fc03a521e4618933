"""Pure TP transforms against hand-computed goldens and TensorRT-LLM's own formulas."""

from __future__ import annotations

import pytest
import torch

from trt_redrafter.checkpoint import sharding as sh
from trt_redrafter.config import DrafterConfig, ModelConfig
from trt_redrafter.errors import UserError


def model_cfg(**kw) -> ModelConfig:
    d = dict(vocab_size=10, hidden_size=8, intermediate_size=12, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, dtype="float32")
    return ModelConfig(**{**d, **kw})


def test_split_is_contiguous_chunks():
    w = torch.arange(24.0).reshape(4, 6)
    assert torch.equal(sh.split(w, 2, 1, 0), w[2:])
    col = sh.split(w, 3, 2, 1)
    assert torch.equal(col, w[:, 4:]) and col.is_contiguous()
    assert torch.equal(sh.unsplit([sh.split(w, 3, r, 1) for r in range(3)], 1), w)
    rep = sh.split(w, 4, 3, None)
    assert torch.equal(rep, w) and rep.data_ptr() != w.data_ptr()


def test_dup_kv_repeats_each_head_in_place():
    k = torch.tensor([[0.0], [1.0], [2.0], [3.0]])  # 2 heads of size 2: rows (0,1) and (2,3)
    assert sh.dup_kv(k, 2, 4).flatten().tolist() == [0, 1, 0, 1, 2, 3, 2, 3]
    assert torch.equal(sh.undup_kv(sh.dup_kv(k, 2, 4), 2, 4), k)


def test_shard_qkv_golden_gqa():
    """4 q heads, 1 kv head, D=1, tp=2: each rank gets 2 q rows and the single (duplicated) k and v row."""
    q, k, v = torch.tensor([[0.0], [1.0], [2.0], [3.0]]), torch.tensor([[10.0]]), torch.tensor([[20.0]])
    r0 = sh.shard_qkv(q, k, v, 1, sh.Mapping(2, 0)).flatten().tolist()
    r1 = sh.shard_qkv(q, k, v, 1, sh.Mapping(2, 1)).flatten().tolist()
    assert (r0, r1) == ([0, 1, 10, 20], [2, 3, 10, 20])


def test_mha_matches_trtllm_split_qkv_tp():
    """For MHA TensorRT-LLM uses split_qkv_tp: view [3, H, H], split dim 1, reshape — same bytes as ours."""
    h, tp = 8, 4
    qkv = torch.randn(3 * h, h)
    for r in range(tp):
        theirs = qkv.reshape(3, h, h).chunk(tp, dim=1)[r].reshape(3 * h // tp, h)
        ours = sh.shard_qkv(qkv[:h], qkv[h:2 * h], qkv[2 * h:], 4, sh.Mapping(tp, r))
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("nh,nkv,tp", [(4, 4, 2), (4, 2, 4), (4, 1, 4), (8, 2, 2), (8, 4, 8), (4, 2, 1)])
def test_qkv_roundtrip(nh, nkv, tp):
    cfg = model_cfg(hidden_size=nh * 2, num_attention_heads=nh, num_key_value_heads=nkv)
    d = cfg.head_size
    q = torch.randn(nh * d, cfg.hidden_size)  # [nh*D, H]
    k, v = torch.randn(nkv * d, cfg.hidden_size), torch.randn(nkv * d, cfg.hidden_size)  # [nkv*D, H]
    shards = [sh.shard_qkv(q, k, v, nkv, sh.Mapping(tp, r)) for r in range(tp)]
    assert all(s.shape == ((nh // tp + 2 * max(nkv // tp, 1)) * d, cfg.hidden_size) for s in shards)
    q2, k2, v2 = sh.unshard_qkv(shards, cfg)
    assert torch.equal(q2, q) and torch.equal(k2, k) and torch.equal(v2, v)


def test_lm_head_zero_padding_roundtrip():
    cfg = model_cfg(vocab_size=10)
    assert cfg.num_hidden_layers == 1
    table = {n: torch.randn(8, 8) for _, n, _ in sh.base_name_table(cfg)}  # o_proj [H, H]; others replaced below
    table.update({n: torch.randn(s, 8) for n, s in zip([f"model.layers.0.{h}" for h in sh.QKV_HF], (8, 4, 4))})
    table["model.layers.0.mlp.gate_proj.weight"] = torch.randn(12, 8)
    table["model.layers.0.mlp.up_proj.weight"] = torch.randn(12, 8)
    table["model.layers.0.mlp.down_proj.weight"] = torch.randn(8, 12)
    table["model.embed_tokens.weight"] = torch.randn(10, 8)
    table["model.layers.0.input_layernorm.weight"] = table["model.norm.weight"] = torch.randn(8)
    table["model.layers.0.post_attention_layernorm.weight"] = torch.randn(8)
    table["lm_head.weight"] = torch.randn(10, 8)
    ranks = [sh.shard_base(table.__getitem__, cfg, sh.Mapping(4, r), lambda t: t) for r in range(4)]
    assert ranks[3]["lm_head.weight"].shape == (3, 8)  # Vp = 12
    assert torch.equal(ranks[3]["lm_head.weight"][1:], torch.zeros(2, 8))  # rows 10, 11 are zero padding
    assert torch.equal(ranks[0]["transformer.layers.0.mlp.fc.weight"], table["model.layers.0.mlp.gate_proj.weight"][:3])
    assert torch.equal(ranks[0]["transformer.layers.0.mlp.gate.weight"], table["model.layers.0.mlp.up_proj.weight"][:3])
    full = sh.unshard_base(ranks, cfg)
    assert all(torch.equal(full[n], t) for n, t in table.items())


def test_drafter_table_names():
    d = DrafterConfig(vocab_size=10, hidden_size=8, exit_dim=12, num_draft_layers=2, rnn=True)
    names = [t for t, _ in sh.drafter_name_table(d)]
    assert names == ["drafter.input_proj.weight", "drafter.input_proj.bias", "drafter.layers.0.linear.weight",
                     "drafter.layers.0.linear.bias", "drafter.layers.1.linear.weight", "drafter.layers.1.linear.bias",
                     "drafter.lm_head.weight", "drafter.rnn_u.weight", "drafter.rnn_u.bias", "drafter.rnn_w.weight"]
    assert [a for _, a in sh.drafter_name_table(d)][6] == "lm_head.2.weight"


@pytest.mark.parametrize("kw,tp,needle", [
    ({"num_attention_heads": 4}, 3, "num_attention_heads=4"),
    ({"hidden_size": 12, "num_attention_heads": 4, "head_size": 4}, 8, "num_attention_heads=4"),
    ({"intermediate_size": 10}, 4, "intermediate_size=10"),
    ({"num_attention_heads": 12, "hidden_size": 24, "num_key_value_heads": 6}, 4, "num_key_value_heads=6"),
])
def test_check_tp_refuses(kw, tp, needle):
    with pytest.raises(UserError, match=needle):
        sh.check_tp(tp, model_cfg(**kw))


def test_check_tp_hidden_and_drafter():
    # an explicit head_dim lets hidden_size differ from heads * head_size, so it is checked on its own
    with pytest.raises(UserError, match="hidden_size=10"):
        sh.check_tp(4, model_cfg(hidden_size=10, num_attention_heads=4, head_size=4), None)
    d = DrafterConfig(vocab_size=10, hidden_size=8, exit_dim=16, num_draft_layers=1)
    with pytest.raises(UserError, match="drafter vocab_size=10"):
        sh.check_tp(4, model_cfg(vocab_size=10, intermediate_size=16), d)
    sh.check_tp(2, model_cfg(intermediate_size=16), d)  # admissible: no error
    sh.check_tp(4, model_cfg(num_key_value_heads=1, intermediate_size=16))  # kv heads duplicated
