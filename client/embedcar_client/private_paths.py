"""Owner and mode checks on the folders above a path, as the client needs them for a Unix socket it hands
its API key to (embedcar_client.client.check_unix_target); the server's own checks on files and folders
it trusts (inference/private_paths.py) build on these.

A folder that someone else may write to lets them replace what is in it (another socket) between our
check and our use; a folder above it that they may write to lets them rename the whole folder. The rules
are OpenSSH's StrictModes: each folder belongs to this user or root, and nobody else may write to it
unless it is sticky (/tmp: others cannot rename or remove what is ours). A socket's own folder must be
closed to others even when sticky: in /tmp anyone may bind a name first.
"""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path

OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


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
