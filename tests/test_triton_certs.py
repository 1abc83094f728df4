"""Unit: `embedcar triton certs` output and the hardened profile's credential checks (no server)."""

from __future__ import annotations

import ipaddress
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509

from inference.errors import FailedPrecondition, InvalidInput
from inference.settings import Settings, TritonSettings
from inference.triton import tls
from inference.triton.certs import PoolFiles, make_pool_certs
from inference.triton.tls import ClientCredentials, client_credentials, server_flags

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> PoolFiles:
    return make_pool_certs(tmp_path_factory.mktemp("pool"), ["triton-a", "10.0.0.5"], ["sidecar", "job"])


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def hardened(folder: Path) -> TritonSettings:
    return Settings.load(environ={}).with_section("triton", tls_dir=folder).triton


def tls_dir(pool: PoolFiles, tmp_path: Path, *, host: str | None = "triton-a", client: str | None = "sidecar",
            operator_key: bool = True) -> Path:
    """One folder holding `host`'s and `client`'s files, as on a host running both (Triton and a sidecar)."""
    out = tmp_path / "tls"
    out.mkdir()
    for name in (host, client):
        for f in pool.dirs[name].iterdir() if name else ():
            shutil.copy2(f, out / f.name)
    if operator_key:
        shutil.copy2(pool.operator_key, out / tls.OPERATOR_KEY_FILE)
    else:
        (out / tls.OPERATOR_KEY_FILE).unlink(missing_ok=True)
    return out


def test_keys_0600_and_certificates_name_their_hosts(pool: PoolFiles) -> None:
    ca = x509.load_pem_x509_certificate(pool.ca_cert.read_bytes())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert _mode(pool.ca_cert.with_name("ca.key")) == 0o600
    assert _mode(pool.client_key) == 0o600 and _mode(pool.operator_key) == 0o600
    for host, (cert_path, key_path) in pool.hosts.items():
        assert _mode(key_path) == 0o600, key_path
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        cert.verify_directly_issued_by(ca)
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names = set(san.get_values_for_type(x509.DNSName)) | {str(a) for a in san.get_values_for_type(x509.IPAddress)}
        assert {host, "localhost", "127.0.0.1"} <= names
    ip_cert = x509.load_pem_x509_certificate(pool.hosts["10.0.0.5"][0].read_bytes())
    ips = ip_cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value \
        .get_values_for_type(x509.IPAddress)
    assert ipaddress.ip_address("10.0.0.5") in ips  # an address is an IP SAN, not a DNS name
    for _cert, key_path in pool.clients.values():
        assert _mode(key_path) == 0o600
    assert pool.client_key.read_text().strip() != pool.operator_key.read_text().strip()


def test_a_folder_per_machine_under_fixed_names(pool: PoolFiles) -> None:
    """What each machine's triton.tls_dir holds: a host everything Triton reads, a client never the
    operator key; the keys and CA are the pool's."""
    host = {"ca.pem", "server.pem", "server.key", "client_key.txt", "operator_key.txt"}
    client = {"ca.pem", "client.pem", "client.key", "client_key.txt"}
    for name, want in (("triton-a", host), ("10.0.0.5", host), ("sidecar", client), ("job", client)):
        folder = pool.dirs[name]
        assert {p.name for p in folder.iterdir()} == want, name
        assert (folder / "ca.pem").read_bytes() == pool.ca_cert.read_bytes()
        assert (folder / "client_key.txt").read_bytes() == pool.client_key.read_bytes()
        for secret in want - {"ca.pem", "server.pem", "client.pem"}:
            assert _mode(folder / secret) == 0o600, (name, secret)
    assert pool.hosts["triton-a"] == (pool.dirs["triton-a"] / "server.pem", pool.dirs["triton-a"] / "server.key")
    assert (pool.dirs["triton-a"] / "operator_key.txt").read_bytes() == pool.operator_key.read_bytes()


def test_second_run_keeps_ca_and_keys(tmp_path: Path) -> None:
    first = make_pool_certs(tmp_path, ["a"])
    ca, key = first.ca_cert.read_bytes(), first.client_key.read_text()
    second = make_pool_certs(tmp_path, ["b"])
    assert second.ca_cert.read_bytes() == ca and second.client_key.read_text() == key
    assert (second.dirs["b"] / "client_key.txt").read_text() == key
    b = x509.load_pem_x509_certificate(second.hosts["b"][0].read_bytes())
    b.verify_directly_issued_by(x509.load_pem_x509_certificate(ca))


def test_bad_names_refused(tmp_path: Path) -> None:
    for hosts in ([], ["../etc"], ["a b"], ["ca.pem"], ["ca.key"]):
        with pytest.raises(InvalidInput):
            make_pool_certs(tmp_path, hosts)


def test_cli_writes_the_pool(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "inference.cli_main", "triton", "certs", "--hosts", "t1,t2",
                          "--out", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert {"ca.pem", "ca.key", "client_key.txt", "operator_key.txt", "t1", "t2", "sidecar"} == \
        {p.name for p in tmp_path.iterdir()}
    assert {"server.pem", "server.key"} <= {p.name for p in (tmp_path / "t2").iterdir()}
    assert f"EMBEDCAR_TRITON_TLS_DIR={tmp_path / 'sidecar'}" in out.stdout
    key = (tmp_path / "client_key.txt").read_text().strip()
    assert key not in out.stdout + out.stderr  # the command names the files, never prints a key


def test_local_profile_has_no_credentials() -> None:
    t = Settings.load(environ={}).triton
    assert t.tls_dir is None and not tls.hardened(t)
    assert client_credentials(t) is None and tls.secret_markers(t) == []


def test_client_credentials_read_and_never_shown(pool: PoolFiles, tmp_path: Path) -> None:
    creds = client_credentials(hardened(tls_dir(pool, tmp_path, host=None)))
    assert isinstance(creds, ClientCredentials)
    key = pool.client_key.read_text().strip()
    assert creds.metadata == (("triton-grpc-protocol-embedcar-key", key),)
    assert creds.operator_metadata[0][1] == pool.operator_key.read_text().strip()
    assert creds.cert_chain == pool.clients["sidecar"][0].read_bytes()
    assert key not in repr(creds) and b"PRIVATE" not in repr(creds).encode()
    # A client's own folder, as written: no operator key, so no operator header.
    plain = client_credentials(hardened(pool.dirs["sidecar"]))
    assert plain is not None and plain.operator_metadata == ()


def test_a_host_folder_serves_as_a_client_folder(pool: PoolFiles) -> None:
    """The launcher's own checks and a load test on the Triton host: the host certificate, client usage."""
    creds = client_credentials(hardened(pool.dirs["triton-a"]))
    assert creds is not None and creds.cert_chain == pool.hosts["triton-a"][0].read_bytes()
    assert creds.operator_metadata  # the host's folder holds the operator key


def test_server_flags(pool: PoolFiles, tmp_path: Path) -> None:
    flags = server_flags(hardened(pool.dirs["triton-a"]))
    joined = " ".join(flags.args)
    folder = pool.dirs["triton-a"]
    for flag in ("--grpc-use-ssl=true", "--grpc-use-ssl-mutual=true", "--model-control-mode=none",
                 f"--grpc-server-cert={folder / 'server.pem'}", f"--grpc-server-key={folder / 'server.key'}",
                 f"--grpc-root-cert={folder / 'ca.pem'}",
                 "--grpc-restricted-protocol=health,metadata,model-config,inference:embedcar-key=",
                 "--grpc-restricted-protocol=shared-memory,model-repository,statistics,trace,logging:"):
        assert flag in joined, flag
    key, op = pool.client_key.read_text().strip(), pool.operator_key.read_text().strip()
    assert key in joined and op in joined
    shown = " ".join(flags.redacted()) + repr(flags)
    assert key not in shown and op not in shown and "<redacted>" in shown
    # No operator key: the operator group is still restricted, by a fresh key nobody holds.
    off = server_flags(hardened(tls_dir(pool, tmp_path, client=None, operator_key=False)))
    assert op not in " ".join(off.args) and len(off.secrets) == 2
    with pytest.raises(FailedPrecondition, match=r"triton.tls_dir .*: no server.pem"):
        server_flags(hardened(pool.dirs["sidecar"]))  # a client's folder cannot serve


@pytest.mark.parametrize(("change", "named"), [
    ({"ca.pem": None}, "no ca.pem"),
    ({"client_key.txt": None}, "no client_key.txt"),
    ({"client.key": None}, "no client.key"),
    ({"client.key": "host-key"}, "client.key does not belong to triton.tls_dir"),
    ({"client.pem": "foreign", "client.key": "foreign-key"}, "was not issued by the CA"),
    ({"ca.pem": "garbage"}, "ca.pem: not a PEM certificate"),
])
def test_wrong_client_files_named(pool: PoolFiles, tmp_path: Path, change: dict[str, str | None], named: str) -> None:
    foreign = make_pool_certs(tmp_path / "other", ["x"], ["sidecar"])
    (tmp_path / "garbage").write_text("not a certificate\n")
    sources = {"host-key": pool.hosts["triton-a"][1], "foreign": foreign.clients["sidecar"][0],
               "foreign-key": foreign.clients["sidecar"][1], "garbage": tmp_path / "garbage"}
    folder = tls_dir(pool, tmp_path, host=None)
    for name, source in change.items():
        (folder / name).unlink()
        if source is not None:
            shutil.copy2(sources[source], folder / name)
    with pytest.raises(FailedPrecondition, match=named) as info:
        client_credentials(hardened(folder))
    assert "\n" not in info.value.message and str(folder) in info.value.message


def test_a_bad_key_file_is_named_not_shown(pool: PoolFiles, tmp_path: Path) -> None:
    folder = tls_dir(pool, tmp_path)
    bad = folder / "client_key.txt"
    bad.write_text("short secret!\n")
    with pytest.raises(FailedPrecondition) as info:
        client_credentials(hardened(folder))
    assert str(bad) in info.value.message and "short secret" not in info.value.message
    pem = folder / "server.key"
    pem.write_text("-----BEGIN PRIVATE KEY-----\nc2VjcmV0LXN0dWZm\n-----END PRIVATE KEY-----\n")
    with pytest.raises(FailedPrecondition) as info2:
        server_flags(hardened(folder))
    assert "c2VjcmV0" not in info2.value.message and str(pem) in info2.value.message


@pytest.mark.parametrize(("details", "kind"), [
    ("This protocol is restricted, expecting header 'triton-grpc-protocol-embedcar-key'", "refused"),
    ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Tls handshake failed "
     "(TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: CERTIFICATE_VERIFY_FAILED", "refused"),
    ("failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1: Socket closed", "down"),
    ("Connection reset by peer (SSL_ERROR_SYSCALL)", "down"),
    ("failed to connect to all addresses; last error: Connection refused", "down"),
])
def test_refused_credentials_are_told_apart_from_an_outage(details: str, kind: str) -> None:
    """The strings grpcio 1.85 and Triton 2.51 produce (seen in tests/test_triton_tls.py): a refusal is a
    configuration error; a cut or refused connection stays Unavailable (failover, fallback)."""
    import grpc

    from inference.backends.triton import CredentialsRefused, map_error
    from inference.errors import Unavailable

    err = map_error(grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                         details), "t1:8001")
    assert isinstance(err, CredentialsRefused if kind == "refused" else Unavailable), err
    assert err.message.startswith("Triton t1:8001:")


def test_the_fault_suite_finds_a_leaked_key(pool: PoolFiles, tmp_path: Path) -> None:
    from loadtest.faults.common import check_no_key_material
    from loadtest.faults.result import ScenarioResult

    t = hardened(tls_dir(pool, tmp_path))
    (tmp_path / "sidecar.log").write_text("INFO started\n")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "tritonserver.log").write_text("I1202 ready\n")
    clean = ScenarioResult("x", "x")
    check_no_key_material(clean, t, tmp_path)
    assert clean.passed and clean.checks[0].measured.startswith("0 of 2")
    key_body = "".join(pool.clients["sidecar"][1].read_text().splitlines()[1:-1])
    for leak in (pool.client_key.read_text().strip(), key_body[10:60]):
        (tmp_path / "a" / "tritonserver.log").write_text(f"I1202 oops {leak}\n")
        leaked = ScenarioResult("x", "x")
        check_no_key_material(leaked, t, tmp_path)
        assert not leaked.passed and "tritonserver.log" in leaked.checks[0].measured
    local = ScenarioResult("x", "x")
    check_no_key_material(local, Settings.load(environ={}).triton, tmp_path)
    assert not local.checks  # the local profile has no Triton keys to look for
