"""The training loop of `train-drafter`: distil an Apple-format ReDrafter drafter from a frozen HF Llama base (the
paper's recipe, section 3.5). The corpus comes from `sources.py`, the drafter module from `model/drafter.py`.

1. Distillation corpus: the base answers prompts greedily with a KV cache (HF `generate`, batched). Prompts are
   text windows (a base model: exactly --seq-len tokens, eos ignored), a user's JSONL of prompts or conversations,
   or written by the base itself (Magpie, `prompts.py`); chat prompts go through the model's chat template and
   answers end at eos. On its own greedy text the base's next-token prediction at every position is the token
   that follows, so teacher forcing on these sequences shows the drafter exactly what it sees at inference.
2. One frozen base forward per sequence gives h_t (final-norm hidden state) and g_t = argmax logits_t (the base's
   prediction of token t+1). Both go to disk in shards (`corpus.py`) that training streams back, a few at a time.
3. Drafter (Apple semantics, like `trt_redrafter.model.drafter`): at position t, s_0 = 0 and for i = 1..T
       s_i = SiLU(rnn_w e(x_{t+i}) + rnn_u s_{i-1})     (rnn; else s_i = e(x_{t+i}) + s_{i-1})
       logits_i = lm_head(ResBlocks(input_proj?([h_t ; s_i])))     target g_{t+i}
   e is the base's (frozen) token embedding. Step 1 consumes x_{t+1} = g_t, the "true token" of inference, and
   predicts the base's token after it; step i consumes the i-1 tokens drafted before it. Only positions whose
   x_{t+1} is base-generated (t >= prompt length - 1) enter the loss, so training matches inference exactly.
   Loss = sum over i of the mean cross-entropy of step i (Apple's `drafter_loss`).
   With --draft-vocab K (FR-Spec, arXiv 2502.14856) the head has K rows: the K tokens the base generates most
   often in the training corpus (`target_counts`, `draft_vocabulary`); a target outside them is left out of the loss and counts
   as a miss in every accuracy.
4. Checkpoints (drafter, optimizer, step) every --save-every steps in the work directory; --resume continues to
   the same bytes as an uninterrupted run. Under `torchrun` each process takes its slice of every batch (DDP).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from ..errors import UserError
from ..fsutil import atomic_output_dir, write_json
from ..log import get_logger
from ..model.drafter import Drafter
from . import corpus as corpus_mod
from . import data as data_mod
from .config import DRAFT_HEAD_BUDGET, DTYPES, DrafterTrainConfig
from .sources import (LazyGenerator, Source, corpus_spec, coverage, draft_vocabulary, load_base, load_tokenizer,
                      open_corpus, sources, target_counts)

log = get_logger(__name__)

MODEL_TYPE = "recurrent_drafting_drafter"


def exit_dim_for(cfg: DrafterTrainConfig, H: int, V: int, base_params: int) -> int:
    """--exit-dim 0 (auto): 2H (no input projection, Apple's recipe) when the drafter's vocabulary head, read
    once per drafting step, stays within DRAFT_HEAD_BUDGET of the base's weights per decoding step; else the widest
    power of two that does (at least 64), behind an input projection. V: the head's rows (the draft
    vocabulary's size when there is one)."""
    if cfg.exit_dim:
        return cfg.exit_dim
    budget = DRAFT_HEAD_BUDGET * base_params / (cfg.draft_len * V)
    if 2 * H <= budget:
        return 2 * H
    e = 64
    while e * 2 <= budget and e * 2 < 2 * H:
        e *= 2
    return e


def head_targets(y: torch.Tensor, lookup: Optional[torch.Tensor]) -> torch.Tensor:
    """Targets as head rows: unchanged without a draft vocabulary, else the row of each token (-100 outside)."""
    if lookup is None:
        return y
    return torch.where(y >= 0, lookup[y.clamp(min=0)], y)


def loss_and_hits(drafter: Drafter, h, embs, y, lookup: Optional[torch.Tensor] = None,
                   teacher: Optional[tuple[torch.Tensor, torch.Tensor]] = None, soft: float = 0.0):
    """(summed per-step mean cross-entropy, hits [B, T], valid [B, T]); `lookup` maps token ids to head rows
    (-100: not in the draft vocabulary: left out of the loss, a miss for the accuracies).

    `soft` > 0 with `teacher` = (the base's hidden states at the targets' positions [B, T, H], its output rows for
    the head's rows [V or K, H]): each step's loss is (1 - soft) x the cross-entropy to the greedy target + soft x
    the cross-entropy to the base's own distribution there (its softmax over the head's rows), the soft labels of
    knowledge distillation: the base's second and third choices are signal too, which a corpus small next to the
    drafter (it memorizes hard targets) needs most."""
    logits = drafter(h, embs)  # [B, T, V or K]
    T = logits.shape[1]
    rows = head_targets(y, lookup)
    probs = None
    if soft > 0:
        th, tw = teacher
        with torch.no_grad():
            probs = torch.softmax(th.float() @ tw.float().T, dim=-1)  # [B, T, V or K]
    losses = []
    for i in range(T):
        keep = rows[:, i] != -100
        n = int(keep.sum())
        logp = F.log_softmax(logits[:, i].float(), dim=-1)
        ce = F.nll_loss(logp, rows[:, i], ignore_index=-100, reduction="sum")
        if probs is not None:
            ce = (1.0 - soft) * ce + soft * -(probs[:, i][keep] * logp[keep]).sum()
        losses.append(ce / max(1, n))
    valid = y != -100
    hit = (logits.argmax(-1) == rows) & valid
    return sum(losses), hit, valid


@torch.no_grad()
def evaluate(drafter: Drafter, corpus: corpus_mod.ShardedCorpus, T: int, embed: torch.Tensor,
             device: torch.device, batch: int = 2048, lookup: Optional[torch.Tensor] = None) -> dict:
    """Per-step top-1 accuracy (teacher-forced consumed tokens) and the chained rate (steps 1..i all right),
    streamed one shard at a time."""
    hits, chain, valid, loss_sum, nb = torch.zeros(T), torch.zeros(T), torch.zeros(T), 0.0, 0
    for loaded, pos in corpus_mod.eval_batches(corpus, batch):
        h, e, y = corpus_mod.gather(loaded, pos, T, embed, device)
        loss, hit, ok = loss_and_hits(drafter, h, e, y, lookup)
        loss_sum += float(loss) * len(pos)
        nb += len(pos)
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
    out = {"model_type": MODEL_TYPE, "vocab_size": d.vocab_size, "hidden_size": d.hidden_size,
           "exit_dim": d.exit_dim, "num_draft_layers": d.num_layers, "num_lookback_tokens": -1, "rnn": d.rnn,
           "torch_dtype": "float32"}
    if hasattr(d, "draft_vocab"):  # this project's extension: Apple's loader does not know it
        out["draft_vocab_size"] = len(d.draft_vocab)
    return out


def _dist_env(device: torch.device) -> tuple[int, int, torch.device]:
    """(rank, world, device) under torchrun (WORLD_SIZE > 1: one process group, gloo on CPU, nccl on CUDA)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, device
    import torch.distributed as dist

    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), world, device


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist
        dist.barrier()


def build_split(corpus: corpus_mod.ShardedCorpus, source: Source, generator, cfg, pad_id, rank, world,
                 desc, progress) -> None:
    written = corpus_mod.build(corpus, source.prompts_for, generator, cfg.seq_len, source.stop_ids, pad_id,
                               rank, world, desc, progress)
    if world > 1:
        _barrier(world)
        if rank == 0:
            corpus.record(written)
            corpus.count_unrecorded()
        _barrier(world)
        corpus.refresh()


MEMORY_SHARE = 4  # --shards-in-memory 0 holds shards in up to 1/MEMORY_SHARE of the machine's memory


def shards_in_memory(cfg: DrafterTrainConfig, corpus: corpus_mod.ShardedCorpus, world: int) -> int:
    """How many shards training holds at a time: --shards-in-memory, or with 0 every shard where they fit in a
    quarter of the machine's memory (shared by the processes of one machine), else as many as do. A batch is drawn
    from the positions of the shards held, and neighbouring positions of one conversation predict nearly the same
    tokens: with few shards held the drafter fits those few conversations for a hundred steps, then the next ones
    (its training loss falls within a group and jumps back at the next), instead of learning from all of them
    at once."""
    if cfg.shards_in_memory:
        return min(cfg.shards_in_memory, corpus.num_shards)
    # a loaded shard holds its tokens and targets as int64 (twice their int32 on disk) beside its bf16 hidden states:
    # less than twice the file
    per_shard = 2 * max(corpus.shard_path(i).stat().st_size for i in range(corpus.num_shards))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    budget = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (MEMORY_SHARE * max(1, local))
    return max(1, min(corpus.num_shards, budget // per_shard))


def _train_spec(cfg: DrafterTrainConfig, exit_dim: int, world: int) -> dict:
    keys = ("draft_len", "num_layers", "rnn", "draft_vocab", "steps", "lr", "warmup", "weight_decay", "batch_size",
            "seed", "shards_in_memory")
    spec = {**{k: getattr(cfg, k) for k in keys}, "exit_dim": exit_dim, "world_size": world}
    if cfg.soft_targets:  # only when set: checkpoints written before the option resume unchanged
        spec["soft_targets"] = cfg.soft_targets
    return spec


def _save_checkpoint(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def train_drafter(base_model: str | Path, output: str | Path, cfg: DrafterTrainConfig | None = None,
                  force: bool = False, progress: bool = True) -> dict:
    """Distil a drafter for `base_model` and write it (Apple format + training.json) to `output`. Returns the
    training summary written to training.json (or, when `cfg.stop_after` ends the run early, the checkpoint's
    step under "stopped_at")."""
    from tqdm.auto import tqdm

    cfg = cfg or DrafterTrainConfig()
    cfg.validate()
    base_model, output = Path(base_model), Path(output)
    if output.exists() and not force:
        raise UserError(f"drafter output directory {output} already exists; pass --force to replace it or choose "
                        f"another path.")
    if not base_model.is_dir():
        raise UserError(f"base model directory {base_model} does not exist.")
    work = Path(cfg.work_dir) if cfg.work_dir else output.with_name(output.name + ".work")
    ckpt_path = work / "checkpoint.pt"
    if cfg.resume and not ckpt_path.is_file():
        raise UserError(f"--resume: {ckpt_path} does not exist; start without --resume (or pass the --work-dir of "
                        f"the interrupted run).")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    rank, world, device = _dist_env(_device(cfg.device))
    if cfg.batch_size % world:
        raise UserError(f"--batch-size {cfg.batch_size} does not divide among {world} processes; pick a multiple "
                        f"of {world}.")
    t_start = time.time()
    with torch.random.fork_rng(devices=[]):
        tokenizer, hf_config = load_tokenizer(base_model)
        H, V = hf_config.hidden_size, hf_config.vocab_size
        bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else hf_config.bos_token_id
        if bos is None and not (cfg.prompts or cfg.magpie):
            raise UserError(f"{base_model}: neither the tokenizer nor config.json names a bos token.")
        pad_id = next((t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if t is not None))
        gen = LazyGenerator(cfg, base_model, device, work, pad_id)
        train_src, held_src = sources(cfg, gen.sample, tokenizer, bos)
        gen.max_prompt = max(train_src.max_prompt, held_src.max_prompt)
        train_corpus = open_corpus(work / "corpus" / "train", corpus_spec(cfg, base_model, train_src),
                                    train_src.num_sequences, cfg, force)
        eval_corpus = open_corpus(work / "corpus" / "held-out", corpus_spec(cfg, base_model, held_src),
                                   held_src.num_sequences, cfg, force)
        reused = train_corpus.complete and eval_corpus.complete
        build_split(train_corpus, train_src, gen, cfg, pad_id, rank, world, "distillation corpus", progress)
        build_split(eval_corpus, held_src, gen, cfg, pad_id, rank, world, "held-out corpus", progress)
        gen.close()
        gen_s = time.time() - t_start
        held = shards_in_memory(cfg, train_corpus, world)
        if held != cfg.shards_in_memory:
            log.info("holding %d of the corpus's %d shards in memory while training", held, train_corpus.num_shards)
        cfg = dataclasses.replace(cfg, shards_in_memory=held)  # the number held, in the checkpoint and training.json
        model = load_base(base_model, torch.device("cpu"))
        embed = model.get_input_embeddings().weight.detach().float().to(device)  # [V, H], frozen
        out_head = model.get_output_embeddings().weight.detach().float()  # [V, H]
        base_params = sum(p.numel() for p in model.parameters())
        del model

        draft_vocab, lookup, covered = None, None, None
        if cfg.draft_vocab:
            if cfg.draft_vocab >= V:
                raise UserError(f"--draft-vocab {cfg.draft_vocab} is not smaller than the vocabulary ({V}); pass "
                                f"0 for the whole vocabulary.")
            train_counts = target_counts(train_corpus, V)
            draft_vocab = draft_vocabulary(train_counts, cfg.draft_vocab)
            lookup = torch.full((V,), -100, dtype=torch.long)
            lookup[draft_vocab] = torch.arange(len(draft_vocab))
            covered = {"train": round(coverage(train_counts, draft_vocab), 4),
                       "held_out": round(coverage(target_counts(eval_corpus, V), draft_vocab), 4)}
            log.info("draft vocabulary: %d tokens cover %.1f%% of the training targets, %.1f%% held out",
                     len(draft_vocab), 100 * covered["train"], 100 * covered["held_out"])
            lookup = lookup.to(device)
        exit_dim = exit_dim_for(cfg, H, cfg.draft_vocab or V, base_params)
        torch.manual_seed(cfg.seed)  # the drafter's initialisation does not depend on how the corpus was made
        drafter = Drafter(H, V, exit_dim, cfg.num_layers, cfg.rnn, draft_vocab).to(device)
        head_rows = out_head[:V] if draft_vocab is None else out_head[draft_vocab]  # the base's rows for the head's
        if exit_dim == 2 * H:  # warm start: the h half of the output head reads like the base's lm_head
            with torch.no_grad():
                drafter.lm_head[-1].weight[:, :H].copy_(head_rows)
        opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        # --soft-targets: the base's logits over the head's rows, from a stored hidden state
        teacher_w = head_rows.to(device) if cfg.soft_targets else None
        probe_loaded = [train_corpus.load(0)]
        probe_pos = probe_loaded[0].positions()[:cfg.batch_size]
        probe = corpus_mod.gather(probe_loaded, torch.cat([torch.zeros(len(probe_pos), 1, dtype=torch.long),
                                                           probe_pos], 1), cfg.draft_len, embed, device)
        spec = _train_spec(cfg, exit_dim, world)
        start, losses, train_s = 0, [], 0.0
        with torch.no_grad():
            probe_start = float(loss_and_hits(drafter, *probe, lookup)[0])
        if cfg.resume:
            state = torch.load(ckpt_path, map_location=device, weights_only=False)
            if state["spec"] != spec:
                diff = {k: (state["spec"].get(k), spec.get(k)) for k in {**state["spec"], **spec}
                        if state["spec"].get(k) != spec.get(k)}
                raise UserError(f"--resume: {ckpt_path} was written with other settings "
                                f"({', '.join(f'{k}: {a!r} then, {b!r} now' for k, (a, b) in diff.items())}); "
                                f"resume with the same ones.")
            drafter.load_state_dict(state["drafter"])
            opt.load_state_dict(state["optimizer"])
            start, losses, probe_start, train_s = (state["step"], state["losses"], state["probe_loss_start"],
                                                   state["train_seconds"])
            log.info("resuming from %s at step %d", ckpt_path, start)
        model_ddp = drafter
        if world > 1:
            from torch.nn.parallel import DistributedDataParallel
            model_ddp = DistributedDataParallel(drafter)
        end = min(cfg.steps, cfg.stop_after) if cfg.stop_after else cfg.steps
        t_train = time.time()
        bar = tqdm(total=cfg.steps, initial=start, desc="train-drafter", unit="step",
                   disable=not progress or rank != 0)
        schedule = corpus_mod.batch_schedule(train_corpus, cfg.batch_size, cfg.seed, cfg.shards_in_memory, start)
        for step, loaded, pos in schedule:
            if step >= end:
                break
            for group in opt.param_groups:
                group["lr"] = _lr(step, cfg)
            h, e, y, *th = corpus_mod.gather(loaded, pos[rank::world], cfg.draft_len, embed, device,
                                             teacher=bool(cfg.soft_targets))
            loss, hit, ok = loss_and_hits(model_ddp, h, e, y, lookup, (th[0], teacher_w) if th else None,
                                           cfg.soft_targets)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
            bar.update(1)
            if step % cfg.log_every == 0 or step == cfg.steps - 1:
                acc = (hit.sum(0).float() / ok.sum(0).clamp(min=1)).tolist()
                bar.set_postfix(loss=f"{losses[-1]:.3f}", top1="/".join(f"{a:.2f}" for a in acc))
                log.info("step %d loss %.4f top1 %s", step, losses[-1], " ".join(f"{a:.3f}" for a in acc))
            done = step + 1
            if rank == 0 and (done % cfg.save_every == 0 or done == end):
                _save_checkpoint(ckpt_path, {"step": done, "spec": spec, "drafter": drafter.state_dict(),
                                             "optimizer": opt.state_dict(), "losses": losses,
                                             "probe_loss_start": probe_start,
                                             "train_seconds": train_s + time.time() - t_train})
        bar.close()
        train_s += time.time() - t_train
        _barrier(world)
        if end < cfg.steps:
            log.info("stopped after step %d; continue with --resume", end)
            return {"stopped_at": end, "checkpoint": str(ckpt_path)}
        if rank != 0:
            return {}
        drafter.eval()
        with torch.no_grad():
            probe_end = float(loss_and_hits(drafter, *probe, lookup)[0])
        held = evaluate(drafter, eval_corpus, cfg.draft_len, embed, device, lookup=lookup)

    tail = losses[-20:]
    summary = {
        "base_model": str(base_model), "config": dataclasses.asdict(cfg),
        "drafter": drafter_config_json(drafter),
        "data": {"source": train_src.name, "train_sequences": train_src.num_sequences,
                 "train_positions": train_corpus.total_positions, "held_out_sequences": held_src.num_sequences,
                 "held_out_positions": eval_corpus.total_positions, "corpus_reused": reused,
                 "held_out_modules": (list(data_mod.HELD_OUT_MODULES)
                                      if train_src.name == "text:stdlib" else None)},
        "device": device.type, "processes": world, "corpus_seconds": round(gen_s, 1),
        "train_seconds": round(train_s, 1),
        "first_loss": round(losses[0], 4), "final_loss": round(sum(tail) / len(tail), 4),
        "probe_loss_start": round(probe_start, 4), "probe_loss_end": round(probe_end, 4),
        "held_out": held,
    }
    if covered is not None:
        summary["draft_vocab"] = {"size": cfg.draft_vocab, "coverage": covered}
    tensors = {k: v.detach().to("cpu", DTYPES[cfg.dtype] if v.is_floating_point() else v.dtype).contiguous()
               for k, v in drafter.state_dict().items()}
    cfg_json = {**drafter_config_json(drafter), "torch_dtype": cfg.dtype}
    with atomic_output_dir(output, force=force, what="drafter output") as tmp:
        with open(tmp / "config.json", "w") as f:
            json.dump(cfg_json, f, indent=2)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        write_json(tmp / "training.json", summary)
    log.info("wrote drafter %s: held-out top-1 per step %s", output, held["top1"])
    return summary
