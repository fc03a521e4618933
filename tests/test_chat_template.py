"""A user message becomes the model's own chat prompt (trt_redrafter/chat.py): the tokenizer's chat template when it
has one, else FastChat's Vicuna v1.1. Checked where it is used: `run --chat` (its prompt ids, and through the real
CLI on a tiny engine), bench's prompts (`auto` with and without a template), bench-engine's, and the
preprocessing model's code as make-repo copies it (imported without torch). The preprocessing model inside a real
tritonserver, with `generate --chat`, is tested in test_serving.py.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine_utils import write_chat_tokenizer, write_qwen_tokenizer
from trt_redrafter.bench.engine_bench import encode_prompts
from trt_redrafter.bench.harness import BenchConfig, Target, run_point, sweep_tokenizer
from trt_redrafter.bench.schedule import Prompt, applied_template, load_prompts, resolve_chat_template
from trt_redrafter.chat import chat_prompt_ids, vicuna_prompt
from trt_redrafter.cli import main as cli
from trt_redrafter.prompt_args import load_prompts as run_prompts
from trt_redrafter.errors import UserError
from trt_redrafter.serving.repo import PACKAGE_ROOT, TEXT_MODULES
from trt_redrafter.serving.text import TextCodec, load_tokenizer

MSG = "Name three prime numbers."
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def plain_dir(tiny_pair) -> Path:
    return tiny_pair / "base"  # the tiny byte-level BPE tokenizer: adds BOS, no chat template


@pytest.fixture(scope="module")
def chat_dir(plain_dir, tmp_path_factory) -> Path:
    return write_chat_tokenizer(plain_dir, tmp_path_factory.mktemp("chat") / "tokenizer")


def hf_chat_ids(tok, user: str) -> list[int]:
    """Hugging Face's own answer: what a chat prompt must be token for token."""
    return list(tok.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False))


def test_a_template_that_writes_bos_gets_exactly_one_bos(chat_dir):
    tok = load_tokenizer(chat_dir)
    ids = chat_prompt_ids(tok, MSG)
    assert ids == hf_chat_ids(tok, MSG)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    text = tok.apply_chat_template([{"role": "user", "content": MSG}], add_generation_prompt=True, tokenize=False)
    assert text.startswith(tok.bos_token + "[INST] ")
    assert tok.encode(text)[:2] == [tok.bos_token_id] * 2  # the trap: encoding the text adds a second BOS
    assert TextCodec(chat_dir).encode(MSG, chat=True) == ids  # what the preprocessing model sends the engine
    assert TextCodec(chat_dir).encode(MSG) == tok.encode(MSG)  # without the flag: plain text, as before


def test_a_tokenizer_without_template_gets_vicuna(plain_dir):
    tok = load_tokenizer(plain_dir)
    assert not tok.chat_template
    ids = chat_prompt_ids(tok, MSG)
    assert ids == tok.encode(vicuna_prompt(MSG))
    assert tok.decode(ids, skip_special_tokens=True).startswith("A chat between a curious user")
    assert TextCodec(plain_dir).encode(MSG, chat=True) == ids


def test_a_broken_template_is_a_user_error(plain_dir, tmp_path):
    tok = load_tokenizer(write_chat_tokenizer(plain_dir, tmp_path / "tok", "{{ raise_exception('no users') }}"))
    with pytest.raises(UserError, match="chat template failed.*no users"):
        chat_prompt_ids(tok, MSG)


def _run_args(tokenizer: Path, chat: bool = True, **kw) -> argparse.Namespace:
    base = {"engine": "unused", "tokenizer": str(tokenizer), "prompt": [MSG, "2+2="], "prompt_ids": None, "chat": chat}
    return argparse.Namespace(**{**base, **kw})


def test_run_chat_prompt_ids(chat_dir, plain_dir):
    tok = load_tokenizer(chat_dir)
    _, prompts = run_prompts(_run_args(chat_dir))
    assert prompts == [hf_chat_ids(tok, MSG), hf_chat_ids(tok, "2+2=")]
    _, prompts = run_prompts(_run_args(chat_dir, chat=False))
    assert prompts == [tok.encode(MSG), tok.encode("2+2=")]
    plain = load_tokenizer(plain_dir)
    _, prompts = run_prompts(_run_args(plain_dir))
    assert prompts == [plain.encode(vicuna_prompt(MSG)), plain.encode(vicuna_prompt("2+2="))]
    with pytest.raises(UserError, match="--chat templates --prompt texts"):
        run_prompts(_run_args(chat_dir, prompt=None, prompt_ids=["1,2,3"]))


@pytest.fixture(scope="module")
def engine(tiny_pair, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("chat-eng") / "engine"
    assert cli(["build-engine", "--config", str(ROOT / "builders" / "tiny.yaml"), "--base-model",
                str(tiny_pair / "base"), "--drafter", str(tiny_pair / "drafter"), "--output", str(out), "--tp", "1"]) == 0
    return out


def test_run_chat_through_the_cli_decodes_the_templated_prompt(engine, chat_dir, capsys):
    def run(*argv) -> list[int]:
        assert cli(["run", "--engine", str(engine), "--tokenizer", str(chat_dir), "--max-tokens", "8",
                    "--ignore-eos", "--json", *argv]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["output_ids"]

    templated = ",".join(map(str, hf_chat_ids(load_tokenizer(chat_dir), MSG)))
    chat = run("--prompt", MSG, "--chat")
    assert chat == run("--prompt-ids", templated)
    assert chat != run("--prompt", MSG)  # the template changed what the model saw


def _jsonl(path: Path) -> Path:
    path.write_text(json.dumps({"question_id": 81, "turns": [MSG, "second turn"]}) + "\n"
                    + json.dumps({"prompt": "def f():"}) + "\n")
    return path


def test_bench_auto_uses_the_tokenizers_template_for_mt_bench_rows(chat_dir, tmp_path):
    tok = load_tokenizer(chat_dir)
    prompts = load_prompts(_jsonl(tmp_path / "q.jsonl"), "auto", tok)
    assert prompts == [Prompt(MSG, "tokenizer"), Prompt("def f():")]  # {"prompt"} rows stay raw
    assert prompts[0].chat and not prompts[1].chat  # the server templates the first (apply_chat_template)
    assert prompts[0].ids(tok) == hf_chat_ids(tok, MSG)  # as fit_prompts and bench-engine count it
    assert applied_template(prompts) == "tokenizer"
    forced = load_prompts(tmp_path / "q.jsonl", "tokenizer", tok)
    assert [p.ids(tok) for p in forced] == [hf_chat_ids(tok, MSG), hf_chat_ids(tok, "def f():")]
    assert load_prompts(tmp_path / "q.jsonl", "vicuna", tok)[0] == Prompt(vicuna_prompt(MSG), "vicuna")


def test_bench_auto_without_a_template_is_vicuna(plain_dir, tmp_path):
    tok = load_tokenizer(plain_dir)
    for t in (tok, None):  # None: a server given by --url alone, its tokenizer unknown
        prompts = load_prompts(_jsonl(tmp_path / "q.jsonl"), "auto", t)
        assert prompts == [Prompt(vicuna_prompt(MSG), "vicuna"), Prompt("def f():")]
        assert not any(p.chat for p in prompts) and applied_template(prompts) == "vicuna"
    assert prompts[0].ids(tok) == chat_prompt_ids(tok, MSG)
    assert applied_template(load_prompts(tmp_path / "q.jsonl", "none", tok)) == "none"
    with pytest.raises(UserError, match="has no chat template"):
        resolve_chat_template("tokenizer", tok)
    with pytest.raises(UserError, match="needs the served model's tokenizer"):
        resolve_chat_template("tokenizer", None)


def test_bench_decides_with_the_engines_tokenizer(chat_dir, plain_dir, tmp_path):
    a, b, c = (tmp_path / n for n in "abc")
    shutil.copytree(chat_dir, a / "tokenizer")
    shutil.copytree(chat_dir, b / "tokenizer")
    shutil.copytree(plain_dir, c / "tokenizer")
    assert sweep_tokenizer([str(a), str(b)]).chat_template
    assert sweep_tokenizer([]) is None
    assert not sweep_tokenizer([], str(plain_dir)).chat_template
    with pytest.raises(UserError, match="different chat templates"):
        sweep_tokenizer([str(a), str(c)])


def test_bench_requests_ask_the_server_to_template(monkeypatch):
    pytest.importorskip("tritonclient.grpc", reason="tritonclient is not installed (pip install '.[serving]')")
    from trt_redrafter.serving import client

    sent = []

    def fake_generate_one(url, req, **kw):
        sent.append(req)
        return client.GenerationOutcome("r", final=True)

    monkeypatch.setattr(client, "generate_one", fake_generate_one)
    cfg = BenchConfig(warmup=0, num_requests=2, ignore_eos=False)
    run_point(Target(1, "ar", "127.0.0.1:1", "ar"), [Prompt(MSG, "tokenizer"), Prompt("raw")], [0.0, 0.0], cfg)
    chat, raw = sorted(sent, key=lambda r: r.prompt != MSG)
    assert (chat.prompt, chat.apply_chat_template, raw.prompt, raw.apply_chat_template) == (MSG, True, "raw", False)
    assert "apply_chat_template" in {t.name() for t in client.build_inputs(chat)}
    assert "apply_chat_template" not in {t.name() for t in client.build_inputs(raw)}  # stock ensembles lack it


def test_bench_engine_prompts(chat_dir, tmp_path):
    tok = load_tokenizer(chat_dir)
    args = argparse.Namespace(prompts=_jsonl(tmp_path / "q.jsonl"), num_prompts=2, chat_template="auto",
                              prompt_order="categories")
    assert encode_prompts(tok, args) == ([hf_chat_ids(tok, MSG), tok.encode("def f():")], "tokenizer")
    args.prompts = tmp_path / "missing.jsonl"  # no silent fallback to other prompts: one clear error
    with pytest.raises(UserError, match="missing.jsonl does not exist"):
        encode_prompts(tok, args)


def test_preprocessing_code_as_copied_templates_without_torch(chat_dir, tmp_path):
    """make-repo copies TEXT_MODULES beside the preprocessing model.py; a stock tritonserver imports them from there,
    with no trt-redrafter installed and maybe no torch."""
    for mod in TEXT_MODULES:
        (tmp_path / "trt_redrafter" / mod).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(PACKAGE_ROOT / mod, tmp_path / "trt_redrafter" / mod)
    code = ("import sys; sys.modules['torch'] = None; sys.path.insert(0, sys.argv[1]); "
            # an editable install's finder would find modules missing from the copy in this checkout
            "sys.meta_path[:] = [f for f in sys.meta_path if '__editable__' not in getattr(f, '__module__', '')]; "
            "from trt_redrafter.serving.text import TextCodec; "
            "ids = TextCodec(sys.argv[2]).encode(sys.argv[3], chat=True); "
            "outside = [m.__file__ for k, m in sys.modules.items() if k.startswith('trt_redrafter') and "
            "not m.__file__.startswith(sys.argv[1])]; "
            "assert not outside, outside; print(ids)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path), str(chat_dir), MSG], capture_output=True,
                         text=True, cwd=tmp_path, check=False)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == hf_chat_ids(load_tokenizer(chat_dir), MSG)


def test_a_qwen_tokenizer_and_chatml_template_through_the_text_codec(plain_dir, tmp_path):
    """What the Triton preprocessing and postprocessing models do with a Qwen2 tokenizer (Qwen's pre-tokenizer,
    ChatML, no BOS, eos <|im_end|>): the chat prompt is Hugging Face's own ids, plain text encodes as HF encodes it,
    and the answer decodes with the special tokens dropped. ci/transformers4.sh runs it under transformers 4.53."""
    qwen = write_qwen_tokenizer(plain_dir, tmp_path / "qwen")
    tok = load_tokenizer(qwen)
    assert tok.bos_token is None and tok.eos_token == "<|im_end|>"
    ids = TextCodec(qwen).encode(MSG, chat=True)
    assert ids == hf_chat_ids(tok, MSG) == chat_prompt_ids(tok, MSG)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and ids.count(ids[0]) == 2  # user and assistant turns
    assert TextCodec(qwen).encode(MSG) == tok.encode(MSG)
    answer = tok.encode("2, 3 and 5.") + [tok.eos_token_id]
    assert TextCodec(qwen).decode(answer) == "2, 3 and 5."
