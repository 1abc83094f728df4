"""Owner and mode checks for paths whose contents we trust: code we build and load, the folder of a
socket clients hand their keys to, files holding keys.

The folder checks the client also needs (folder_problem, closed_folder_problem: OpenSSH's StrictModes
rules) live in the client's distribution (embedcar_client/private_paths.py); these build on them for the
files and folders the server reads secrets and code from.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from embedcar_client.private_paths import OTHERS_WRITE, folder_problem, mode_of, user_text

OTHERS_ANY = stat.S_IRWXG | stat.S_IRWXO


def owner_problem(st: os.stat_result) -> str | None:
    """Why a file holding secrets, given its stat, is not this user's or root's (whoever owns it may change
    it, or read it after a chmod), or None."""
    uid = os.getuid()
    if st.st_uid in (uid, 0):
        return None
    return f"it belongs to {user_text(st.st_uid)}, not this user ({uid}) or root"


def private_dir_problem(path: Path) -> str | None:
    """`path` created where missing (each missing level 0700); why it is not a folder only this user can
    change (a link, not ours, writable by others, or a folder above fails folder_problem), or None."""
    path = path.absolute()
    try:
        for level in reversed((path, *path.parents)):
            if not level.is_dir():
                with contextlib.suppress(FileExistsError):
                    level.mkdir(0o700)
        st = path.lstat()
    except OSError as exc:
        return f"cannot create {path}: {exc.strerror or exc}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is a link or a file, not a folder"
    if st.st_uid != os.getuid():
        return f"{path} belongs to {user_text(st.st_uid)}, not this user ({os.getuid()})"
    if st.st_mode & OTHERS_WRITE:
        return f"{path} may be written by others (mode {mode_of(st)}): chmod 700 it"
    return folder_problem(path.parent)


def owned_file_problem(path: Path) -> str | None:
    """Why `path` is not a regular file (not a link) of this user that only this user may write, or None."""
    try:
        st = path.lstat()
    except OSError as exc:
        return f"cannot check {path}: {exc.strerror or exc}"
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file"
    if st.st_uid != os.getuid() or st.st_mode & OTHERS_WRITE:
        return f"{path} is not this user's alone (uid {st.st_uid}, mode {mode_of(st)})"
    return None


def read_private_text(path: Path, what: str, *, chmod_hint: str = "chmod 600 it", owner_hint: str = "") -> str:
    """The text of `path`, a file holding secrets. Refused (InvalidInput naming the file as `what`, never its
    content) where it is not a regular file, group or others may read or write it, or another user than this
    one or root owns it (who could change it), all checked on the file as opened."""
    from inference.errors import InvalidInput

    try:
        with path.open() as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise InvalidInput(f"{what} {path} is not a regular file")
            if st.st_mode & OTHERS_ANY:
                raise InvalidInput(f"refusing {what} {path}: group or others may read or write it "
                                   f"(mode {mode_of(st)}): {chmod_hint}")
            if (problem := owner_problem(st)) is not None:
                raise InvalidInput(f"refusing {what} {path}: {problem}{owner_hint}")
            return f.read()
    except OSError as exc:
        raise InvalidInput(f"cannot read {what} {path}: {exc.strerror or exc}") from exc
