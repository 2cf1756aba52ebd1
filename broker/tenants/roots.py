"""Where a tenant's keys may read and write files: its own roots, else its folder under each global root.

A path a request names (a model to register, a job's input and output folder) must lie inside the
roots of the caller: an admin key's are the global `paths.*_roots`; a tenant's key's are its
tenant's `tenants.<name>.*_roots` where set, else `<root>/<tenant>` under each global root. So no
tenant reads another's inputs or writes into another's folders, and a path in another tenant's
folder is refused before anything tells whether a file is there, exactly as a path nowhere is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from broker.tenants.records import TENANT_PATTERN
from broker.tenants.settings import Tenant

FileKind = Literal["model", "input", "output"]


@dataclass(frozen=True)
class Roots:
    """The folders a caller's paths of one kind must lie in, and the setting that says so (for messages)."""

    folders: tuple[Path, ...]
    setting: str

    def holds(self, path: Path) -> bool:
        """Whether the resolved `path` lies inside one of the folders (or is one)."""
        return any(path == root or root in path.parents for root in self.folders)


def roots_for(kind: FileKind, *, global_roots: tuple[Path, ...], tenant_name: str, tenant: Tenant | None,
              admin: bool) -> Roots:
    """The roots of `kind` of a caller: global for an admin key; else its tenant's own (`tenant`'s
    `<kind>_roots`), else its folder under each global root. A tenant name that is no safe folder name
    (a key made without a tenant takes its name as its tenant, and key names are free text) has no
    folder: such a tenant reads and writes nothing until its roots are set."""
    if admin:
        return Roots(global_roots, f"paths.{kind}_roots")
    own = getattr(tenant, f"{kind}_roots") if tenant is not None else None
    if own:
        return Roots(tuple(own), f"tenants.{tenant_name}.{kind}_roots")
    folders = tuple(root / tenant_name for root in global_roots) if TENANT_PATTERN.fullmatch(tenant_name) else ()
    return Roots(folders, f"tenants.{tenant_name}.{kind}_roots (unset: the tenant's folder under each of "
                          f"paths.{kind}_roots)")
