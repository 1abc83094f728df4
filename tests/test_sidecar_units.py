"""Pure units of the sidecar: auth, rate limit, admission, error mapping, HTTP body parsing, proto."""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

import grpc
import pytest

from embedcar_client.client import from_grpc
from embedcar_client.proto.generate import GENERATED, PROTO_DIR, generate
from embedcar_settings import Settings
from inference.errors import (
    ERROR_CODES,
    DeadlineExceeded,
    EmbedcarError,
    FailedPrecondition,
    Internal,
    InvalidInput,
    ModelError,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    Unauthenticated,
    Unavailable,
    error_for_grpc,
    error_for_http,
)
from sidecar.admission import Admission
from sidecar.auth import ANONYMOUS, KeyRing, check_bind, parse_keys_file
from sidecar.errors import status
from sidecar.http_api import EmbeddingsBody, parse_embeddings_request
from sidecar.ratelimit import RateLimiter
from sidecar.settings import SidecarSettings


# --- proto ------------------------------------------------------------------------------------
def test_committed_generated_code_matches_the_proto() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
    for name in GENERATED:
        assert (PROTO_DIR / name).read_bytes() == fresh[name], (
            f"embedcar_client/proto/{name} is stale: run `python -m embedcar_client.proto.generate`")


# --- auth -------------------------------------------------------------------------------------
def test_keys_from_settings_and_file(tmp_path: Path) -> None:
    hashed = hashlib.sha256(b"k-file-2-0123456789").hexdigest()
    f = tmp_path / "keys"
    f.write_text(f"# tenants\nshop-c k-file-1-0123456789\nshop-d sha256:{hashed}\n\n")
    f.chmod(0o600)
    ring = KeyRing.from_settings(SidecarSettings(api_keys="shop-a=ka-0123456789abcdef, shop-b=kb-0123456789abcdef",
                                                 api_keys_file=f))
    assert ring.tenant_for("ka-0123456789abcdef") == "shop-a"
    assert ring.tenant_for("kb-0123456789abcdef") == "shop-b"
    assert ring.tenant_for("k-file-1-0123456789") == "shop-c"
    assert ring.tenant_for("k-file-2-0123456789") == "shop-d"
    for bad in (None, "", "kc", "ka-0123456789abcdef "):
        with pytest.raises(Unauthenticated):
            ring.tenant_for(bad)
    assert "ka-0123456789abcdef" not in repr(ring)


def test_no_keys_means_anonymous_and_loopback_only() -> None:
    ring = KeyRing.from_settings(SidecarSettings())
    assert not ring.enabled
    assert ring.tenant_for(None) == ANONYMOUS
    check_bind("127.0.0.1", ring)
    check_bind("::1", ring)
    with pytest.raises(InvalidInput, match="without API keys"):
        check_bind("0.0.0.0", ring)
    check_bind("0.0.0.0", KeyRing.from_settings(SidecarSettings(api_keys="a=b-0123456789abcdef")))


def test_bad_keys_file_names_line_not_content(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("only-one-field-secretvalue\n")
    f.chmod(0o600)
    with pytest.raises(InvalidInput) as err:
        parse_keys_file(f)
    assert "secretvalue" not in err.value.message
    with pytest.raises(InvalidInput):
        KeyRing.from_settings(SidecarSettings(api_keys="no-separator"))


def test_secret_settings_are_redacted() -> None:
    s = Settings.load(environ={"EMBEDCAR_SIDECAR_API_KEYS": "a=supersecret"})
    assert "supersecret" not in repr(s.describe())


def test_each_layer_adds_its_section() -> None:
    from catalog import settings as catalog
    from inference import settings as inference
    from sidecar import settings as sidecar

    env = {"EMBEDCAR_MODEL_VARIANT": "int8", "EMBEDCAR_CATALOG_TEXT_FIELDS": "title, aisle",
           "EMBEDCAR_SIDECAR_MAX_ROWS_PER_PASS": "8", "EMBEDCAR_DEMO_PORT": "0"}
    layers = [inference.Settings, catalog.Settings, sidecar.Settings, Settings]
    assert [list(cls.load(environ=env).describe()) for cls in layers] == [
        ["model", "triton"], ["model", "triton", "catalog"], ["model", "triton", "catalog", "sidecar"],
        ["model", "triton", "catalog", "sidecar", "demo"]]
    s = Settings.load(environ=env, overrides={"sidecar": {"grpc_port": 0}})
    assert all(isinstance(s, cls) for cls in layers)  # the top one passes wherever a lower one is asked for
    assert (s.model.variant, s.catalog.text_fields, s.sidecar.max_rows_per_pass, s.demo.port) == (
        "int8", ("title", "aisle"), 8, 0)
    changed = s.with_section("sidecar", backend="triton")
    assert type(changed) is Settings and changed.sidecar.backend == "triton" and changed.sidecar.grpc_port == 0


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


def test_admission_prices_the_queue_over_the_lanes_that_drain_it() -> None:
    one, two = (Admission(max_outstanding_items=100, s_per_token=1e-4, lanes=n) for n in (1, 2))
    for a in (one, two):
        a.admit(4, 64, deadline=None)  # 6.4 ms of work queued
    assert one.drain_s() == pytest.approx(0.0064) and two.drain_s() == pytest.approx(0.0032)
    two.admit(1, 16, deadline=100.005, now=100.0)  # 3.2 ms behind two lanes + 1.6 ms of its own: fits
    with pytest.raises(Overloaded):
        one.admit(1, 16, deadline=100.005, now=100.0)  # 6.4 + 1.6 ms on one lane does not


def test_admission_budget_sheds_a_standing_queue_not_a_burst() -> None:
    a = Admission(max_outstanding_items=1000, s_per_token=1e-4, budget_s=0.010)  # 16 tokens ~ 1.6 ms
    burst = [a.admit(1, 16, deadline=110.0, now=100.0) for _ in range(12)]  # up to 17.6 ms queued: a burst
    assert not a.shedding
    admitted = 0
    with pytest.raises(Overloaded, match="queueing budget") as err:
        while True:  # the queue stays long: a standing queue, refused once the average says so
            burst.append(a.admit(1, 16, deadline=110.0, now=100.0))
            admitted += 1
    assert a.shedding and admitted >= 3 and err.value.retry_after_s is not None and err.value.retry_after_s > 0
    for t in burst:
        a.release(t)
    while a.shedding:  # an idle backend: the average falls, shedding ends
        a.release(a.admit(1, 16, deadline=110.0, now=100.0))
    assert a.standing_s < a.budget_s / 2
    assert Admission(max_outstanding_items=100, s_per_token=1e-4).budget_s == 0.0  # off: deadline only


def test_admission_budget_bounds_the_wait_not_the_request() -> None:
    a = Admission(max_outstanding_items=100, s_per_token=1e-4, budget_s=0.010, standing_alpha=1.0)
    big = a.admit(8, 160, deadline=110.0, now=100.0)  # 16 ms alone, over the budget: idle, so admitted
    with pytest.raises(Overloaded):
        a.admit(1, 16, deadline=110.0, now=100.0)  # would wait 16 ms
    a.release(big)
    # A backend slower per call than the budget: each request may still wait for one other.
    slow = Admission(max_outstanding_items=100, s_per_token=1e-4, s_per_call=0.020, budget_s=0.010,
                     standing_alpha=1.0)
    slow.admit(1, 16, deadline=110.0, now=100.0)
    slow.admit(1, 16, deadline=110.0, now=100.0)  # waits ~21.6 ms <= its own ~21.6 ms
    with pytest.raises(Overloaded):
        slow.admit(1, 16, deadline=110.0, now=100.0)  # would wait ~23.2 ms


def test_admission_learns_backend_speed() -> None:
    a = Admission(max_outstanding_items=10, s_per_token=1e-4, alpha=0.5)
    a.observe(100, 0.1)  # 1 ms per token
    assert a.s_per_token == pytest.approx(0.5 * 1e-4 + 0.5 * 1e-3)


# --- error mapping ----------------------------------------------------------------------------
@pytest.mark.parametrize(("exc", "code", "http"), [
    (InvalidInput("x"), grpc.StatusCode.INVALID_ARGUMENT, 400),
    (PayloadTooLarge("x"), grpc.StatusCode.INVALID_ARGUMENT, 413),
    (Unauthenticated("x"), grpc.StatusCode.UNAUTHENTICATED, 401),
    (Overloaded("x"), grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
    (DeadlineExceeded("x"), grpc.StatusCode.DEADLINE_EXCEEDED, 504),
    (Unavailable("x"), grpc.StatusCode.UNAVAILABLE, 503),
    (ModelError("x"), grpc.StatusCode.FAILED_PRECONDITION, 500),
    (FailedPrecondition("x"), grpc.StatusCode.FAILED_PRECONDITION, 400),
    (NotFound("x"), grpc.StatusCode.NOT_FOUND, 404),
    (Internal("x"), grpc.StatusCode.INTERNAL, 500),
    (EmbedcarError("x"), grpc.StatusCode.INTERNAL, 500),
])
def test_error_mapping(exc: EmbedcarError, code: grpc.StatusCode, http: int) -> None:
    assert status(exc)[:2] == (code, http)
    assert exc.code == code.name.lower() == type(exc).code  # the metric label, on instance and class


def test_inverse_lookups_give_the_general_class() -> None:
    for cls, row in ERROR_CODES.items():
        assert issubclass(cls, error_for_grpc(row.grpc))  # a gRPC status comes back as cls or a base
        assert ERROR_CODES[error_for_http(row.http)].http == row.http  # HTTP shares statuses: the status holds
    assert error_for_http(400) is InvalidInput and error_for_http(500) is Internal
    assert error_for_http(413) is PayloadTooLarge and error_for_http(422) is InvalidInput
    assert error_for_http(502) is Internal and error_for_grpc("UNKNOWN") is Internal
    assert error_for_grpc("FAILED_PRECONDITION") is FailedPrecondition


def test_client_side_mapping_keeps_code_and_hint() -> None:
    e = from_grpc(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", 0.25)
    assert isinstance(e, Overloaded) and e.code == "resource_exhausted" and e.retry_after_s == 0.25
    assert isinstance(from_grpc(grpc.StatusCode.UNKNOWN, None), Internal)
    assert isinstance(from_grpc(grpc.StatusCode.RESOURCE_EXHAUSTED, "message larger than max (5 vs. 4)"),
                      PayloadTooLarge)  # grpc's own size check: the caller's fault
    # A configuration error reaches the client as itself, not as a retryable Unavailable.
    e = from_grpc(grpc.StatusCode.FAILED_PRECONDITION, "no product index loaded")
    assert isinstance(e, FailedPrecondition) and not isinstance(e, Unavailable)


# --- HTTP body parsing ------------------------------------------------------------------------
def test_openai_body_parsing() -> None:
    assert parse_embeddings_request(b'{"input": "milk"}') == EmbeddingsBody(["milk"], "float", None, None)
    assert parse_embeddings_request(b'{"input": ["a", "b"], "model": "m", "encoding_format": "base64", '
                                    b'"dimensions": 3}') == EmbeddingsBody(["a", "b"], "base64", "m", 3)
    for body, msg in [
        (b"\xff\xfe", "UTF-8"),
        (b"{not json", "not JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"input": 5}', "string or a list"),
        (b'{"input": ["a", 3]}', "string or a list"),
        (b'{"input": [[101, 102]]}', "token arrays"),
        (b'{"texts": ["a"]}', "unknown fields"),
        (b'{"input": "a", "dimensions": 0}', "dimensions"),
        (b'{"input": "a", "dimensions": "3"}', "dimensions"),
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
    from embedcar_client.proto import embedcar_pb2 as pb
    from sidecar.timings import STAGES, Timings

    assert tuple(f.name for f in pb.Timings.DESCRIPTOR.fields) == STAGES
    assert set(Timings(auth=1, total=2).as_dict()) == set(STAGES)
