"""Where results go: outputs checked before the work that makes them, and written whole or not at all.

A simulation, a search or a run on Ray can take minutes; an output path that cannot be written is
refused before it starts, in one line, and a write that fails part-way leaves nothing behind.
"""
from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path
from typing import Optional

from simexec.errors import OutputError


def check_output(path: str | os.PathLike, what: str, folder: bool = False) -> Path:
    """Refuse an output that cannot be written: a file where a folder is wanted or the reverse, or
    a place under no writable folder. Missing folders are made when it is written."""
    path = Path(path)
    if folder and path.exists() and not path.is_dir():
        raise OutputError(f"{what} {path}: is a file, not a folder")
    if not folder and path.is_dir():
        raise OutputError(f"{what} {path}: is a folder, not a file")
    base = path if folder else path.parent
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        raise OutputError(f"{what} {path}: {base} is a file, not a folder")
    if not os.access(base, os.W_OK | os.X_OK):
        raise OutputError(f"{what} {path}: folder {base} is not writable")
    return path


def write_atomic(path: str | os.PathLike, data: bytes) -> Path:
    """Write `data` to `path` through a temporary file renamed into place, making missing folders."""
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        name = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as to open()
        tmp = name
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}") from None
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
    return path


def outputs_refused(prog: str, files: Optional[dict] = None, folders: Optional[dict] = None) -> bool:
    """For scripts whose run takes minutes: check each given output (flag -> path; None when not
    given) and print the first that cannot be written as `prog: error: ...`. True if one was refused."""
    try:
        for flags, folder in ((files or {}, False), (folders or {}, True)):
            for flag, path in flags.items():
                if path:
                    check_output(path, flag, folder=folder)
    except OutputError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return True
    return False
