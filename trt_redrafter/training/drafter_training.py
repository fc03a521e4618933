"""Distil an Apple-format ReDrafter drafter from a frozen HF Llama base (the paper's recipe, section 3.5).

1. Distillation corpus: the base model continues text windows (prompts) greedily with a KV cache (HF `generate`,
   batched, eos ignored). On its own greedy text the base's next-token prediction at every position is the token
   that follows, so teacher forcing on these sequences shows the drafter exactly what it sees at inference.
2. One frozen base forward per sequence gives h_t (final-norm hidden state) and g_t = argmax logits_t (the base's
   prediction of token t+1).
3. Drafter (Apple semantics, like `trt_redrafter.model.drafter`): at position t, s_0 = 0 and for i = 1..T
       s_i = SiLU(rnn_w e(x_{t+i}) + rnn_u s_{i-1})     (rnn; else s_i = e(x_{t+i}) + s_{i-1})
       logits_i = lm_head(ResBlocks(input_proj?([h_t ; s_i])))     target g_{t+i}
   e is the base's (frozen) token embedding. Step 1 consumes x_{t+1} = g_t, the "true token" of inference, and
   predicts the base's token after it; step i consumes the i-1 tokens drafted before it. Only positions whose
   x_{t+1} is base-generated (t >= prompt length - 1) enter the loss, so training matches inference exactly.
   Loss = sum over i of the mean cross-entropy of step i (Apple's `drafter_loss`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file

from ..errors import UserError
from ..fsutil import atomic_output_dir, write_json
from ..log import get_logger
from . import data as data_mod

log = get_logger(__name__)

MODEL_TYPE = "recurrent_drafting_drafter"


@dataclass
class DrafterTrainConfig:
    draft_len: int = 4  # T: drafter steps trained (match --draft-len-per-beam at inference)
    num_layers: int = 1  # ResBlocks
    rnn: bool = True
    exit_dim: int = 0  # 0: 2*H (no input_proj, Apple's recipe)
    steps: int = 600
    lr: float = 2e-3
    warmup: int = 30
    weight_decay: float = 0.0
    batch_size: int = 512  # positions per step
    seq_len: int = 160  # generated tokens per distillation sequence
    prompt_min: int = 16  # prompt window length range (tokens, bos added)
    prompt_max: int = 64
    num_sequences: int = 512  # distillation corpus size (training)
    eval_sequences: int = 64  # held-out corpus (prompts from held-out text)
    gen_batch_size: int = 64
    seed: int = 0
    data: Optional[str] = None  # None/'stdlib', a directory of text files or one text file
    device: str = "auto"
    threads: int = 0  # 0: leave torch's default
    log_every: int = 25

    def validate(self) -> None:
        for n in ("draft_len", "steps", "batch_size", "seq_len", "prompt_min", "prompt_max", "num_sequences",
                  "eval_sequences", "gen_batch_size"):
            v = getattr(self, n)
            if not isinstance(v, int) or v <= 0:
                raise UserError(f"--{n.replace('_', '-')}: expected a positive integer, got {v!r}.")
        if self.num_layers < 0 or self.exit_dim < 0:
            raise UserError("--num-layers and --exit-dim must be >= 0.")
        if self.prompt_min > self.prompt_max:
            raise UserError(f"prompt length range {self.prompt_min}..{self.prompt_max} is empty.")
        if not self.lr > 0:
            raise UserError(f"--lr: expected a positive number, got {self.lr}.")
        if self.device not in ("auto", "cpu", "cuda"):
            raise UserError(f"--device: expected auto, cpu or cuda, got {self.device!r}.")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise UserError("--device cuda: no CUDA device is available; use --device cpu.")


class ResBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        nn.init.zeros_(self.linear.weight)  # starts as the identity (x + SiLU(0) = x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class Drafter(nn.Module):
    """Apple's drafter; `state_dict()` names are the Apple checkpoint names."""

    def __init__(self, hidden_size: int, vocab_size: int, exit_dim: int, num_layers: int, rnn: bool):
        super().__init__()
        self.hidden_size, self.vocab_size, self.exit_dim, self.num_layers, self.rnn = (
            hidden_size, vocab_size, exit_dim, num_layers, rnn)
        if exit_dim != 2 * hidden_size:
            self.input_proj = nn.Linear(2 * hidden_size, exit_dim)
        self.lm_head = nn.Sequential(*[ResBlock(exit_dim) for _ in range(num_layers)],
                                     nn.Linear(exit_dim, vocab_size, bias=False))
        if rnn:
            self.rnn_u = nn.Linear(hidden_size, hidden_size, bias=True)
            self.rnn_w = nn.Linear(hidden_size, hidden_size, bias=False)

    def update_state(self, emb: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        if not self.rnn:
            return emb + state
        return F.silu(self.rnn_w(emb) + self.rnn_u(state))

    def logits(self, h: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        x = torch.cat([h, state], dim=-1)  # [..., 2H]
        if hasattr(self, "input_proj"):
            x = self.input_proj(x)
        return self.lm_head(x)

    def forward(self, h: torch.Tensor, embs: torch.Tensor) -> torch.Tensor:
        """h [B, H], embs [B, T, H] (embeddings of the consumed tokens) -> logits [B, T, V]."""
        state = torch.zeros_like(h)
        out = []
        for i in range(embs.shape[1]):
            state = self.update_state(embs[:, i], state)
            out.append(self.logits(h, state))
        return torch.stack(out, dim=1)


@dataclass
class Corpus:
    """Base-generated sequences, right-padded: tokens/targets [N, n], hidden [N, n, H], positions [P, 2]."""

    tokens: torch.Tensor  # x, long
    targets: torch.Tensor  # g_t = argmax of the base at t (prediction of token t+1); -100 past the row's end
    hidden: torch.Tensor  # h_t, final-norm hidden states (float32)
    positions: torch.Tensor  # (row, t) pairs usable as drafting positions: x_{t+1} was generated by the base


def _load_base(path: Path, device: torch.device):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (path / "config.json").is_file():
        raise UserError(f"base model directory {path} has no config.json; pass an HF Llama directory.")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load a tokenizer from {path} (train-drafter needs one to read the text): {e}") from e
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(device).eval()
    if getattr(model.config, "model_type", None) != "llama":
        raise UserError(f"{path}: model_type is {model.config.model_type!r}; train-drafter supports Llama bases.")
    for p in model.parameters():
        p.requires_grad_(False)
    return model, tokenizer


def _prompt_stream(tokenizer, files: list[Path], max_files: int = 48) -> torch.Tensor:
    """Token stream of up to `max_files` files spread evenly over the list (keeps tokenizing fast)."""
    if len(files) > max_files:
        step = len(files) / max_files
        files = [files[int(i * step)] for i in range(max_files)]
    return data_mod.token_stream(tokenizer, files)


@torch.no_grad()
def build_corpus(model, bos: int, stream: torch.Tensor, n: int, cfg: DrafterTrainConfig, g: torch.Generator,
                 device: torch.device, desc: str) -> Corpus:
    """Greedy continuations of `n` prompts (one prompt length per generation batch, so no padding)."""
    from tqdm.auto import tqdm

    if len(stream) <= cfg.prompt_max + 1:
        raise UserError(f"the text holds only {len(stream)} tokens; need more than {cfg.prompt_max + 1} for prompts.")
    V = model.config.vocab_size
    width = cfg.prompt_max + 1 + cfg.seq_len
    tokens = torch.zeros(n, width, dtype=torch.long)
    targets = torch.full((n, width), -100, dtype=torch.long)
    hidden = torch.zeros(n, width, model.config.hidden_size, dtype=torch.float32)
    positions = []
    bar = tqdm(total=n, desc=desc, unit="seq", leave=False)
    for lo in range(0, n, cfg.gen_batch_size):
        b = min(cfg.gen_batch_size, n - lo)
        plen = int(torch.randint(cfg.prompt_min, cfg.prompt_max + 1, (1,), generator=g))
        starts = torch.randint(0, len(stream) - plen, (b,), generator=g).tolist()
        prompt = torch.stack([torch.cat([torch.tensor([bos]), stream[s:s + plen]]) for s in starts]).to(device)
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=cfg.seq_len,
                             min_new_tokens=cfg.seq_len, do_sample=False, eos_token_id=None, pad_token_id=0)
        L = out.shape[1]  # plen + 1 + seq_len
        hs = model.model(input_ids=out).last_hidden_state  # [b, L, H], final norm applied
        gt = model.lm_head(hs)[..., :V].argmax(-1)  # [b, L]
        tokens[lo:lo + b, :L] = out.cpu()
        targets[lo:lo + b, :L] = gt.cpu()
        hidden[lo:lo + b, :L] = hs.float().cpu()
        p0 = plen  # last prompt position (bos at 0): x_{p0+1} is the first generated token
        for r in range(lo, lo + b):
            positions += [(r, t) for t in range(p0, L - 1)]
        bar.update(b)
    bar.close()
    return Corpus(tokens, targets, hidden, torch.tensor(positions, dtype=torch.long))


def _batch(corpus: Corpus, idx: torch.Tensor, T: int, embed: torch.Tensor, device: torch.device):
    """(h [B, H], embs [B, T, H], targets [B, T]) for drafting positions `idx` into corpus.positions."""
    rows, t = corpus.positions[idx, 0], corpus.positions[idx, 1]  # [B]
    width = corpus.tokens.shape[1]
    cols = t[:, None] + torch.arange(1, T + 1)[None, :]  # [B, T]: t+1 .. t+T
    ok = cols < width
    cols_c = cols.clamp(max=width - 1)
    x = corpus.tokens[rows[:, None], cols_c]  # consumed tokens x_{t+i}
    y = corpus.targets[rows[:, None], cols_c].masked_fill(~ok, -100)  # g_{t+i}; -100 past the row's end
    h = corpus.hidden[rows, t]
    return h.to(device), embed[x.to(device)], y.to(device)


def _loss_and_hits(drafter: Drafter, h, embs, y):
    logits = drafter(h, embs)  # [B, T, V]
    T = logits.shape[1]
    losses = [F.cross_entropy(logits[:, i].float(), y[:, i], ignore_index=-100) for i in range(T)]
    valid = y != -100
    hit = (logits.argmax(-1) == y) & valid
    return sum(losses), hit, valid


@torch.no_grad()
def evaluate(drafter: Drafter, corpus: Corpus, T: int, embed: torch.Tensor, device: torch.device,
             batch: int = 2048) -> dict:
    """Per-step top-1 accuracy (teacher-forced consumed tokens) and the chained rate (steps 1..i all right)."""
    hits, chain, valid, loss_sum, nb = torch.zeros(T), torch.zeros(T), torch.zeros(T), 0.0, 0
    for lo in range(0, len(corpus.positions), batch):
        idx = torch.arange(lo, min(lo + batch, len(corpus.positions)))
        h, e, y = _batch(corpus, idx, T, embed, device)
        loss, hit, ok = _loss_and_hits(drafter, h, e, y)
        loss_sum += float(loss) * len(idx)
        nb += len(idx)
        full = ok.all(dim=1)  # positions with all T targets, for the chained rate
        hits += hit.sum(0).float().cpu()
        valid += ok.sum(0).float().cpu()
        chain += (hit.cumprod(dim=1).bool() & full[:, None]).sum(0).float().cpu()
    n_full = float(valid[-1])  # positions with all T targets (the last step's count)
    top1 = (hits / valid.clamp(min=1)).tolist()
    chained = (chain / max(1.0, n_full)).tolist()
    return {"loss": loss_sum / max(1, nb), "top1": [round(a, 4) for a in top1],
            "chained_top1": [round(a, 4) for a in chained],
            # expected tokens/step of a single greedy beam: 1 (true token) + expected accepted prefix length
            "expected_tokens_per_step_1beam": round(1.0 + sum(chained), 3), "positions": nb}


def _lr(step: int, cfg: DrafterTrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))


def _device(name: str) -> torch.device:
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def drafter_config_json(d: Drafter) -> dict:
    return {"model_type": MODEL_TYPE, "vocab_size": d.vocab_size, "hidden_size": d.hidden_size,
            "exit_dim": d.exit_dim, "num_draft_layers": d.num_layers, "num_lookback_tokens": -1, "rnn": d.rnn,
            "torch_dtype": "float32"}


def train_drafter(base_model: str | Path, output: str | Path, cfg: DrafterTrainConfig | None = None,
                  force: bool = False, progress: bool = True) -> dict:
    """Distil a drafter for `base_model` and write it (Apple format + training.json) to `output`. Returns the
    training summary written to training.json."""
    from tqdm.auto import tqdm

    cfg = cfg or DrafterTrainConfig()
    cfg.validate()
    base_model, output = Path(base_model), Path(output)
    if output.exists() and not force:
        raise UserError(f"drafter output directory {output} already exists; pass --force to replace it or choose "
                        f"another path.")
    if not base_model.is_dir():
        raise UserError(f"base model directory {base_model} does not exist.")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = _device(cfg.device)
    t_start = time.time()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model, tokenizer = _load_base(base_model, device)
        H, V = model.config.hidden_size, model.config.vocab_size
        bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else model.config.bos_token_id
        if bos is None:
            raise UserError(f"{base_model}: neither the tokenizer nor config.json names a bos token.")
        train_files, held_files = data_mod.text_files(cfg.data)
        g = torch.Generator().manual_seed(cfg.seed)
        train_corpus = build_corpus(model, bos, _prompt_stream(tokenizer, train_files), cfg.num_sequences, cfg, g,
                                    device, "distillation corpus")
        eval_corpus = build_corpus(model, bos, _prompt_stream(tokenizer, held_files), cfg.eval_sequences, cfg, g,
                                   device, "held-out corpus")
        gen_s = time.time() - t_start
        embed = model.get_input_embeddings().weight.detach().float()  # [V, H], frozen
        out_head = model.get_output_embeddings().weight.detach().float()  # [V, H]
        del model

        exit_dim = cfg.exit_dim or 2 * H
        drafter = Drafter(H, V, exit_dim, cfg.num_layers, cfg.rnn).to(device)
        if exit_dim == 2 * H:  # warm start: the h half of the output head reads like the base's lm_head
            with torch.no_grad():
                drafter.lm_head[-1].weight[:, :H].copy_(out_head[:V])
        opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        probe_idx = torch.randperm(len(train_corpus.positions), generator=g)[:cfg.batch_size]
        probe = _batch(train_corpus, probe_idx, cfg.draft_len, embed, device)
        with torch.no_grad():
            probe_start = float(_loss_and_hits(drafter, *probe)[0])
        losses = []
        t_train = time.time()
        bar = tqdm(range(cfg.steps), desc="train-drafter", unit="step", disable=not progress)
        for step in bar:
            for group in opt.param_groups:
                group["lr"] = _lr(step, cfg)
            idx = torch.randint(0, len(train_corpus.positions), (cfg.batch_size,), generator=g)
            loss, hit, ok = _loss_and_hits(drafter, *_batch(train_corpus, idx, cfg.draft_len, embed, device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
            if step % cfg.log_every == 0 or step == cfg.steps - 1:
                acc = (hit.sum(0).float() / ok.sum(0).clamp(min=1)).tolist()
                bar.set_postfix(loss=f"{losses[-1]:.3f}", top1="/".join(f"{a:.2f}" for a in acc))
                log.info("step %d loss %.4f top1 %s", step, losses[-1], " ".join(f"{a:.3f}" for a in acc))
        bar.close()
        train_s = time.time() - t_train
        drafter.eval()
        with torch.no_grad():
            probe_end = float(_loss_and_hits(drafter, *probe)[0])
        held = evaluate(drafter, eval_corpus, cfg.draft_len, embed, device)

    tail = losses[-20:]
    summary = {
        "base_model": str(base_model), "config": dataclasses.asdict(cfg),
        "drafter": drafter_config_json(drafter),
        "data": {"source": cfg.data or "stdlib", "train_sequences": cfg.num_sequences,
                 "train_positions": len(train_corpus.positions), "held_out_sequences": cfg.eval_sequences,
                 "held_out_positions": len(eval_corpus.positions),
                 "held_out_modules": list(data_mod.HELD_OUT_MODULES) if cfg.data in (None, "", "stdlib") else None},
        "device": device.type, "corpus_seconds": round(gen_s, 1), "train_seconds": round(train_s, 1),
        "first_loss": round(losses[0], 4), "final_loss": round(sum(tail) / len(tail), 4),
        "probe_loss_start": round(probe_start, 4), "probe_loss_end": round(probe_end, 4),
        "held_out": held,
    }
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in drafter.state_dict().items()}
    with atomic_output_dir(output, force=force, what="drafter output") as tmp:
        with open(tmp / "config.json", "w") as f:
            json.dump(drafter_config_json(drafter), f, indent=2)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        write_json(tmp / "training.json", summary)
    log.info("wrote drafter %s: held-out top-1 per step %s", output, held["top1"])
    return summary
