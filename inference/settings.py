"""Settings: one frozen object per process, built from `EMBEDCAR_*` variables and CLI flags.

No other module reads the environment. Every field is documented (`setting(...)`); `describe()`
prints them with secrets redacted. Environment names are `EMBEDCAR_<SECTION>_<FIELD>`, e.g.
`EMBEDCAR_SIDECAR_GRPC_PORT=50051`; tuples are comma-separated. Flags come from the same fields
(inference/flags.py).

Each package owns its section, and each layer's `Settings` is the one below plus its own section, so
no module imports upward and code names only the sections it may read:

    inference.settings.Settings   model, triton
    catalog.settings.Settings     + catalog
    sidecar.settings.Settings     + sidecar
    embedcar_settings.Settings    + demo (every section; a top-level module: what demo_ui, loadtest and the tests use)

A process builds the `Settings` of the top layer it runs; a higher one passes wherever a lower one
is asked for.

Data folders (models, indexes, Triton's generated repository; fields made with `home=True`) default to
folders of the data home, so every command finds them from any working folder: `EMBEDCAR_HOME`, else
the checkout this code runs from (`make demo` prepares its model there), else the current folder when
it is a checkout (the container's /app), else a per-user data folder (`$XDG_DATA_HOME/embedcar`,
`~/.local/share/embedcar`). A path given by a variable or a flag is taken as given (relative to the
current folder).
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from inference.errors import InvalidInput

HOME_ENV = "EMBEDCAR_HOME"
_CODE_ROOT = Path(__file__).resolve().parent.parent  # the checkout, when the code runs from one
PORT_MAX = 65535  # a TCP port is 16 bits: the OS wraps a larger number (99999 -> 34463) or refuses it


def setting(default: Any, doc: str, *, secret: bool = False, flag: str | None = None,
            choices: tuple[str, ...] | None = None, min: float | None = None, max: float | None = None,
            home: bool = False, advanced: bool = False) -> Any:
    """A documented settings field. `flag`: its CLI flag name where that differs from the field's
    (e.g. `--threads` for model.intra_op_threads); `choices`: the values its flag accepts; `min`/`max`:
    the inclusive range of a number (of each item of a tuple), checked when `Settings.load` reads a
    variable or a flag (a typo'd port or a negative count is refused there, in one line, rather than
    wrapped by the OS or failing later); `home`: a data folder, its relative default under the data
    home (module docstring); `advanced`: a tuning or diagnostic setting an operator need not read
    (docs/settings.md lists the operator settings first)."""
    # repr=False for secrets: a settings object in a log line or a traceback must not show them.
    return field(default=default, repr=not secret,
                 metadata={"doc": doc, "secret": secret, "flag": flag, "choices": choices, "min": min, "max": max,
                           "home": home, "advanced": advanced})


def _is_checkout(folder: Path) -> bool:
    return (folder / "pyproject.toml").is_file() and (folder / "inference" / "settings.py").is_file()


def data_home(environ: Mapping[str, str], *, code_root: Path = _CODE_ROOT, cwd: Path | None = None) -> Path:
    """Where data folders live by default (module docstring), as an absolute path."""
    cwd = Path.cwd() if cwd is None else cwd
    if environ.get(HOME_ENV):
        return cwd / Path(environ[HOME_ENV]).expanduser()
    if _is_checkout(code_root):
        return code_root
    if _is_checkout(cwd):
        return cwd
    xdg = environ.get("XDG_DATA_HOME", "")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".local" / "share"
    return base / "embedcar"


def env_name(section: str, name: str) -> str:
    return f"EMBEDCAR_{section}_{name}".upper()


def flag_name(f: dataclasses.Field[Any]) -> str:
    """The CLI flag of a settings field, e.g. `--threads` for model.intra_op_threads."""
    return "--" + (f.metadata.get("flag") or f.name.replace("_", "-"))


def range_text(f: dataclasses.Field[Any]) -> str:
    """A field's range as the reference page and the errors say it ("" where it has none)."""
    low, high = f.metadata.get("min"), f.metadata.get("max")
    if low is not None and high is not None:
        return f"{_num(low)} to {_num(high)}"
    if low is not None:
        return f"at least {_num(low)}"
    return f"at most {_num(high)}" if high is not None else ""


def check_range(f: dataclasses.Field[Any], value: Any, source: str) -> None:
    """Raise InvalidInput naming `source` (a flag or a variable) where `value` (or an item of it) is
    outside the field's range; NaN is outside every range."""
    low, high = f.metadata.get("min"), f.metadata.get("max")
    if low is None and high is None:
        return
    for v in value if isinstance(value, tuple) else (value,):
        if isinstance(v, int | float) and not isinstance(v, bool) and not (
                (low is None or v >= low) and (high is None or v <= high) and v == v):
            raise InvalidInput(f"{source}: {_num(v)} is out of range: {range_text(f)}"
                               f"{_range_note(f)}")


def _range_note(f: dataclasses.Field[Any]) -> str:
    """A port's special values, the ones users reach for: 0 (a free one) and, where allowed, -1 (off)."""
    if not f.name.endswith("port") or f.metadata.get("min") is None or f.metadata["min"] > 0:
        return ""
    return " (0 = a free one, -1 = off)" if f.metadata["min"] < 0 else " (0 = a free one)"


def _num(v: float) -> str:
    return str(int(v)) if isinstance(v, float) and v.is_integer() and abs(v) < 1e15 else str(v)


@dataclass(frozen=True, slots=True)
class ModelSettings:
    models_dir: Path = setting(Path("models"), "Folder holding prepared model directories (git-ignored); "
                               "relative: under the data home (EMBEDCAR_HOME).", home=True)
    name: str = setting("all-MiniLM-L6-v2", "Model directory name under models_dir.", flag="model")
    variant: str = setting(
        "", "ONNX variant to serve; empty = the model's own default, chosen when it was prepared and "
        "recorded in its manifest (int8 for the bundled MiniLM: about half fp32's latency at recall within "
        "0.005 of it; fp32 for a model whose int8 missed its check; `model report --set-default` may pick "
        "another from measurement). int8 (per-channel), fp32 (fused), bf16 (OpenVINO, embedded backend, "
        "built where the CPU has AMX or AVX512-BF16) or fp16 (a GPU Triton's TensorRT plan). Embeddings, "
        "caches and catalog indexes are per variant: a sidecar serves the newest index of its own."
    )
    intra_op_threads: int = setting(
        0, "Embedded backend: intra-op threads (ONNX Runtime, OpenVINO for bf16). 0 = chosen: on the query "
        "path (sidecar, one lane) a typical query is timed at load on 1 thread and on every core, and every "
        "core is kept only if it is 25 % faster (the search node beside it keeps the rest); batch work "
        "(the catalog job) uses every core.", flag="threads", min=0, max=1024, advanced=True)
    forward_lanes: int = setting(
        1, "Embedded backend: forward passes that may run at once, each on intra_op_threads / lanes ORT "
        "threads. 1: every core on each query (lowest latency at light load); more: more queries per "
        "second once a queue forms, each query a little slower (docs/benchmarks.md, 'Levers').", flag="lanes",
        min=1, max=256, advanced=True)
    max_texts_per_call: int = setting(
        256, "Most texts one embedding call may carry: a sidecar request or `embedcar embed` (more: "
        "INVALID_ARGUMENT), and a backend call unless its caller sets a cap. Not the forward-pass size: "
        "that is sidecar.max_rows_per_pass (and Triton's own triton.max_batch_size).", min=1, advanced=True)
    truncate_text_chars: int = setting(
        20_000, "Texts longer than this are cut before tokenizing (bounds tokenizer work; the model cuts "
        "at its token limit anyway). The sidecar rejects long texts first: sidecar.max_text_chars.",
        min=1, advanced=True)

    @property
    def model_dir(self) -> Path:
        return self.models_dir / self.name

    def served_variant(self) -> str:
        """`variant`, or the prepared model's own default where it is empty."""
        if self.variant:
            return self.variant
        from inference.manifest import load_manifest

        return load_manifest(self.model_dir).default_variant


@dataclass(frozen=True, slots=True)
class TritonSettings:
    host: str = setting("127.0.0.1", "Address the local tritonserver binds to (loopback by default); its "
                        "Prometheus metrics too, except in the hardened profile (tls_dir): loopback there.")
    grpc_port: int = setting(8001, "Triton gRPC port (`triton serve`: 0 = a free one).", min=0, max=PORT_MAX)
    http_port: int = setting(8000, "Triton HTTP port (`triton serve`: 0 = a free one).", min=0, max=PORT_MAX)
    metrics_port: int = setting(8002, "Triton Prometheus metrics port (`triton serve`: 0 = a free one).",
                                min=0, max=PORT_MAX)
    urls: tuple[str, ...] = setting(
        ("127.0.0.1:8001",), "Triton gRPC addresses the client spreads requests over.", flag="triton-url"
    )
    repo_dir: Path = setting(Path("var/triton/repo"), "Generated model repository; the assembled Python backend "
                             "(backends/) and the TensorRT engine cache (trt-engines/) are kept beside it.",
                             flag="out", home=True, advanced=True)
    target: str = setting("cpu", "Model repository target: cpu (ORT in Python backend) or gpu.",
                          choices=("cpu", "gpu"))
    max_queue_delay_us: int = setting(
        0, "Dynamic batching wait; paid in full at low traffic. 0 = batch only what is already queued.",
        min=0, advanced=True)
    instances: int = setting(
        0, "Encoder instances: on CPU, 0 = one per two cores (at least 1); on GPU, per GPU (parallel CUDA "
        "streams), 0 = 4.", min=0, advanced=True)
    max_batch_size: int = setting(
        256, "max_batch_size in the generated models' config.pbtxt: the most rows Triton batches into one "
        "execution (and accepts in one request).", min=1, advanced=True)
    timeout_ms: int = setting(2000, "gRPC deadline and Triton server-side timeout per request.", min=1, advanced=True)
    ort_threads: int = setting(0, "ORT intra-op threads per CPU encoder instance; 0 = cores / instances.",
                               min=0, advanced=True)
    # --- a Triton pool reached from other machines (docs/scale.md "Securing the Triton pool") ---
    tls_dir: Path | None = setting(
        None, "Unset: plaintext with every API open (one host, loopback: make demo, tests). Set: the hardened "
        "profile, on both sides of a pool: this machine's folder from `embedcar triton certs` (ca.pem; a Triton "
        "host's server.pem + server.key, a client's client.pem + client.key; client_key.txt; operator_key.txt "
        "where the operator's APIs are wanted). Triton then serves gRPC over mutual TLS with API groups behind "
        "those keys, HTTP on loopback only, model control off; clients connect with TLS and send the keys.")

    @property
    def backend_dir(self) -> Path:
        """The assembled backend directory (Python backend + stub), a fixed folder beside repo_dir."""
        return self.repo_dir.parent / "backends"

    @property
    def engine_cache_dir(self) -> Path:
        """The TensorRT engine cache, a fixed folder beside repo_dir."""
        return self.repo_dir.parent / "trt-engines"


@dataclass(frozen=True, slots=True)
class Settings:
    """The ground floor's sections; the packages above subclass this to add theirs."""

    model: ModelSettings = field(default_factory=ModelSettings)
    triton: TritonSettings = field(default_factory=TritonSettings)

    @classmethod
    def load(
        cls,
        environ: Mapping[str, str] | None = None,
        overrides: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> Self:
        """Defaults, then `EMBEDCAR_*` variables, then explicit overrides (CLI flags)."""
        env = os.environ if environ is None else environ
        home: Path | None = None
        sections: dict[str, Any] = {}
        for sec in dataclasses.fields(cls):
            sec_cls = typing.get_type_hints(cls)[sec.name]
            values: dict[str, Any] = {}
            hints = typing.get_type_hints(sec_cls)
            fields = {f.name: f for f in dataclasses.fields(sec_cls)}
            for f in fields.values():
                key = env_name(sec.name, f.name)
                if key in env:
                    values[f.name] = parse_value(hints[f.name], env[key], key)
                    check_range(f, values[f.name], key)
            for name, value in ((overrides or {}).get(sec.name) or {}).items():
                if value is not None:
                    if name in fields:  # an unknown name fails in the constructor below, as before
                        check_range(fields[name], value, flag_name(fields[name]))
                    values[name] = value
            for f in fields.values():
                default = f.default
                if f.metadata.get("home") and f.name not in values and isinstance(default, Path) \
                        and not default.is_absolute():
                    home = data_home(env) if home is None else home
                    values[f.name] = home / default
            sections[sec.name] = sec_cls(**values)
        return cls(**sections)

    def with_section(self, name: str, **changes: Any) -> Self:
        return dataclasses.replace(self, **{name: dataclasses.replace(getattr(self, name), **changes)})

    def describe(self) -> dict[str, dict[str, Any]]:
        """All values with secrets redacted: safe to log."""
        out: dict[str, dict[str, Any]] = {}
        for sec in dataclasses.fields(self):
            obj = getattr(self, sec.name)
            out[sec.name] = {
                f.name: ("<redacted>" if f.metadata.get("secret") and getattr(obj, f.name) else
                         str(getattr(obj, f.name)))
                for f in dataclasses.fields(obj)
            }
        return out


def parse_value(tp: Any, raw: str, key: str) -> Any:
    """`raw` (an environment value or a flag's text) as a field of type `tp`; `key` names it in errors."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    try:
        if origin is tuple:
            item = args[0]
            return tuple(parse_value(item, p.strip(), key) for p in raw.split(",") if p.strip())
        if origin in (typing.Union, types.UnionType):
            inner = next(a for a in args if a is not type(None))
            return None if raw.strip() == "" else parse_value(inner, raw, key)
        if tp is bool:
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if tp in (int, float, str, Path):
            return tp(raw)
    except (ValueError, StopIteration) as exc:
        raise InvalidInput(f"{key}: cannot read {raw!r} as {_TYPE_NAMES.get(tp, str(tp))}") from exc
    raise InvalidInput(f"{key}: unsupported setting type {tp}")


_TYPE_NAMES: dict[Any, str] = {int: "a whole number", float: "a number", bool: "true/false (1/0, yes/no, on/off)"}
