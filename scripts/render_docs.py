#!/usr/bin/env python3
"""Rewrite the generated tables of docs/perf.md, docs/models.md and docs/serving.md from the JSON in docs/perf/.

    python scripts/render_docs.py            # rewrite the tables between their markers; prints the docs it changed
    python scripts/render_docs.py --check    # exit 1 if a doc's tables differ from what its JSON renders

Which table reads which JSON: trt_redrafter/bench/docs_tables.py (TABLES). A new measurement becomes the current
table by committing its JSON and pointing the table at it there; the figures it replaces go to docs/perf-history.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trt_redrafter.bench.docs_tables import stale_docs, write_docs
from trt_redrafter.errors import EXIT_USER_ERROR, UserError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table is out of date")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1],
                        help="the repository root (default: this checkout)")
    args = parser.parse_args(argv)
    try:
        if args.check:
            stale = stale_docs(args.root)
            for doc in stale:
                print(f"{doc}: its tables differ from what docs/perf/*.json renders; "
                      f"run python scripts/render_docs.py", file=sys.stderr)
            return 1 if stale else 0
        for doc in write_docs(args.root):
            print(f"rewrote the tables of {doc}")
        return 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
