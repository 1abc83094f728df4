"""tritonserver's API keys kept off its command line, which every local user can read (`ps`).

tritonserver 2.51 takes the restricted-API keys only as arguments (`--grpc-restricted-protocol=
groups:name=key`, `--http-restricted-api=...`): it has no config file or environment variable for
them. So the launcher passes placeholders as arguments and the keys in the environment (readable by
the owner alone), and preloads a small library (native/argv_secrets.cc) that puts the keys into the
argv main() sees and removes them from the environment before tritonserver starts anything.

Run as a program it does the same for a command whose keys are in files (docker-compose.yml's Triton,
whose image has python3 and clang but not this project's dependencies: standard library only):

    python3 -m inference.triton.argv_secrets --secret-file client_key.txt -- \
        tritonserver ... --grpc-restricted-protocol=inference:embedcar-key=@@EMBEDCAR_SECRET_0@@

The n-th --secret-file fills placeholder(n). It never falls back to putting a key on the command line.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from inference import native_cache
from inference.errors import EmbedcarError, InvalidInput, Unavailable
from inference.private_paths import read_private_text

SOURCE = Path(__file__).parent / "native" / "argv_secrets.cc"
ENV_PREFIX = "EMBEDCAR_SECRET_"  # the shim removes every variable named so
FLAGS = ("-O2", "-std=c++17", "-Wall", "-Wextra", "-shared", "-fPIC")


_PLACEHOLDER = re.compile(rf"@@{ENV_PREFIX}(\d+)@@")


def placeholder(n: int) -> str:
    return f"@@{ENV_PREFIX}{n}@@"


def shim(build_dir: Path | None = None) -> Path:
    """The preload library, built once into the private native cache and verified (Unavailable if not)."""
    root = build_dir or native_cache.default_build_dir()
    return native_cache.build_cached(SOURCE, "embedcar-argv-secrets", root=root, flags=FLAGS, libs=("-ldl",),
                                     filename="argv_secrets.so")


def hide(args: Sequence[str], secrets: Sequence[str], env: Mapping[str, str], *,
         build_dir: Path | None = None) -> tuple[list[str], dict[str, str]]:
    """`args` with each secret replaced by its placeholder, and `env` with the secrets and the shim
    preloaded. Unavailable where the shim cannot be built or preloaded from its path."""
    hidden = []
    for arg in args:
        for n, secret in enumerate(secrets):
            arg = arg.replace(secret, placeholder(n))
        hidden.append(arg)
    return hidden, preload_env(secrets, env, build_dir=build_dir)


def preload_env(secrets: Sequence[str], env: Mapping[str, str], *, build_dir: Path | None = None) -> dict[str, str]:
    """`env` with secret n as the value of placeholder(n) and the shim preloaded (Unavailable where it cannot
    be built or preloaded from its path)."""
    lib = shim(build_dir)
    if any(c in str(lib) for c in " :"):
        raise Unavailable(f"cannot preload {lib}: LD_PRELOAD splits paths at spaces and colons")
    out = dict(env) | {f"{ENV_PREFIX}{n}": secret for n, secret in enumerate(secrets)}
    out["LD_PRELOAD"] = " ".join(p for p in (str(lib), env.get("LD_PRELOAD", "")) if p)
    return out


def read_secret_file(path: Path) -> str:
    """The one-line secret in `path`. Refused (InvalidInput naming the file, never its content) where group
    or others may read or write it, another user owns it, or it is not one line without spaces (it goes
    into an argument whole)."""
    text = read_private_text(path, "secret file").strip()
    if not text or any(c.isspace() for c in text):
        raise InvalidInput(f"secret file {path}: expected one line without spaces")
    return text


def exec_with_secret_files(files: Sequence[Path], command: Sequence[str], *,
                           build_dir: Path | None = None) -> None:
    """Replace this process with `command`, the content of files[n] in place of each placeholder(n) in the
    argv it sees and never on its command line. Returns only by raising (InvalidInput, Unavailable, OSError)."""
    if not command:
        raise InvalidInput("no command to run (after `--`)")
    used = {int(n) for arg in command for n in _PLACEHOLDER.findall(arg)}
    if missing := sorted(n for n in used if n >= len(files)):
        raise InvalidInput(f"the command uses {placeholder(missing[0])}, but only {len(files)} --secret-file given")
    if unused := [str(f) for n, f in enumerate(files) if n not in used]:
        raise InvalidInput(f"no argument uses the secret of {', '.join(unused)} (placeholder(n) for the n-th file)")
    secrets = [read_secret_file(f) for f in files]
    env = preload_env(secrets, os.environ, build_dir=build_dir)
    os.execvpe(command[0], list(command), env)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m inference.triton.argv_secrets",
        description="Run a command whose arguments need secrets kept off its command line (ps): each "
                    f"{placeholder(0)}-style placeholder in them becomes the content of the n-th --secret-file "
                    "in the argv the program sees (a preloaded shim, built into the private native cache).")
    parser.add_argument("--secret-file", type=Path, action="append", default=[], metavar="FILE",
                        help="a file holding one secret (mode 0600, this user's or root's); n-th = placeholder n")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- PROGRAM ARGS...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        exec_with_secret_files(args.secret_file, command)
    except EmbedcarError as exc:
        print(f"argv_secrets: {exc.message}; the secrets were not passed on the command line", file=sys.stderr)
        return 2
    except OSError as exc:  # the program could not be started
        print(f"argv_secrets: cannot run {command[0]}: {exc.strerror or exc}", file=sys.stderr)
        return 127
    return 0  # not reached: exec replaced this process


if __name__ == "__main__":
    sys.exit(main())
