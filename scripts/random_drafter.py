"""A drafter that is never right, for measuring what speculation costs when nothing is accepted: every floating tensor
of DRAFTER replaced by Gaussian noise of that tensor's own standard deviation (so activations keep their scale), its
config and draft vocabulary kept.

    python scripts/random_drafter.py --drafter models/smollm2-drafter-fr --output out/perf/random-drafter [--seed 0]
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", required=True, type=Path)
    ap.add_argument("--output", required=True, type=Path)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    src = args.drafter / "model.safetensors"
    if not src.is_file():
        print(f"random_drafter: {src} is missing", file=sys.stderr)
        return 2
    g = torch.Generator().manual_seed(args.seed)
    tensors = load_file(str(src))
    out = {}
    for name, t in tensors.items():
        if t.is_floating_point():
            std = t.float().std() if t.numel() > 1 else torch.tensor(0.02)
            out[name] = (torch.randn(t.shape, generator=g) * std).to(t.dtype)
        else:
            out[name] = t
    tmp = args.output.with_name(f".{args.output.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shutil.copy(args.drafter / "config.json", tmp / "config.json")
    save_file(out, str(tmp / "model.safetensors"))
    shutil.rmtree(args.output, ignore_errors=True)
    tmp.rename(args.output)
    print(f"random drafter written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
