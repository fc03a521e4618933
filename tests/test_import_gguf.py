"""import-gguf: a Llama (or Qwen2) GGUF written here with `gguf.GGUFWriter` comes out as a Hugging Face directory whose logits,
tokenizer and chat template match transformers reading the GGUF directly, and whose logits match the Llama the GGUF
was made from (so a missing rotary un-permutation or a dequantization slip fails); each refusal exits 2 and leaves
no output behind.

The GGUF is made from the tiny random pair's base (2 layers, H=64, 4 heads, 2 KV heads, byte-level BPE V=384) the
way llama.cpp's `convert_hf_to_gguf.py` does it: llama.cpp tensor names, attn_q/attn_k rows permuted, F32 data,
the BPE as `tokenizer.ggml.model = "gpt2"` with tokens, token types and merges.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from trt_redrafter.cli import main as cli
from trt_redrafter.errors import EXIT_USER_ERROR

gguf = pytest.importorskip("gguf", reason="import-gguf needs the `gguf` package: pip install 'trt-redrafter[gguf]'")

CHAT_TEMPLATE = ("{% for message in messages %}{{ '<s>' + message['role'] + '\n' + message['content'] + '</s>\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<s>assistant\n' }}{% endif %}")
# HF Llama module -> llama.cpp tensor name inside blk.N
LAYER_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
QWEN_CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
                      "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                      "{% endif %}")
IDS = [1, 17, 200, 5, 383, 42, 42, 260, 3, 99]  # arbitrary ids across the vocabulary, incl. specials
TEXT = "def convert(path): return {'ok': True}  # café, naïve\n\tdone"


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute` (convert_hf_to_gguf.py): HF's rotate-half rows -> GGML's interleaved rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(base: Path, path: Path, name: str = "tiny-llama", arch: str = "llama") -> Path:
    """The HF Llama directory `base` as an F32 GGUF; no `output.weight` when `base` ties its embeddings. `arch`
    qwen2: as llama.cpp's `Qwen2Model` writes a Qwen2 (q/k rows unpermuted, q/k/v biases, Qwen's pre-tokenizer,
    ChatML template)."""
    qwen = arch == "qwen2"
    cfg = json.loads((base / "config.json").read_text())
    tok = json.loads((base / "tokenizer.json").read_text())
    sd = {k: v.numpy() for k, v in load_file(base / "model.safetensors").items()}
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_rope_dimension_count(cfg.get("head_dim") or cfg["hidden_size"] // nh)
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])

    tokens = [t for t, _ in sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])]
    special = {a["id"] for a in tok["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if qwen else "default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(tokens))])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_unk_token_id(0)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_pad_token_id(cfg["pad_token_id"])
    w.add_add_bos_token(True)
    w.add_chat_template(QWEN_CHAT_TEMPLATE if qwen else CHAT_TEMPLATE)

    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg["num_hidden_layers"]):
        for hf_name, gguf_name in LAYER_NAMES.items():
            t = sd[f"model.layers.{i}.{hf_name}.weight"]  # [out, in] or [H]
            if gguf_name == "attn_q" and not qwen:
                t = _permute(t, nh)
            elif gguf_name == "attn_k" and not qwen:
                t = _permute(t, nkv)
            w.add_tensor(f"blk.{i}.{gguf_name}.weight", np.ascontiguousarray(t))
            if f"model.layers.{i}.{hf_name}.bias" in sd:
                w.add_tensor(f"blk.{i}.{gguf_name}.bias", sd[f"model.layers.{i}.{hf_name}.bias"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not cfg["tie_word_embeddings"]:
        w.add_tensor("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def ggufs(make_tiny_pair, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """{"untied"|"tied": (HF base it was made from, its GGUF)}; each GGUF sits alone in its directory."""
    out = {}
    for key, tie in (("untied", False), ("tied", True)):
        base = make_tiny_pair(tie_word_embeddings=tie) / "base"
        out[key] = (base, write_llama_gguf(base, tmp_path_factory.mktemp(f"gguf-{key}") / "tiny.gguf"))
    return out


def _logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]  # [T, V]


def _leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name == name or p.name.startswith(f".{name}."))


@pytest.mark.parametrize("key", ["untied", "tied"])
def test_import_matches_gguf_and_source(ggufs, tmp_path, key):
    from transformers import AutoModelForCausalLM

    base, path = ggufs[key]
    out = tmp_path / "hf"
    assert cli(["import-gguf", "--gguf", str(path), "--output", str(out)]) == 0
    assert (out / "config.json").is_file() and (out / "generation_config.json").is_file()
    assert any(out.glob("model*.safetensors")) and (out / "tokenizer.json").is_file()

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and "quantization_config" not in cfg
    assert cfg["tie_word_embeddings"] is (key == "tied")
    imported = AutoModelForCausalLM.from_pretrained(out).eval()
    direct = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    source = AutoModelForCausalLM.from_pretrained(base).eval()
    assert imported.dtype == torch.float32
    tied = imported.lm_head.weight.data_ptr() == imported.model.embed_tokens.weight.data_ptr()
    assert tied is (key == "tied")

    got = _logits(imported, IDS)  # [T, V]
    assert got.std(dim=-1).min() > 0.1  # not a degenerate model that would match anything
    torch.testing.assert_close(got, _logits(direct, IDS), rtol=0, atol=1e-6)
    # the GGUF was made from `source`: equal logits mean the q/k rows were un-permuted and nothing was rounded
    torch.testing.assert_close(got, _logits(source, IDS), rtol=1e-5, atol=1e-5)


def test_tokenizer_and_chat_template_round_trip(ggufs, tmp_path):
    from transformers import AutoTokenizer

    _, path = ggufs["untied"]
    out = tmp_path / "hf"
    assert cli(["import-gguf", "--gguf", str(path), "--output", str(out)]) == 0
    imported = AutoTokenizer.from_pretrained(out)
    direct = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)

    ids = imported(TEXT).input_ids
    assert ids == direct(TEXT).input_ids and len(ids) > 10
    assert imported.decode(ids, skip_special_tokens=True) == direct.decode(ids, skip_special_tokens=True) == TEXT
    assert (imported.bos_token, imported.eos_token, imported.pad_token) == ("<s>", "</s>", "<pad>")

    assert imported.chat_template == CHAT_TEMPLATE
    chat = [{"role": "user", "content": "hi there"}]
    text = imported.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == "<s>user\nhi there</s>\n<s>assistant\n"
    assert text == direct.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


def test_dtype_and_force(ggufs, tmp_path):
    from transformers import AutoModelForCausalLM

    _, path = ggufs["untied"]
    out = tmp_path / "hf"
    assert cli(["import-gguf", "--gguf", str(path), "--output", str(out), "--dtype", "float16"]) == 0
    assert json.loads((out / "config.json").read_text())["dtype"] == "float16"
    assert {t.dtype for t in load_file(next(out.glob("model*.safetensors"))).values()} == {torch.float16}

    assert cli(["import-gguf", "--gguf", str(path), "--output", str(out), "--force"]) == 0
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.float32
    assert _leftovers(tmp_path, "hf") == ["hf"]


def _refused(capsys, argv: list[str], *fragments: str) -> str:
    assert cli(argv) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err  # one line
    for f in fragments:
        assert f in err, (f, err)
    return err


def test_refusals(ggufs, tmp_path, capsys):
    _, good = ggufs["untied"]
    out = tmp_path / "hf"

    def argv(src: Path) -> list[str]:
        return ["import-gguf", "--gguf", str(src), "--output", str(out)]

    _refused(capsys, argv(tmp_path / "nope.gguf"), "nope.gguf", "does not exist")
    _refused(capsys, argv(tmp_path), "not a file")

    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"this is not a gguf file\n" * 40)
    _refused(capsys, argv(junk), "junk.gguf", "not a readable GGUF", "magic")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:300])  # cut inside the metadata
    _refused(capsys, argv(cut), "cut.gguf", "not a readable GGUF")

    other = write_llama_gguf(ggufs["untied"][0], tmp_path / "phi.gguf", arch="phi3")
    _refused(capsys, argv(other), "phi.gguf", "'phi3'", "general.architecture", "only llama, qwen2, qwen3")
    assert _leftovers(tmp_path, "hf") == []

    out.mkdir()
    (out / "keep.txt").write_text("mine")
    _refused(capsys, argv(good), str(out), "already exists", "--force")
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and _leftovers(tmp_path, "hf") == ["hf"]


def test_a_qwen2_gguf_imports_as_qwen2_and_converts_to_a_qwen_engine(make_tiny_pair, tmp_path):
    """A Qwen2 GGUF (biases, unpermuted q/k rows, Qwen's pre-tokenizer and ChatML template): the imported directory
    is a Qwen2 whose logits equal transformers reading the GGUF and the model it was made from, with the template,
    and `convert` takes it as a ReDrafterForQWenLM base."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pair = make_tiny_pair(family="qwen2")
    (tmp_path / "g").mkdir()  # the GGUF alone in its directory
    path = write_llama_gguf(pair / "base", tmp_path / "g" / "tiny-qwen2.gguf", name="tiny-qwen2", arch="qwen2")
    out = tmp_path / "hf"
    assert cli(["import-gguf", "--gguf", str(path), "--output", str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["architectures"] == ["Qwen2ForCausalLM"]
    imported = AutoModelForCausalLM.from_pretrained(out).eval()
    direct = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    source = AutoModelForCausalLM.from_pretrained(pair / "base").eval()
    got = _logits(imported, IDS)
    assert got.std(dim=-1).min() > 0.1
    torch.testing.assert_close(got, _logits(direct, IDS), rtol=0, atol=1e-6)
    torch.testing.assert_close(got, _logits(source, IDS), rtol=1e-5, atol=1e-5)  # biases and rows as the source's
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == QWEN_CHAT_TEMPLATE
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok(TEXT).input_ids == AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)(TEXT).input_ids
    assert cli(["convert", "--base-model", str(out), "--drafter", str(pair / "drafter"), "--output",
                str(tmp_path / "ck"), "--dtype", "float32"]) == 0
    assert json.loads((tmp_path / "ck" / "config.json").read_text())["architecture"] == "ReDrafterForQWenLM"
