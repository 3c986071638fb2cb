"""Generated blocks in Markdown documents: the validation scripts rewrite their tables in place."""
from __future__ import annotations

from pathlib import Path

from simexec.outputs import write_atomic


def replace_block(path: Path, block: str, begin: str, end: str, new_doc: str = "") -> None:
    """Put `block` (which starts with `begin` and ends with `end`) where the document's own block is,
    or append it; a missing document starts as `new_doc`."""
    path = Path(path)
    text = path.read_text() if path.exists() else new_doc
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    write_atomic(path, text.encode())
