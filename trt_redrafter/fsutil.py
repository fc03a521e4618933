"""Filesystem helpers: outputs appear whole or not at all."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

from .errors import UserError


@contextlib.contextmanager
def atomic_output_dir(target: str | os.PathLike, force: bool = False, what: str = "output") -> Iterator[Path]:
    """Yield a temporary directory beside `target`; rename it to `target` only if the block succeeds.

    On any exception the temporary directory is removed, so a failed run leaves nothing behind. An existing
    `target` is refused unless `force`, in which case it is replaced only after the new one is complete.
    """
    target = Path(target).absolute()
    if target.exists() and not force:
        raise UserError(f"{what} directory {target} already exists; pass --force to replace it or choose another path.")
    parent = target.parent
    if not parent.is_dir():
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"cannot create the parent directory {parent} of the {what}: {e.strerror}.") from e
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=parent))
    try:
        yield tmp
        _publishable(tmp)
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=parent))
            os.replace(target, old / "x")
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _publishable(root: Path) -> None:
    """mkdtemp makes 0700 dirs (and some writers 0600 files); give the result the usual umask-based modes."""
    umask = os.umask(0)
    os.umask(umask)
    for dirpath, _, files in os.walk(root):
        os.chmod(dirpath, 0o777 & ~umask)
        for f in files:
            os.chmod(os.path.join(dirpath, f), 0o666 & ~umask)


def write_json(path: str | os.PathLike, obj: Any, indent: int = 4) -> None:
    """Write `obj` as JSON through a temporary file beside `path`, renamed over it at the end (never half-written)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=indent)
            f.write("\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_json(path: str | os.PathLike, what: str) -> dict:
    """Read a JSON object, turning a missing or malformed file into one clear `UserError`."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{what}: {path} does not exist.")
    try:
        with open(path) as f:
            obj = json.load(f)
    except OSError as e:
        raise UserError(f"{what}: cannot read {path}: {e.strerror}.") from e
    except json.JSONDecodeError as e:
        raise UserError(f"{what}: {path} is not valid JSON ({e.msg} at line {e.lineno}).") from e
    if not isinstance(obj, dict):
        raise UserError(f"{what}: {path} must hold a JSON object, found {type(obj).__name__}.")
    return obj
