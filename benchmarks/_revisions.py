"""Another git revision's source, written out beside this checkout, for benchmarks that compare it side by
side with this one in one run."""

from __future__ import annotations

import re
import subprocess
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def extract(rev: str, paths: list[str], into: Path) -> Path:
    """The folders ``paths`` of git revision ``rev``, written under ``into`` (returned)."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, *paths], capture_output=True, check=True
    ).stdout
    with tempfile.TemporaryFile() as tar_file:
        tar_file.write(archive)
        tar_file.seek(0)
        with tarfile.open(fileobj=tar_file) as tar:
            tar.extractall(into, filter="data")
    return into


def extract_base(rev: str, into: Path) -> None:
    """Write ``distsync/`` of ``rev`` to ``into/distsync_base``, its imports of itself renamed to match (older
    revisions import their modules relatively, newer ones by ``distsync.``: both stay within the base), so
    that it imports beside this checkout's ``distsync``."""
    extract(rev, ["distsync"], into)
    (into / "distsync").rename(into / "distsync_base")
    for module in (into / "distsync_base").rglob("*.py"):
        text = module.read_text()
        renamed = re.sub(r"^(\s*)import distsync$", r"\1import distsync_base as distsync", text, flags=re.M)
        renamed = re.sub(r"^(\s*)from distsync(?=[.\s])", r"\1from distsync_base", renamed, flags=re.M)
        if renamed != text:
            module.write_text(renamed)
