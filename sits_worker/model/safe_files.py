"""Opening a job's folders and files without following symbolic links.

A job's input and output paths were resolved and checked against the roots at submit, so none of their
components was a symbolic link then. One swapped in later (a tenant's folder replaced by a link out of
its roots) must lead nowhere: `open_folder` walks a path from `/` one component at a time, each opened
relative to its parent with `O_NOFOLLOW`, and a `Folder` opens, creates, renames and removes files
relative to its descriptor, never following a link either. A link found fails the job (PathNotAllowed).
A folder held by descriptor stays the one checked whatever is renamed above it afterwards.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from broker.errors import BadInput, PathNotAllowed

_NO_FOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
_FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | _NO_FOLLOW
_PASSED_FLAGS = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | _NO_FOLLOW
"""The folders on the way to one: O_PATH (Linux) needs only the search permission a path lookup needs,
not the read permission of O_RDONLY (a home folder of mode 0711 is passed, not listed)."""
_LINK_ERRNOS = frozenset({errno.ELOOP, errno.ENOTDIR, errno.EMLINK})
"""What opening a symbolic link with O_NOFOLLOW fails with: ELOOP (ENOTDIR with O_DIRECTORY; EMLINK on BSDs)."""


def symlink_found(link: Path, what: str, path: Path, fix: str) -> PathNotAllowed:
    """The error for a symbolic link found at `link`, on the way to `what` at `path` or in it."""
    if link == path:
        found = f"{what} '{path}' is a symbolic link"
    elif link in path.parents:
        found = f"{what} '{path}' lies under '{link}', a symbolic link"
    else:
        found = f"'{link}' in {what} '{path}' is a symbolic link"
    return PathNotAllowed(f"{found}; it was not one when the job was submitted, and workers never read or "
                          f"write through one (it may lead out of the roots): {fix}")


@dataclass(frozen=True)
class _Place:
    """What is opened and what to do when a link is found there, for the error's message."""

    what: str
    path: Path
    fix: str

    def refused(self, link: Path) -> PathNotAllowed:
        return symlink_found(link, self.what, self.path, self.fix)


def _is_link(name: str, dir_fd: int | None) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _open_at(name: str, flags: int, mode: int, dir_fd: int | None, place: _Place, shown: Path) -> int:
    """os.open of `name` without following a link there: a link is `place`'s PathNotAllowed."""
    try:
        return os.open(name, flags | _NO_FOLLOW, mode, dir_fd=dir_fd)
    except OSError as err:
        if err.errno in _LINK_ERRNOS and _is_link(name, dir_fd):
            raise place.refused(shown) from err
        raise


def _entry_name(name: str) -> str:
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise ValueError(f"{name!r} is not one entry of a folder")
    return name


class Folder:
    """A folder opened without following symbolic links (`open_folder`); every file in it is opened,
    created, renamed and removed relative to its descriptor, none through a link. Close it after use."""

    def __init__(self, fd: int, path: Path, place: _Place) -> None:
        self.fd, self.path, self._place = fd, path, place

    def __enter__(self) -> Folder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the descriptor (again: nothing)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __truediv__(self, name: str) -> Entry:
        return Entry(self, _entry_name(name))

    def sub(self, name: str, *, create: bool = False) -> Folder:
        """The folder `name` in this one, made first when missing and `create`; a link there is refused."""
        return Folder(_open_step(self.fd, _entry_name(name), create, self._place, self.path / name),
                      self.path / name, self._place)

    def open(self, name: str, flags: int, mode: int = 0o666) -> int:
        """os.open of the entry `name` (`flags` plus O_NOFOLLOW); a link there is refused."""
        return _open_at(_entry_name(name), flags, mode, self.fd, self._place, self.path / name)

    def read_file(self, name: str) -> BinaryIO:
        """The file `name` opened for reading."""
        return os.fdopen(self.open(name, os.O_RDONLY), "rb")

    def create_new(self, name: str) -> BinaryIO:
        """A new file `name` (none may be there, not even a link) opened for writing; mode 0o666 less
        the umask, as a file written by path gets (mkstemp's are 0o600)."""
        return os.fdopen(self.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "wb")

    def read_bytes(self, name: str) -> bytes:
        """The bytes of the file `name`."""
        with self.read_file(name) as handle:
            return handle.read()

    def replace(self, name: str, target: Folder, target_name: str) -> None:
        """Rename `name` to `target_name` in `target`; a link at `target_name` is replaced, never followed."""
        os.replace(_entry_name(name), _entry_name(target_name), src_dir_fd=self.fd, dst_dir_fd=target.fd)

    def unlink(self, name: str) -> None:
        """Remove the entry `name` (a link itself, not what it points to); missing is fine."""
        try:
            os.unlink(_entry_name(name), dir_fd=self.fd)
        except FileNotFoundError:
            pass

    def refuse_link(self, name: str) -> None:
        """PathNotAllowed when the entry `name` is a symbolic link."""
        if _is_link(_entry_name(name), self.fd):
            raise self._place.refused(self.path / name)

    def is_folder(self, name: str) -> bool:
        """Whether `name` is a folder itself (a link to one is not)."""
        try:
            return stat.S_ISDIR(os.stat(_entry_name(name), dir_fd=self.fd, follow_symlinks=False).st_mode)
        except FileNotFoundError:
            return False

    def names(self) -> list[str]:
        """The names of the entries in the folder."""
        return os.listdir(self.fd)

    def remove_tree(self, name: str) -> None:
        """Remove the folder `name` and everything under it, following no link (errors ignored)."""
        shutil.rmtree(_entry_name(name), ignore_errors=True, dir_fd=self.fd)

    def remove_if_empty(self, name: str) -> None:
        """Remove the folder `name` if it is empty; otherwise, or if it is gone, nothing."""
        try:
            os.rmdir(_entry_name(name), dir_fd=self.fd)
        except OSError:
            pass

    def fsync(self) -> None:
        """Make the folder's entries durable."""
        os.fsync(self.fd)


@dataclass(frozen=True)
class Entry:
    """A name in an opened folder (`folder / name`)."""

    folder: Folder
    name: str

    def __str__(self) -> str:
        return str(self.folder.path / self.name)


def _open_step(parent_fd: int, name: str, create: bool, place: _Place, shown: Path,
               flags: int = _FOLDER_FLAGS) -> int:
    """The folder `name` in `parent_fd` opened without following a link; made first if missing and `create`."""
    try:
        return _open_at(name, flags, 0, parent_fd, place, shown)
    except FileNotFoundError:
        if not create:
            raise
    try:
        os.mkdir(name, dir_fd=parent_fd)  # mkdir never follows a link: one put there meanwhile is EEXIST
    except FileExistsError:
        pass
    return _open_at(name, flags, 0, parent_fd, place, shown)


def open_folder(path: Path, *, what: str, fix: str, create: bool = False) -> Folder:
    """The folder at `path`, every component of it opened relative to its parent without following a
    link (a relative path starts at the working folder); missing ones are made if `create`.

    PathNotAllowed naming `what` and saying `fix` when a component is a symbolic link; OSError for anything
    else (missing, not a folder, not allowed). A path that was resolved when it was checked has no link,
    so a link found on the way was swapped in since.
    """
    path = Path(path)
    place = _Place(what, path, fix)
    start = path.anchor or "."
    names = path.parts[1:] if path.anchor else path.parts
    # (the root or working folder: no name to swap)
    fd = os.open(start, (_PASSED_FLAGS if names else _FOLDER_FLAGS) & ~os.O_NOFOLLOW)
    walked = Path(start)
    try:
        for depth, name in enumerate(names, 1):
            walked = walked / name
            child = _open_step(fd, name, create, place, walked, _FOLDER_FLAGS if depth == len(names) else _PASSED_FLAGS)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return Folder(fd, path, place)


def open_file(path: Path, *, what: str, fix: str) -> BinaryIO:
    """The regular file at `path` opened for reading without following a link in its last component
    (PathNotAllowed naming `what`, saying `fix`); the folders above it are the caller's to check (an
    input's recorded identity, compared with `os.fstat` of the handle, tells any other file apart)."""
    path = Path(path)
    fd = _open_at(str(path), os.O_RDONLY | os.O_NONBLOCK, 0, None, _Place(what, path, fix), path)
    try:  # O_NONBLOCK: a FIFO swapped in does not hang the open; it changes nothing for a regular file
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise BadInput(f"cannot read '{path}' (not a regular file); it must be a readable regular file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
