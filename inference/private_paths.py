"""Owner and mode checks for paths whose contents we trust: code we build and load, the folder of a
socket clients hand their keys to, files holding keys.

A folder that someone else may write to lets them replace what is in it (another library, another
socket) between our check and our use; a folder above it that they may write to lets them rename the
whole folder. The rules are OpenSSH's StrictModes: each folder belongs to this user or root, and
nobody else may write to it unless it is sticky (/tmp: others cannot rename or remove what is ours).
A socket's own folder must be closed to others even when sticky: in /tmp anyone may bind a name first.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import stat
from pathlib import Path

OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
OTHERS_ANY = stat.S_IRWXG | stat.S_IRWXO


def mode_of(st: os.stat_result) -> str:
    return f"{stat.S_IMODE(st.st_mode):04o}"


def folder_problem(path: Path, owners: tuple[int, ...] | None = None) -> str | None:
    """Why another user could change what folder `path` holds (it or a folder above it belongs to someone
    other than `owners`, default this user or root, or others may write to it and it is not sticky), or None."""
    owners = _trusted(owners)
    for folder in (path, *path.parents):
        try:
            st = folder.stat()  # a link is judged by where it leads: that is the folder used
        except OSError as exc:
            return f"cannot check {folder}: {exc.strerror or exc}"
        if st.st_uid not in owners:
            return f"{folder} belongs to {user_text(st.st_uid)}, not {_owners_text(owners)}"
        if st.st_mode & OTHERS_WRITE and not st.st_mode & stat.S_ISVTX:
            return f"{folder} may be written by others (mode {mode_of(st)}) and is not sticky"
    return None


def user_text(uid: int) -> str:
    """`uid 65534 (nobody)`: the number, and the name where this machine has one."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def owner_problem(st: os.stat_result) -> str | None:
    """Why a file holding secrets, given its stat, is not this user's or root's (whoever owns it may change
    it, or read it after a chmod), or None."""
    uid = os.getuid()
    if st.st_uid in (uid, 0):
        return None
    return f"it belongs to {user_text(st.st_uid)}, not this user ({uid}) or root"


def _trusted(owners: tuple[int, ...] | None) -> tuple[int, ...]:
    return (os.getuid(), 0) if owners is None else owners


def _owners_text(owners: tuple[int, ...]) -> str:
    uid = os.getuid()
    return " or ".join(f"this user ({u})" if u == uid else "root" if u == 0 else f"uid {u}"
                       for u in dict.fromkeys(owners))


def closed_folder_problem(path: Path, owners: tuple[int, ...] | None = None) -> str | None:
    """Why someone other than `owners` (default this user or root) could add an entry to folder `path` (a
    socket of theirs at a name we use), or rename it or a folder above it; or None. Stricter than
    folder_problem on `path` itself: nobody else may write to it, sticky or not (in a sticky folder such
    as /tmp anyone may create a name first)."""
    owners = _trusted(owners)
    try:
        st = path.stat()
    except OSError as exc:
        return f"cannot check {path}: {exc.strerror or exc}"
    if st.st_mode & OTHERS_WRITE:
        sticky = ": sticky, yet anyone may create a name there first" if st.st_mode & stat.S_ISVTX else ""
        return f"{path} may be written by others (mode {mode_of(st)}{sticky})"
    if st.st_uid not in owners:
        return f"{path} belongs to {user_text(st.st_uid)}, not {_owners_text(owners)}"
    return folder_problem(path.parent, owners) if path.parent != path else None


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
