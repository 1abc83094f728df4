"""tritonserver's API keys kept off its command line, which every local user can read (`ps`).

tritonserver 2.51 takes the restricted-API keys only as arguments (`--grpc-restricted-protocol=
groups:name=key`, `--http-restricted-api=...`): it has no config file or environment variable for
them. So the launcher passes placeholders as arguments and the keys in the environment (readable by
the owner alone), and preloads a small library (native/argv_secrets.cc) that puts the keys into the
argv main() sees and removes them from the environment before tritonserver starts anything.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from inference import native_cache
from inference.errors import Unavailable

SOURCE = Path(__file__).parent / "native" / "argv_secrets.cc"
ENV_PREFIX = "EMBEDCAR_SECRET_"  # the shim removes every variable named so
FLAGS = ("-O2", "-std=c++17", "-Wall", "-Wextra", "-shared", "-fPIC")


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
    lib = shim(build_dir)
    if any(c in str(lib) for c in " :"):
        raise Unavailable(f"cannot preload {lib}: LD_PRELOAD splits paths at spaces and colons")
    hidden = []
    for arg in args:
        for n, secret in enumerate(secrets):
            arg = arg.replace(secret, placeholder(n))
        hidden.append(arg)
    out = dict(env) | {f"{ENV_PREFIX}{n}": secret for n, secret in enumerate(secrets)}
    out["LD_PRELOAD"] = " ".join(p for p in (str(lib), env.get("LD_PRELOAD", "")) if p)
    return hidden, out
