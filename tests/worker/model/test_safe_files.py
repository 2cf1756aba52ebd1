"""Folders and files opened without following symbolic links: a link where a folder or file was is refused,
and nothing is made, written or removed where it points."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from broker.errors import BadInput, PathNotAllowed
from sits_worker.model.safe_files import open_file, open_folder
from tests.file_trees import tree

FIX = "put it back"


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A folder out of reach, holding a sentinel file."""
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "logits.npy").write_bytes(b"sentinel")
    return folder


def test_a_folder_that_is_a_link_is_refused_and_nothing_is_made_where_it_points(tmp_path: Path,
                                                                                outside: Path) -> None:
    (tmp_path / "out").symlink_to(outside)
    before = tree(outside)

    with pytest.raises(PathNotAllowed, match=r"output folder '.*/out' is a symbolic link.*put it back"):
        open_folder(tmp_path / "out", what="output folder", fix=FIX, create=True)
    with pytest.raises(PathNotAllowed, match=r"'.*/out/\.parts/j1' lies under '.*/out', a symbolic link"):
        open_folder(tmp_path / "out" / ".parts" / "j1", what="output folder", fix=FIX, create=True)

    assert tree(outside) == before


def test_missing_folders_are_made_one_by_one_and_entries_are_handled_relative_to_the_folder(tmp_path: Path) -> None:
    with open_folder(tmp_path / "a" / "b", what="folder", fix=FIX, create=True) as folder, \
            folder.sub("c", create=True) as inner:
        with inner.create_new("x.tmp") as handle:
            handle.write(b"data")
        inner.replace("x.tmp", folder, "x")
        assert folder.read_bytes("x") == b"data" and sorted(folder.names()) == ["c", "x"]
        assert folder.is_folder("c") and not folder.is_folder("x")
        folder.unlink("x")
        folder.unlink("x")  # missing is fine

    assert tree(tmp_path) == {"a": None, "a/b": None, "a/b/c": None}


def test_a_link_inside_an_opened_folder_is_refused_for_every_open(tmp_path: Path, outside: Path) -> None:
    folder_path = tmp_path / "out"
    folder_path.mkdir()
    (folder_path / ".parts").symlink_to(outside)
    (folder_path / "manifest.json").symlink_to(outside / "logits.npy")
    before = tree(outside)

    with open_folder(folder_path, what="output folder", fix=FIX) as folder:
        with pytest.raises(PathNotAllowed, match=r"'.*/out/\.parts' in output folder '.*/out' is a symbolic link"):
            folder.sub(".parts", create=True)
        with pytest.raises(PathNotAllowed, match=r"'.*/out/manifest\.json' in output folder '.*/out' is a symbolic"):
            folder.read_bytes("manifest.json")
        with pytest.raises(PathNotAllowed, match="is a symbolic link"):
            folder.refuse_link("manifest.json")
        with pytest.raises(FileExistsError):  # a new file never opens what a link points to
            folder.create_new("manifest.json")
        folder.refuse_link("absent")  # not a link: nothing to say

    assert tree(outside) == before


def test_renaming_over_or_removing_a_link_never_touches_what_it_points_to(tmp_path: Path, outside: Path) -> None:
    folder_path = tmp_path / "out"
    folder_path.mkdir()
    (folder_path / "logits.npy").symlink_to(outside / "logits.npy")
    (folder_path / "quarantine.jsonl").symlink_to(outside / "logits.npy")
    (folder_path / "new").write_bytes(b"mine")
    before = tree(outside)

    with open_folder(folder_path, what="output folder", fix=FIX) as folder:
        folder.replace("new", folder, "logits.npy")
        folder.unlink("quarantine.jsonl")
        folder.remove_tree("quarantine.jsonl")  # (not a folder: nothing)

    assert tree(outside) == before
    assert tree(folder_path) == {"logits.npy": b"mine"}


def test_a_folder_held_open_stays_the_one_checked_when_its_path_is_swapped_afterwards(tmp_path: Path,
                                                                                      outside: Path) -> None:
    before = tree(outside)
    folder_path = tmp_path / "out"
    folder_path.mkdir()

    with open_folder(folder_path, what="output folder", fix=FIX) as folder:
        folder_path.rename(tmp_path / "moved")
        folder_path.symlink_to(outside)
        with folder.create_new("part") as handle:
            handle.write(b"rows")

    assert tree(outside) == before
    assert (tmp_path / "moved" / "part").read_bytes() == b"rows"


def test_removing_a_tree_whose_folder_is_a_link_removes_nothing_where_it_points(tmp_path: Path,
                                                                                outside: Path) -> None:
    (tmp_path / "parts").mkdir()
    (tmp_path / "parts" / "j1").symlink_to(outside)
    before = tree(outside)

    with open_folder(tmp_path / "parts", what="output folder", fix=FIX) as folder:
        folder.remove_tree("j1")
        folder.remove_if_empty("j1")

    assert tree(outside) == before


def test_a_file_that_is_a_link_is_refused(tmp_path: Path, outside: Path) -> None:
    (tmp_path / "in.npy").symlink_to(outside / "logits.npy")

    with pytest.raises(PathNotAllowed, match=r"input '.*/in\.npy' is a symbolic link; .*put it back"):
        open_file(tmp_path / "in.npy", what="input", fix=FIX)
    with open_file(outside / "logits.npy", what="input", fix=FIX) as handle:
        assert handle.read() == b"sentinel"


def test_a_fifo_in_place_of_a_file_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "in.npy")
    refused: list[BaseException] = []

    def read() -> None:
        try:
            open_file(tmp_path / "in.npy", what="input", fix=FIX)
        except BadInput as err:
            refused.append(err)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(5)
    if reader.is_alive():  # (unblock it before failing)
        os.close(os.open(tmp_path / "in.npy", os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("opening a FIFO waited for a writer")
    assert len(refused) == 1 and "not a regular file" in str(refused[0])
