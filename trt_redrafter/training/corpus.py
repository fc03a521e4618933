"""The distillation corpus on disk: what the base generated, streamed back in fixed-size shards.

Generation (generation.py: the project's engine, or HF `generate`) writes one safetensors shard per --gen-batch-size prompts into `DIR/shard-NNNNN.safetensors` (written under a
temporary name and renamed, so a shard is whole or absent) and lists it in `DIR/manifest.json`. A shard holds

    tokens  int32   [b, W]     the row: prompt (bos / chat template included) then the base's greedy answer
    targets int32   [b, W]     g_t = argmax of the base at t (greedy: token t+1); -100 at the row's last token and past
    hidden  float32 [b, W, H]  h_t, the base's final-norm hidden state (zeros at the row's last token and past);
                               bfloat16/float16 when the base generated in that dtype (its values exactly)
    first   int32   [b]        the first drafting position (the last prompt token: x_{t+1} is base-generated)
    length  int32   [b]        tokens in the row

Training never holds more than `group` shards in memory (`batch_schedule`), so its memory does not grow with the
corpus. Everything random is seeded per shard or per epoch, so an interrupted run (generation or training) resumes
to the same bytes as one that was never interrupted.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
from safetensors.torch import load_file, save_file

from ..errors import UserError
from ..log import get_logger

log = get_logger(__name__)

MANIFEST = "manifest.json"
FORMAT = 1


@dataclass
class Shard:
    tokens: torch.Tensor
    targets: torch.Tensor
    hidden: torch.Tensor
    first: torch.Tensor
    length: torch.Tensor

    def positions(self) -> torch.Tensor:
        """[P, 2] (row, t) drafting positions: t from the row's first drafting position to its second-to-last token."""
        rows = [torch.stack([torch.full((n,), r), torch.arange(f, f + n)], 1)
                for r, (f, n) in enumerate(zip(self.first.tolist(), (self.length - 1 - self.first).tolist())) if n > 0]
        return torch.cat(rows) if rows else torch.zeros(0, 2, dtype=torch.long)


def num_positions(first: list[int], length: list[int]) -> int:
    return sum(max(0, n - 1 - f) for f, n in zip(first, length))


class ShardedCorpus:
    """A corpus directory: `spec` (what made it; a different spec is refused) and the shards written so far.

    Shard i's prompts depend only on the spec and i, so a corpus grows or shrinks with the number of sequences: the
    shards it already has are reused (one whose row count no longer fits, e.g. a formerly last partial shard, is
    made again)."""

    def __init__(self, root: str | Path, spec: dict, num_shards: int, rows: Optional[list[int]] = None):
        self.root, self.spec, self.num_shards = Path(root), spec, num_shards
        self.expected_rows = rows
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / MANIFEST
        self.counts, self.rows = {}, {}
        if path.is_file():
            have = json.loads(path.read_text())
            if have.get("spec") != spec:
                raise UserError(f"{self.root} holds a corpus made with other settings ({_diff(have.get('spec'), spec)}"
                                f"); pass another --work-dir, or --force to regenerate it.")
            self._read(have)
        self._write_manifest()

    def shard_path(self, i: int) -> Path:
        return self.root / f"shard-{i:05d}.safetensors"

    def done(self, i: int) -> bool:
        if not self.shard_path(i).is_file():
            return False
        want = self.expected_rows[i] if self.expected_rows else None
        return want is None or self.rows.get(i, want) == want

    def _read(self, have: dict) -> None:
        self.counts = {int(k): int(v) for k, v in have.get("positions", {}).items()}
        self.rows = {int(k): int(v) for k, v in have.get("rows", {}).items()}

    @property
    def complete(self) -> bool:
        return all(self.done(i) for i in range(self.num_shards))

    def write(self, i: int, shard: Shard) -> None:
        self.counts.pop(i, None)
        self.rows.pop(i, None)
        tmp = self.shard_path(i).with_suffix(".tmp")
        save_file({"tokens": shard.tokens.to(torch.int32).contiguous(),
                   "targets": shard.targets.to(torch.int32).contiguous(),
                   "hidden": shard.hidden.to(_stored(shard.hidden.dtype)).contiguous(),
                   "first": shard.first.to(torch.int32).contiguous(),
                   "length": shard.length.to(torch.int32).contiguous()}, str(tmp))
        os.replace(tmp, self.shard_path(i))

    def record(self, counts: dict[int, int], rows: Optional[dict[int, int]] = None) -> None:
        """Add finished shards to the manifest (one writer: rank 0 after every rank wrote its shards)."""
        self.counts.update(counts)
        self.rows.update(rows or {})
        self._write_manifest()

    def count_unrecorded(self) -> None:
        """Count the shards on disk the manifest does not list (written by other ranks, or just before an
        interruption) and record them."""
        from safetensors import safe_open

        new, rows = {}, {}
        for i in range(self.num_shards):
            if self.shard_path(i).is_file() and (i not in self.counts or i not in self.rows):
                with safe_open(str(self.shard_path(i)), "pt") as f:
                    first, length = f.get_tensor("first").tolist(), f.get_tensor("length").tolist()
                new[i], rows[i] = num_positions(first, length), len(length)
        if new:
            self.record(new, rows)

    def load(self, i: int) -> Shard:
        t = load_file(str(self.shard_path(i)))
        return Shard(t["tokens"].long(), t["targets"].long(), t["hidden"], t["first"].long(), t["length"].long())

    def refresh(self) -> None:
        self._read(json.loads((self.root / MANIFEST).read_text()))

    @property
    def total_positions(self) -> int:
        return sum(self.counts.get(i, 0) for i in range(self.num_shards))

    def _write_manifest(self) -> None:
        # every torchrun rank opens the corpus and writes the manifest: a temporary name of its own, or one rank's
        # os.replace finds the file the other already moved (FileNotFoundError; seen as a flaky two-process run)
        tmp = self.root / f"{MANIFEST}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"format": FORMAT, "spec": self.spec, "num_shards": self.num_shards,
                                   "positions": {str(k): v for k, v in sorted(self.counts.items())},
                                   "rows": {str(k): v for k, v in sorted(self.rows.items())}}, indent=2))
        os.replace(tmp, self.root / MANIFEST)


def _stored(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32


def _diff(old: Optional[dict], new: dict) -> str:
    if not isinstance(old, dict):
        return "no readable spec"
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    return ", ".join(f"{k}: {old.get(k)!r} there, {new.get(k)!r} now" for k in keys[:3]) or "shard count differs"


def batch_schedule(corpus: ShardedCorpus, batch_size: int, seed: int, group: int,
                   start_step: int = 0) -> Iterator[tuple[int, Shard, torch.Tensor]]:
    """Endless (step, shard group, positions [batch, 3] = (shard-in-group, row, t)) from `start_step` on.

    Epoch e visits the shards in an order seeded by (seed, e), `group` shards at a time; each group's positions
    are shuffled (seeded by (seed, e, group)) and cut into full batches (a remainder smaller than a batch is left
    out of that epoch). The schedule depends only on the manifest's counts, so skipping to `start_step` loads
    nothing before it.
    """
    counts = [corpus.counts[i] for i in range(corpus.num_shards)]
    if sum(counts) < batch_size:
        raise UserError(f"the corpus holds {sum(counts)} drafting positions, fewer than one batch of {batch_size}; "
                        f"generate more sequences (--num-sequences, --seq-len) or lower --batch-size.")
    step, epoch = 0, 0
    while True:
        order = torch.randperm(corpus.num_shards, generator=torch.Generator().manual_seed(seed * 7919 + epoch))
        groups = [order[i:i + group].tolist() for i in range(0, len(order), group)]
        for gi, shards in enumerate(groups):
            n_batches = sum(counts[s] for s in shards) // batch_size
            if step + n_batches <= start_step:
                step += n_batches
                continue
            loaded = [corpus.load(s) for s in shards]
            pos = torch.cat([torch.cat([torch.full((len(p), 1), k), p], 1)
                             for k, p in enumerate(sh.positions() for sh in loaded)])
            perm = torch.randperm(len(pos), generator=torch.Generator().manual_seed(
                (seed * 7919 + epoch) * 104729 + gi))
            pos = pos[perm]
            for b in range(n_batches):
                if step >= start_step:
                    yield step, loaded, pos[b * batch_size:(b + 1) * batch_size]
                step += 1
            del loaded
        epoch += 1


def gather(loaded: list[Shard], pos: torch.Tensor, T: int, embed: torch.Tensor, device: torch.device,
           teacher: bool = False):
    """(h [B, H], embs [B, T, H], targets [B, T]) for positions (shard-in-group, row, t); with `teacher`, a fourth
    tensor [B, T, H]: the base's hidden states at t+1..t+T, whose logits are each step's teacher distribution (its
    argmax is the target)."""
    hs, xs, ys, ns = [], [], [], []
    order = []
    for k, sh in enumerate(loaded):
        sel = (pos[:, 0] == k).nonzero().flatten()
        if not len(sel):
            continue
        order.append(sel)
        rows, t = pos[sel, 1], pos[sel, 2]
        width = sh.tokens.shape[1]
        cols = t[:, None] + torch.arange(1, T + 1)[None, :]
        ok = cols < sh.length[rows][:, None]
        cols_c = cols.clamp(max=width - 1)
        xs.append(sh.tokens[rows[:, None], cols_c])
        ys.append(sh.targets[rows[:, None], cols_c].masked_fill(~ok, -100))
        hs.append(sh.hidden[rows, t].float())
        if teacher:
            ns.append(sh.hidden[rows[:, None], cols_c].float())
    inv = torch.argsort(torch.cat(order))  # back to the batch's own order
    h, x, y = torch.cat(hs)[inv], torch.cat(xs)[inv], torch.cat(ys)[inv]
    out = (h.to(device), embed[x.to(device)], y.to(device))
    if teacher:
        out += (torch.cat(ns)[inv].to(device),)
    return out


def eval_batches(corpus: ShardedCorpus, batch: int) -> Iterator[tuple[list[Shard], torch.Tensor]]:
    """Every drafting position once, one shard at a time, in order."""
    for i in range(corpus.num_shards):
        sh = corpus.load(i)
        p = sh.positions()
        p = torch.cat([torch.zeros(len(p), 1, dtype=torch.long), p], 1)
        for lo in range(0, len(p), batch):
            yield [sh], p[lo:lo + batch]


@torch.no_grad()
def generate_shard(model, prompts: list[list[int]], max_new: int, stop_ids: Optional[list[int]], pad_id: int,
                   device: torch.device) -> Shard:
    """The base's greedy answers to `prompts` (left-padded into one batch), with its final-norm hidden states and
    its argmaxes, both taken from the generation itself (a hook on the final norm): no second forward pass, and
    each hidden state is the one auto-regressive decoding computes (with a KV cache, as the engine does).

    `stop_ids` None: exactly `max_new` tokens (eos ignored); else a row ends after its first stop token. The
    target at a row's last token (the prediction after it) is not known and is left out (-100).
    """
    b, plen = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((b, plen), pad_id, dtype=torch.long)
    mask = torch.zeros(b, plen, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, plen - len(p):] = torch.tensor(p)
        mask[r, plen - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    kw = dict(min_new_tokens=max_new, eos_token_id=None) if stop_ids is None else dict(eos_token_id=stop_ids)
    steps: list[torch.Tensor] = []
    hook = model.model.norm.register_forward_hook(lambda _m, _i, out: steps.append(out.float().cpu()))
    try:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False, pad_token_id=pad_id,
                             **kw)
    finally:
        hook.remove()
    gen = out[:, plen:].cpu()
    hidden_all = torch.cat(steps, dim=1)  # [b, plen + n_gen - 1, H]: every position but the last token's
    if hidden_all.shape[1] != out.shape[1] - 1:
        raise RuntimeError(f"captured {hidden_all.shape[1]} hidden states for {out.shape[1]} tokens")
    lengths = []
    for r, p in enumerate(prompts):
        n = gen.shape[1]
        if stop_ids is not None:
            hit = torch.isin(gen[r], torch.tensor(stop_ids)).nonzero()
            n = int(hit[0]) + 1 if len(hit) else n
        lengths.append(len(p) + n)
    W = max(lengths)
    tokens = torch.full((b, W), pad_id, dtype=torch.long)
    targets = torch.full((b, W), -100, dtype=torch.long)
    hidden = torch.zeros(b, W, hidden_all.shape[-1], dtype=torch.float32)
    out = out.cpu()
    for r, p in enumerate(prompts):
        lo, n = plen - len(p), lengths[r]
        tokens[r, :n] = out[r, lo:lo + n]
        targets[r, :n - 1] = out[r, lo + 1:lo + n]  # greedy: the base's argmax at t is token t+1
        hidden[r, :n - 1] = hidden_all[r, lo:lo + n - 1]
    first = torch.tensor([len(p) - 1 for p in prompts])
    return Shard(tokens, targets, hidden, first, torch.tensor(lengths))


def build(corpus: ShardedCorpus, prompts_for: Callable[[int], list[list[int]]], generator, max_new: int,
          stop_ids: Optional[list[int]], pad_id: int, rank: int = 0, world: int = 1, desc: str = "corpus",
          progress: bool = True) -> dict[int, int]:
    """Generate this rank's missing shards (i % world == rank) with `generator` (generation.EngineGenerator or
    HFGenerator). Returns {shard: positions} of the shards written."""
    from tqdm.auto import tqdm

    todo = [i for i in range(corpus.num_shards) if i % world == rank and not corpus.done(i)]
    written = {}
    with tqdm(total=len(todo), desc=desc, unit="shard", disable=not progress or not todo) as bar:
        for i, shard in generator.shards(todo, prompts_for, max_new, stop_ids, pad_id):
            corpus.write(i, shard)
            written[i] = num_positions(shard.first.tolist(), shard.length.tolist())
            if world == 1:
                corpus.record({i: written[i]}, {i: len(shard.length)})
            bar.update(1)
    if world == 1:
        corpus.count_unrecorded()
    return written
