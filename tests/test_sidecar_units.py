"""Pure units of the sidecar: auth, rate limit, admission, error mapping, HTTP body parsing, proto."""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

import grpc
import pytest

from inference.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidInput,
    ModelError,
    Overloaded,
    Unauthenticated,
    Unavailable,
)
from inference.settings import Settings, SidecarSettings
from sidecar.admission import Admission
from sidecar.auth import ANONYMOUS, KeyRing, check_bind, parse_keys_file
from sidecar.errors import from_grpc, grpc_code, http_status
from sidecar.http_api import parse_embeddings_request
from sidecar.proto.generate import GENERATED, PROTO_DIR, generate
from sidecar.ratelimit import RateLimiter


# --- proto ------------------------------------------------------------------------------------
def test_committed_generated_code_matches_the_proto() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
    for name in GENERATED:
        assert (PROTO_DIR / name).read_bytes() == fresh[name], (
            f"sidecar/proto/{name} is stale: run `python -m sidecar.proto.generate`")


# --- auth -------------------------------------------------------------------------------------
def test_keys_from_settings_and_file(tmp_path: Path) -> None:
    hashed = hashlib.sha256(b"k-file-2").hexdigest()
    f = tmp_path / "keys"
    f.write_text(f"# tenants\nshop-c k-file-1\nshop-d sha256:{hashed}\n\n")
    ring = KeyRing.from_settings(SidecarSettings(api_keys="shop-a=ka, shop-b=kb", api_keys_file=f))
    assert ring.tenant_for("ka") == "shop-a"
    assert ring.tenant_for("kb") == "shop-b"
    assert ring.tenant_for("k-file-1") == "shop-c"
    assert ring.tenant_for("k-file-2") == "shop-d"
    for bad in (None, "", "kc", "ka "):
        with pytest.raises(Unauthenticated):
            ring.tenant_for(bad)
    assert "ka" not in repr(ring)


def test_no_keys_means_anonymous_and_loopback_only() -> None:
    ring = KeyRing.from_settings(SidecarSettings())
    assert not ring.enabled
    assert ring.tenant_for(None) == ANONYMOUS
    check_bind("127.0.0.1", ring)
    check_bind("::1", ring)
    with pytest.raises(InvalidInput, match="without API keys"):
        check_bind("0.0.0.0", ring)
    check_bind("0.0.0.0", KeyRing.from_settings(SidecarSettings(api_keys="a=b")))


def test_bad_keys_file_names_line_not_content(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("only-one-field-secretvalue\n")
    with pytest.raises(InvalidInput) as err:
        parse_keys_file(f)
    assert "secretvalue" not in err.value.message
    with pytest.raises(InvalidInput):
        KeyRing.from_settings(SidecarSettings(api_keys="no-separator"))


def test_secret_settings_are_redacted() -> None:
    s = Settings.load(environ={"EMBEDCAR_SIDECAR_API_KEYS": "a=supersecret"})
    assert "supersecret" not in repr(s.describe())


# --- rate limit -------------------------------------------------------------------------------
def test_token_bucket_per_tenant() -> None:
    rl = RateLimiter(rate_per_s=10, burst=3)
    for _ in range(3):
        rl.take("a", now=100.0)
    with pytest.raises(Overloaded) as err:
        rl.take("a", now=100.0)
    assert err.value.retry_after_s == pytest.approx(0.1)
    rl.take("b", now=100.0)  # another tenant has its own bucket
    rl.take("a", now=100.1)  # refilled one token after 0.1 s


# --- admission --------------------------------------------------------------------------------
def test_admission_deadlines_and_cap() -> None:
    a = Admission(max_outstanding_items=4, s_per_token=1e-4)  # 16 tokens ~ 1.6 ms, no fixed cost
    with pytest.raises(DeadlineExceeded):
        a.admit(1, 16, deadline=99.0, now=100.0)  # already expired
    with pytest.raises(DeadlineExceeded):
        a.admit(1, 16, deadline=100.001, now=100.0)  # 1 ms cannot fit 1.6 ms of work
    t1 = a.admit(3, 48, deadline=101.0, now=100.0)
    with pytest.raises(Overloaded) as err:
        a.admit(2, 32, deadline=101.0, now=100.0)  # 5 > cap of 4
    assert err.value.retry_after_s is not None and err.value.retry_after_s > 0
    with pytest.raises(Overloaded):
        a.admit(1, 16, deadline=100.006, now=100.0)  # fits alone, not behind 4.8 ms of queue
    a.release(t1)
    a.release(t1)  # twice is harmless
    assert a.outstanding_items == 0
    a.admit(4, 64, deadline=None)


def test_admission_budget_bounds_the_wait_not_the_request() -> None:
    a = Admission(max_outstanding_items=100, s_per_token=1e-4, budget_s=0.010)  # 16 tokens ~ 1.6 ms
    big = a.admit(8, 160, deadline=110.0, now=100.0)  # 16 ms alone, over the budget: idle, so admitted
    with pytest.raises(Overloaded, match="queueing budget") as err:
        a.admit(1, 16, deadline=110.0, now=100.0)  # the deadline allows it, the budget does not
    assert err.value.retry_after_s == pytest.approx(0.006)  # when the queue will be back within budget
    a.release(big)
    queued = [a.admit(1, 16, deadline=110.0, now=100.0) for _ in range(7)]  # waits of 0 .. 9.6 ms
    with pytest.raises(Overloaded):
        a.admit(1, 16, deadline=110.0, now=100.0)  # would wait 11.2 ms
    for t in queued:
        a.release(t)
    assert Admission(max_outstanding_items=100, s_per_token=1e-4).budget_s == 0.0  # off: deadline only
    # A backend slower per call than the budget: each request may still wait for one other.
    slow = Admission(max_outstanding_items=100, s_per_token=1e-4, s_per_call=0.020, budget_s=0.010)
    slow.admit(1, 16, deadline=110.0, now=100.0)
    slow.admit(1, 16, deadline=110.0, now=100.0)  # waits ~21.6 ms <= its own ~21.6 ms
    with pytest.raises(Overloaded):
        slow.admit(1, 16, deadline=110.0, now=100.0)  # would wait ~23.2 ms


def test_admission_learns_backend_speed() -> None:
    a = Admission(max_outstanding_items=10, s_per_token=1e-4, alpha=0.5)
    a.observe(100, 0.1)  # 1 ms per token
    assert a.s_per_token == pytest.approx(0.5 * 1e-4 + 0.5 * 1e-3)


# --- error mapping ----------------------------------------------------------------------------
@pytest.mark.parametrize(("exc", "code", "status"), [
    (InvalidInput("x"), grpc.StatusCode.INVALID_ARGUMENT, 400),
    (Unauthenticated("x"), grpc.StatusCode.UNAUTHENTICATED, 401),
    (Overloaded("x"), grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
    (DeadlineExceeded("x"), grpc.StatusCode.DEADLINE_EXCEEDED, 504),
    (Unavailable("x"), grpc.StatusCode.UNAVAILABLE, 503),
    (ModelError("x"), grpc.StatusCode.FAILED_PRECONDITION, 500),
    (FailedPrecondition("x"), grpc.StatusCode.FAILED_PRECONDITION, 400),
    (Internal("x"), grpc.StatusCode.INTERNAL, 500),
])
def test_error_mapping(exc: Exception, code: grpc.StatusCode, status: int) -> None:
    assert grpc_code(exc) == code  # type: ignore[arg-type]
    assert http_status(exc) == status  # type: ignore[arg-type]


def test_client_side_mapping_keeps_code_and_hint() -> None:
    e = from_grpc(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", 0.25)
    assert isinstance(e, Overloaded) and e.code == "resource_exhausted" and e.retry_after_s == 0.25
    assert isinstance(from_grpc(grpc.StatusCode.UNKNOWN, None), Internal)
    # A configuration error reaches the client as itself, not as a retryable Unavailable.
    e = from_grpc(grpc.StatusCode.FAILED_PRECONDITION, "no product index loaded")
    assert isinstance(e, FailedPrecondition) and not isinstance(e, Unavailable)


# --- HTTP body parsing ------------------------------------------------------------------------
def test_openai_body_parsing() -> None:
    assert parse_embeddings_request(b'{"input": "milk"}') == (["milk"], "float")
    assert parse_embeddings_request(b'{"input": ["a", "b"], "model": "m", "encoding_format": "base64"}') == (
        ["a", "b"], "base64")
    for body, msg in [
        (b"\xff\xfe", "UTF-8"),
        (b"{not json", "not JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"input": 5}', "string or a list"),
        (b'{"input": ["a", 3]}', "string or a list"),
        (b'{"input": [[101, 102]]}', "token arrays"),
        (b'{"texts": ["a"]}', "unknown fields"),
        (b'{"input": "a", "dimensions": 3}', "unknown fields"),
        (b'{"model": "m"}', "missing field"),
        (b'{"input": "a", "model": 1}', "model"),
        (b'{"input": "a", "encoding_format": "int8"}', "encoding_format"),
    ]:
        with pytest.raises(InvalidInput, match=msg):
            parse_embeddings_request(body)


def test_admission_calibration_splits_fixed_and_per_token_cost() -> None:
    a = Admission(max_outstanding_items=10)
    a.calibrate((16, 0.003), (516, 0.053))
    assert a.s_per_token == pytest.approx(1e-4)
    assert a.s_per_call == pytest.approx(0.0014)
    assert a.cost_s(16) == pytest.approx(0.003)


def test_one_list_of_stages_for_pipeline_metrics_client_and_proto() -> None:
    from sidecar.proto import embedcar_pb2 as pb
    from sidecar.timings import STAGES, Timings

    assert STAGES == tuple(f.name for f in pb.Timings.DESCRIPTOR.fields)
    assert set(Timings(auth=1, total=2).as_dict()) == set(STAGES)
