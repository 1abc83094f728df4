"""Files the sidecar trusts: the compiled code it loads, the folder of its Unix
socket, its API keys file, Triton's keys; and `embedcar` commands failing in one line.

Real files, folders, modes and builds throughout; a folder "of another user" needs root (chown), and
those checks are skipped elsewhere.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from embedcar_client.client import Client, check_unix_target
from inference import native_cache
from inference.cli_main import report
from inference.errors import InvalidInput, ModelError, Unavailable
from inference.files import sha256_file
from inference.triton import argv_secrets
from loadtest import native_build
from sidecar.auth import MIN_KEY_CHARS, KeyRing, parse_keys_file
from sidecar.settings import SidecarSettings
from sidecar.unix_socket import UDS_MODE, prepare_unix_socket, private_socket_dir, restrict_unix_socket
from tests.components import require_native
from tests.conftest import ROOT
from tests.fixtures_models import st_reference, tiny_st_folder

OTHER_UID = 65534  # nobody
as_root = pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
TINY = "int main() { return 0; }\n"
FLAGS = ("-O0",)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


@pytest.fixture
def fresh_cache(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Nothing verified yet in this process: each build is checked again, as by a new sidecar."""
    monkeypatch.setattr(native_cache, "BUILT", {})
    yield


def _tiny(root: Path, source: Path) -> Path:
    return native_cache.build_cached(source, "tiny", root=root, flags=FLAGS, libs=(), filename="tiny")


@pytest.fixture
def source(tmp_path: Path) -> Path:
    src = tmp_path / "tiny.cc"
    src.write_text(TINY)
    return src


# --- the native build cache ---------------------------------------------------------------------
def test_builds_go_to_the_private_user_cache_and_are_reused_from_any_folder(
        tmp_path: Path, source: Path, fresh_cache: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    root = native_cache.default_build_dir()
    assert root == tmp_path / "xdg" / "embedcar" / "native"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # ignored, as the XDG specification says
    assert native_cache.default_build_dir() == Path.home() / ".cache" / "embedcar" / "native"
    monkeypatch.chdir(tmp_path)
    exe = _tiny(root, source)
    assert exe.parent.parent == root and _mode(root) == 0o700 and _mode(tmp_path / "xdg" / "embedcar") == 0o700
    assert _mode(exe.parent) == 0o700 and _mode(exe) == 0o700
    assert (exe.parent / native_cache.DIGEST_FILE).read_text().strip() == sha256_file(exe)
    assert subprocess.run([str(exe)], check=False).returncode == 0
    built_at = exe.stat().st_mtime_ns
    other = tmp_path / "elsewhere"
    other.mkdir()
    monkeypatch.chdir(other)  # another working folder: the same build, not a rebuild
    monkeypatch.setattr(native_cache, "BUILT", {})
    assert _tiny(root, source) == exe and exe.stat().st_mtime_ns == built_at
    assert not list(other.iterdir()) and not [p for p in root.iterdir() if p.name.startswith(".")]


def test_a_changed_binary_is_refused(tmp_path: Path, source: Path, fresh_cache: None) -> None:
    exe = _tiny(tmp_path / "cache", source)
    with exe.open("ab") as f:
        f.write(b"\0")  # what someone with write access would do, however they got it
    native_cache.BUILT.clear()
    with pytest.raises(Unavailable, match="does not match the digest recorded"):
        _tiny(tmp_path / "cache", source)
    (exe.parent / native_cache.DIGEST_FILE).unlink()
    with pytest.raises(Unavailable, match=r"cannot check .*SHA256"):
        _tiny(tmp_path / "cache", source)


def test_a_cache_folder_others_may_write_is_refused(tmp_path: Path, source: Path, fresh_cache: None) -> None:
    root = tmp_path / "cache"
    exe = _tiny(root, source)
    native_cache.BUILT.clear()
    root.chmod(0o777)
    with pytest.raises(Unavailable, match=r"may be written by others \(mode 0777\)"):
        _tiny(root, source)
    root.chmod(0o700)
    exe.parent.chmod(0o770)  # one build's folder
    with pytest.raises(Unavailable, match="refusing to use the build"):
        _tiny(root, source)
    exe.parent.chmod(0o700)
    exe.chmod(0o722)
    with pytest.raises(Unavailable, match="not this user's alone"):
        _tiny(root, source)
    exe.chmod(0o700)
    assert _tiny(root, source) == exe
    # A folder above that others may write (not sticky) could have the whole cache renamed away.
    above = tmp_path / "shared"
    above.mkdir(mode=0o777)
    above.chmod(0o777)
    with pytest.raises(Unavailable, match=f"{re.escape(str(above))} may be written by others"):
        _tiny(above / "cache", source)
    above.chmod(0o1777)  # sticky, like /tmp: others cannot rename what is ours
    assert _tiny(above / "cache", source).exists()


@as_root
def test_a_cache_folder_of_another_user_is_refused(tmp_path: Path, source: Path, fresh_cache: None) -> None:
    root = tmp_path / "cache"
    exe = _tiny(root, source)
    native_cache.BUILT.clear()
    os.chown(exe, OTHER_UID, -1)
    with pytest.raises(Unavailable, match=f"uid {OTHER_UID}"):
        _tiny(root, source)
    os.chown(root, OTHER_UID, -1)
    with pytest.raises(Unavailable, match=f"belongs to uid {OTHER_UID}"):
        _tiny(root, source)


def test_a_link_in_place_of_a_build_is_refused(tmp_path: Path, source: Path, fresh_cache: None) -> None:
    planted = _tiny(tmp_path / "planted", source).parent  # a build whose files are all in order
    root = tmp_path / "cache"
    exe = _tiny(root, source)
    shutil.rmtree(exe.parent)
    exe.parent.symlink_to(planted)
    native_cache.BUILT.clear()
    with pytest.raises(Unavailable, match="a link or a file, not a folder"):
        _tiny(root, source)


def test_a_cache_folder_that_cannot_be_made_is_unavailable(tmp_path: Path, source: Path, fresh_cache: None) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(Unavailable, match=r"cannot create .*file/cache"):
        _tiny(tmp_path / "file" / "cache", source)


def test_extra_flags_make_a_build_of_their_own(tmp_path: Path, source: Path, fresh_cache: None) -> None:
    require_native()
    plain = native_build.build_native(source, "tiny", build_dir=tmp_path / "cache")
    extra = native_build.build_native(source, "tiny", build_dir=tmp_path / "cache", extra_flags=("-DEMBEDCAR_X=1",))
    assert plain != extra and extra.parent.name.startswith("tiny-DEMBEDCAR-X-1-")
    assert native_build.build_native(source, "tiny", build_dir=tmp_path / "cache") == plain


# --- the Unix socket's folder ---------------------------------------------------------------------
def test_a_socket_folder_others_may_write_is_refused_sticky_or_not(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """In a folder others may write to, sticky like /tmp included, another user can bind the name first:
    refused, naming the folder and the private folder a bare name would use. A folder of ours inside one
    is fine (others cannot add to it, and the sticky bit keeps them from renaming it)."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "runtime"))
    shared = tmp_path / "shared"
    shared.mkdir()
    for mode in (0o777, 0o1777, 0o1770, 0o775):
        shared.chmod(mode)
        with pytest.raises(InvalidInput, match=rf"refusing to serve on Unix socket {shared}/grpc.sock: {shared} "
                           rf"may be written by others \(mode {mode:04o}") as err:
            prepare_unix_socket(shared / "grpc.sock")
        assert f"uds_path=grpc.sock serves in {tmp_path / 'runtime' / 'embedcar'}" in err.value.message
    assert not list(shared.iterdir())
    with pytest.raises(InvalidInput, match="refusing to serve on Unix socket /tmp/embedcar-test.sock: /tmp may "
                       r"be written by others \(mode 1777: sticky, yet anyone may create a name there first\)"):
        prepare_unix_socket(Path("/tmp/embedcar-test.sock"))  # the real /tmp, whoever owns it
    shared.chmod(0o1777)
    mine = shared / "mine"
    assert prepare_unix_socket(mine / "grpc.sock") == mine / "grpc.sock"
    before = os.umask(0)
    try:
        made = prepare_unix_socket(tmp_path / "new" / "run" / "grpc.sock")
    finally:
        os.umask(before)
    assert _mode(made.parent) == 0o755 and _mode(made.parent.parent) == 0o755  # never writable by others
    assert _mode(mine) == 0o755


@as_root
def test_a_socket_folder_of_another_user_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, OTHER_UID, -1)
    with pytest.raises(InvalidInput, match=f"{theirs} belongs to uid {OTHER_UID}"):
        prepare_unix_socket(theirs / "grpc.sock")


@as_root
def test_a_name_squatted_in_a_sticky_folder_of_another_user_is_refused_before_anything_else(tmp_path: Path) -> None:
    """What another user does in a sticky world-writable folder that is not ours: bind our socket's name
    first. The sidecar refuses the folder (never probing or connecting to their socket)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chown(shared, OTHER_UID, -1)
    shared.chmod(0o1777)
    squat = shared / "grpc.sock"
    with socket.socket(socket.AF_UNIX) as theirs:
        theirs.bind(str(squat))
        theirs.listen(1)
        os.chown(squat, OTHER_UID, -1)
        with pytest.raises(InvalidInput, match=rf"{shared} may be written by others \(mode 1777: sticky, yet anyone "
                           "may create a name there first"):
            prepare_unix_socket(squat)
        shared.chmod(0o755)  # closed, but theirs: they may still replace the socket
        with pytest.raises(InvalidInput, match=rf"{shared} belongs to uid {OTHER_UID} \(nobody\)"):
            prepare_unix_socket(squat)
        assert squat.exists()


def test_a_bare_name_is_a_socket_in_the_private_runtime_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = tmp_path / "runtime"
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    assert prepare_unix_socket(Path("grpc.sock")) == runtime / "embedcar" / "grpc.sock"
    assert _mode(runtime / "embedcar") == 0o700 and _mode(runtime) == 0o700  # made here, each level 0700
    # No runtime folder (a container, a service without a login): var/run in the data home, also 0700.
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    monkeypatch.setenv("EMBEDCAR_HOME", str(tmp_path / "home"))
    assert prepare_unix_socket(Path("grpc.sock")) == tmp_path / "home" / "var" / "run" / "grpc.sock"
    assert _mode(tmp_path / "home" / "var" / "run") == 0o700
    monkeypatch.setenv("XDG_RUNTIME_DIR", "relative")  # ignored, as the XDG specification says
    assert private_socket_dir() == tmp_path / "home" / "var" / "run"
    # A private folder someone opened to others is refused, not used.
    (tmp_path / "home" / "var" / "run").chmod(0o777)
    with pytest.raises(InvalidInput, match=r"in this user's socket folder: .*may be written by others \(mode 0777\)"):
        prepare_unix_socket(Path("grpc.sock"))
    # A path with a folder part is taken as given (relative to the working folder).
    monkeypatch.chdir(tmp_path)
    assert prepare_unix_socket(Path("here/grpc.sock")) == tmp_path / "here" / "grpc.sock"


def test_the_socket_mode_is_set_on_the_socket_never_through_a_link(tmp_path: Path) -> None:
    target = tmp_path / "precious"
    target.write_text("")
    target.chmod(0o600)
    link = tmp_path / "grpc.sock"
    link.symlink_to(target)
    with pytest.raises(Unavailable, match="no longer a socket"):
        restrict_unix_socket(link)
    assert _mode(target) == 0o600  # path.chmod would have made it 0660
    link.unlink()
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(link))
        bound = restrict_unix_socket(link)
        assert _mode(link) == UDS_MODE and bound.ident == (link.stat().st_dev, link.stat().st_ino)


# --- the client's side of the socket -------------------------------------------------------------
@as_root
def test_the_client_refuses_a_socket_of_another_user(tmp_path: Path) -> None:
    """A client hands its API key to whoever listens: a socket that belongs to another user than the one
    it expects (default: its own; root always passes) is refused before anything is dialled."""
    folder = tmp_path / "run"
    folder.mkdir(mode=0o755)
    path = folder / "grpc.sock"
    with socket.socket(socket.AF_UNIX) as theirs:
        theirs.bind(str(path))
        theirs.listen(1)
        os.chown(path, OTHER_UID, -1)
        for target in (f"unix:{path}", f"unix://{path}"):
            with pytest.raises(Unavailable, match=rf"refusing to connect to Unix socket {path}: it belongs to uid "
                               rf"{OTHER_UID} \(nobody\), not this user or root.*pass socket_owner="):
                Client(target, api_key="k" * 20)
        # Named as the sidecar's user, by number or by name, it passes (the folder is root's here).
        for owner in (OTHER_UID, "nobody"):
            Client(f"unix:{path}", socket_owner=owner).close()
        with pytest.raises(Unavailable, match=rf"belongs to uid {OTHER_UID} \(nobody\), not uid 12345 or root"):
            Client(f"unix:{path}", socket_owner=12345)


def test_the_client_refuses_a_socket_folder_others_may_write(tmp_path: Path) -> None:
    """Sticky or not, a folder others may write to lets them bind the name when the sidecar is not there
    (a restart): refused whether the socket is there now or not. A socket not there yet in a folder only
    we can write to passes: the sidecar may start after its client."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    path = shared / "grpc.sock"
    with pytest.raises(Unavailable, match=rf"{shared} may be written by others \(mode 1777: sticky"):
        Client(f"unix:{path}")
    with socket.socket(socket.AF_UNIX) as ours:
        ours.bind(str(path))
        with pytest.raises(Unavailable, match=rf"refusing to connect to Unix socket {path}: {shared} may be written"):
            Client(f"unix:{path}")
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    check_unix_target(f"unix:{private}/later/grpc.sock")  # not made yet: its nearest folder decides
    (private / "file").write_text("")
    with pytest.raises(Unavailable, match="it is not a socket"):
        check_unix_target(f"unix:{private}/file")
    with pytest.raises(InvalidInput, match="socket_owner 'no-such-user-x': no such user"):
        Client(f"unix:{private}/grpc.sock", socket_owner="no-such-user-x")
    check_unix_target(f"{shared}:1234")  # not a unix: target: nothing to check
    check_unix_target("127.0.0.1:50051")


# --- API keys -------------------------------------------------------------------------------------
def test_a_keys_file_others_may_read_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("shop " + "k" * MIN_KEY_CHARS + "\n")
    for mode in (0o644, 0o640, 0o604, 0o620):
        f.chmod(mode)
        with pytest.raises(InvalidInput, match=rf"refusing API keys file {f}: .*\(mode {mode:04o}\)"):
            parse_keys_file(f)
    f.chmod(0o600)
    assert list(parse_keys_file(f)) == ["shop"]
    f.chmod(0o400)
    assert list(parse_keys_file(f)) == ["shop"]


@as_root
def test_a_keys_file_of_another_user_is_refused_at_mode_600(tmp_path: Path) -> None:
    """Its owner may rewrite it whenever they like (add a tenant, read the keys): the owner is checked as
    well as the mode."""
    f = tmp_path / "keys"
    f.write_text("shop " + "k" * MIN_KEY_CHARS + "\n")
    f.chmod(0o600)
    os.chown(f, OTHER_UID, -1)
    with pytest.raises(InvalidInput, match=rf"refusing API keys file {f}: it belongs to uid {OTHER_UID} \(nobody\), "
                       r"not this user \(0\) or root"):
        parse_keys_file(f)
    os.chown(f, 0, -1)  # root's: accepted (root can change anything anyway)
    assert list(parse_keys_file(f)) == ["shop"]


def test_short_keys_are_refused_naming_the_tenant_not_the_key(tmp_path: Path) -> None:
    short = "s3cr3t-but-short"[: MIN_KEY_CHARS - 1]
    with pytest.raises(InvalidInput, match=r"tenant shop.*shorter than 16") as err:
        KeyRing.from_settings(SidecarSettings(api_keys=f"shop={short}"))
    assert short not in err.value.message
    f = tmp_path / "keys"
    f.write_text(f"ok {'k' * MIN_KEY_CHARS}\nshop {short}\n")
    f.chmod(0o600)
    with pytest.raises(InvalidInput, match=rf"{f}:2 \(tenant shop\).*shorter") as err:
        parse_keys_file(f)
    assert short not in err.value.message
    # The sha256: form is a digest: the key behind it is not ours to measure.
    f.write_text("shop sha256:" + "ab" * 32 + "\n")
    assert parse_keys_file(f)["shop"] == bytes.fromhex("ab" * 32)


# --- Triton's keys --------------------------------------------------------------------------------
def test_secrets_reach_the_program_but_not_its_command_line(tmp_path: Path, fresh_cache: None) -> None:
    """The preload shim with a real program (sh): the argument main() sees holds the key, the process's
    command line (what `ps` shows every user) the placeholder; the environment loses the key."""
    key = "k3y-" + "9" * 20
    script = ('printf "%s\\n" "$1"; tr "\\0" " " < /proc/$$/cmdline; echo; '
              'printf "[%s][%s]\\n" "$EMBEDCAR_SECRET_0" "$LD_PRELOAD"')
    args, env = argv_secrets.hide(["sh", "-c", script, "sh", f"--grpc-restricted-protocol=health:k={key}"], [key],
                                  {"PATH": os.environ["PATH"]}, build_dir=tmp_path / "cache")
    assert key not in " ".join(args) and env[f"{argv_secrets.ENV_PREFIX}0"] == key
    seen, cmdline, leftover = subprocess.run(args, env=env, capture_output=True, text=True,
                                             check=True).stdout.splitlines()
    assert seen == f"--grpc-restricted-protocol=health:k={key}"
    assert key not in cmdline and argv_secrets.placeholder(0) in cmdline
    assert leftover == "[][]"  # children of the program inherit neither the key nor the shim


def _launch(*args: str, cache: Path) -> subprocess.CompletedProcess[str]:
    """`python -m inference.triton.argv_secrets ARGS` as docker-compose.yml runs it: standard library only
    (-S: no site-packages; the client's package beside, as its mount puts it), the shim built into `cache`."""
    env = {"PATH": os.environ["PATH"], "XDG_CACHE_HOME": str(cache), "PYTHONPATH": str(ROOT / "client")}
    return subprocess.run([sys.executable, "-S", "-m", "inference.triton.argv_secrets", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)


def test_keys_in_files_reach_the_program_but_no_command_line(tmp_path: Path) -> None:
    """The launcher docker-compose.yml runs Triton through: keys read from files, placeholders on every
    command line (its own and the program's), the keys in the argv the program sees."""
    keys = ["k3y-" + "7" * 20, "0p-" + "8" * 21]
    files = []
    for n, key in enumerate(keys):
        files.append(tmp_path / f"key{n}.txt")
        files[-1].write_text(key + "\n")
        files[-1].chmod(0o600)
    # The launcher execs the program: one process, whose command line `ps` shows is read from /proc.
    script = ('printf "%s|%s\\n" "$1" "$2"; tr "\\0" " " < /proc/$$/cmdline; echo; '
              'printf "[%s][%s]\\n" "$EMBEDCAR_SECRET_0" "$LD_PRELOAD"')
    zero, one = argv_secrets.placeholder(0), argv_secrets.placeholder(1)
    args = [f"--secret-file={files[0]}", f"--secret-file={files[1]}", "--", "sh", "-c", script, "sh",
            f"--a=x:k={zero}", f"--b=k={one},{zero}"]
    proc = _launch(*args, cache=tmp_path / "cache")
    assert proc.returncode == 0, proc.stderr
    seen, cmdline, leftover = proc.stdout.splitlines()
    assert seen == f"--a=x:k={keys[0]}|--b=k={keys[1]},{keys[0]}"
    assert not any(k in cmdline for k in keys) and argv_secrets.placeholder(1) in cmdline
    assert leftover == "[][]"
    assert not any(k in proc.stderr for k in keys)


def test_the_key_launcher_refuses_rather_than_leak(tmp_path: Path) -> None:
    key = tmp_path / "key.txt"
    key.write_text("k" * 24 + "\n")
    key.chmod(0o644)
    prog = ["--", "sh", "-c", "echo ran", "sh", f"--k={argv_secrets.placeholder(0)}"]
    proc = _launch(f"--secret-file={key}", *prog, cache=tmp_path / "cache")
    assert proc.returncode == 2 and "ran" not in proc.stdout
    assert f"refusing secret file {key}: group or others may read or write it (mode 0644)" in proc.stderr
    assert "k" * 24 not in proc.stderr
    key.chmod(0o600)
    unused = tmp_path / "other.txt"
    unused.write_text("o" * 24)
    unused.chmod(0o600)
    proc = _launch(f"--secret-file={key}", f"--secret-file={unused}", *prog, cache=tmp_path / "cache")
    assert proc.returncode == 2 and f"no argument uses the secret of {unused}" in proc.stderr
    proc = _launch(*prog, cache=tmp_path / "cache")
    assert proc.returncode == 2 and "uses @@EMBEDCAR_SECRET_0@@, but only 0 --secret-file given" in proc.stderr
    # A cache it cannot build in: no shim, no start (never the key on the command line instead).
    (tmp_path / "file").write_text("")
    proc = _launch(f"--secret-file={key}", *prog, cache=tmp_path / "file" / "cache")
    assert proc.returncode == 2 and "ran" not in proc.stdout and "not passed on the command line" in proc.stderr
    if os.getuid() == 0:
        os.chown(key, OTHER_UID, -1)
        proc = _launch(f"--secret-file={key}", *prog, cache=tmp_path / "cache")
        assert proc.returncode == 2 and f"it belongs to uid {OTHER_UID} (nobody)" in proc.stderr


# --- one-line errors and `model prepare` -----------------------------------------------------------
def test_a_bug_names_itself_in_one_line_and_shows_its_traceback_with_v(capsys: pytest.CaptureFixture[str]) -> None:
    def bug() -> None:
        raise TypeError("f() got an unexpected keyword argument 'x'\nsecond line")

    for verbose in (False, True):
        try:
            bug()
        except TypeError as exc:
            assert report(exc, verbose=verbose) == 70
        err = capsys.readouterr().err
        last = err.strip().splitlines()[-1]
        assert last.startswith("embedcar: internal error, a bug: TypeError: f() got") and "second line" in last
        assert ("Traceback" in err) is verbose
    assert report(ExceptionGroup("tasks", [ModelError("the folder\nis wrong")]), verbose=False) == 2
    assert capsys.readouterr().err == "embedcar: the folder | is wrong\n"
    assert report(FileNotFoundError(2, "No such file or directory", "/x/y"), verbose=False) == 1
    assert capsys.readouterr().err == "embedcar: No such file or directory: /x/y\n"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "inference.cli_main", *args], capture_output=True, text=True,
                          cwd=ROOT, check=False, timeout=600)


def test_a_refused_keys_file_is_one_line_from_the_command(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("shop " + "k" * 20 + "\n")
    f.chmod(0o644)
    proc = _cli("sidecar", "serve", "--api-keys-file", str(f), "--grpc-port", "0", "--http-port", "-1")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"embedcar: refusing API keys file {f}: group or others may read or write it (mode 0644): chmod 600 it "
        "(a mounted secret: defaultMode 0400)")


@pytest.mark.slow
def test_prepare_drops_token_type_ids_a_modernbert_does_not_take(tmp_path: Path) -> None:
    """A ModernBERT folder whose tokenizer config lists token_type_ids (ModernBertModel.forward takes none):
    sentence-transformers' own encode fails on it; prepare drops the input, says so, and serves the model."""
    src = tiny_st_folder(tmp_path / "st", "modernbert")
    texts = ["oat milk", "free range eggs dozen"]
    want = st_reference(src, texts)  # before the change: the same weights, no token types
    config = src / "tokenizer_config.json"
    cfg = json.loads(config.read_text())
    cfg["model_input_names"] = ["input_ids", "token_type_ids", "attention_mask"]
    config.write_text(json.dumps(cfg))
    models = str(tmp_path / "models")
    prep = _cli("model", "prepare", "--from", str(src), "--model", "mb", "--models-dir", models)
    assert prep.returncode == 0 and "Traceback" not in prep.stderr, prep.stderr[-2000:]
    assert "tokenizer_config.json model_input_names lists token_type_ids" in prep.stderr
    manifest = json.loads((tmp_path / "models" / "mb" / "manifest.json").read_text())
    assert "token_type_ids" not in json.dumps(manifest.get("inputs", []))
    out = _cli("embed", "--model", "mb", "--models-dir", models, "--variant", "fp32", "--json", *texts)
    assert out.returncode == 0, out.stderr[-2000:]
    got = np.array(json.loads(out.stdout)["embeddings"], dtype=np.float32)
    assert (np.sum(got * want, axis=1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)).min() >= 0.9999
