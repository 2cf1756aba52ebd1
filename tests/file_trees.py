"""A folder's whole contents, to show that nothing in it changed (the symlink tests' "nothing written outside")."""

from __future__ import annotations

from pathlib import Path


def tree(folder: Path) -> dict[str, bytes | None]:
    """Every path under `folder` (relative) with its bytes; None for a folder."""
    return {str(path.relative_to(folder)): None if path.is_dir() else path.read_bytes()
            for path in sorted(folder.rglob("*"))}
