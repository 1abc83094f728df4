"""Owner and mode checks for paths whose contents we trust: code we build and load, the folder of a
socket clients hand their keys to, files holding keys.

A folder that someone else may write to lets them replace what is in it (another library, another
socket) between our check and our use; a folder above it that they may write to lets them rename the
whole folder. The rules are OpenSSH's StrictModes: each folder belongs to this user or root, and
nobody else may write to it unless it is sticky (/tmp: others cannot rename or remove what is ours).
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
OTHERS_ANY = stat.S_IRWXG | stat.S_IRWXO


def mode_of(st: os.stat_result) -> str:
    return f"{stat.S_IMODE(st.st_mode):04o}"


def folder_problem(path: Path) -> str | None:
    """Why another user could change what folder `path` holds (it or a folder above it belongs to someone
    other than this user or root, or others may write to it and it is not sticky), or None."""
    uid = os.getuid()
    for folder in (path, *path.parents):
        try:
            st = folder.stat()  # a link is judged by where it leads: that is the folder used
        except OSError as exc:
            return f"cannot check {folder}: {exc.strerror or exc}"
        if st.st_uid not in (uid, 0):
            return f"{folder} belongs to uid {st.st_uid}, not this user ({uid}) or root"
        if st.st_mode & OTHERS_WRITE and not st.st_mode & stat.S_ISVTX:
            return f"{folder} may be written by others (mode {mode_of(st)}) and is not sticky"
    return None


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
        return f"{path} belongs to uid {st.st_uid}, not this user ({os.getuid()})"
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
