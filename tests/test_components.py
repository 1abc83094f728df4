"""tests/components.py: a component `make test` installed fails its tests when missing; the rest skip."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from inference.manifest import Manifest
from tests import components


def outcome(check: Callable[[], object]) -> tuple[str, str]:
    """("fail" | "skip" | "pass", message): a skip caught here, so it cannot pass itself off as this test's."""
    try:
        check()
    except pytest.fail.Exception as exc:
        return "fail", str(exc)
    except pytest.skip.Exception as exc:
        return "skip", str(exc)
    return "pass", ""


def test_a_refused_variant_of_the_bundled_model_is_a_failure(manifest: Manifest) -> None:
    without = dataclasses.replace(manifest, variants={k: v for k, v in manifest.variants.items() if k != "fp16"},
                                  refused={"fp16": {"min_cos": 0.5}})
    kind, message = outcome(lambda: components.require_variant(without, "fp16"))
    assert kind == "fail" and "refused at export" in message and "min_cos" in message
    assert outcome(lambda: components.require_variant(manifest, "fp32"))[0] == "pass"


def test_missing_triton_fails_where_make_installed_it_and_skips_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    from inference.triton import launcher

    monkeypatch.setattr(launcher, "triton_unavailable_reason", lambda: "the wheel is not installed")
    monkeypatch.setattr(components, "triton_platform", lambda: None)
    monkeypatch.setattr(components, "make_installed", lambda: True)
    kind, message = outcome(components.require_triton)
    assert kind == "fail" and "`make test` installs it" in message
    monkeypatch.setattr(components, "make_installed", lambda: False)  # a venv make did not build
    assert outcome(components.require_triton) == ("skip", "the wheel is not installed")
    monkeypatch.setattr(components, "make_installed", lambda: True)
    monkeypatch.setattr(components, "triton_platform", lambda: "needs Linux x86_64")  # cannot exist here
    assert outcome(components.require_triton)[0] == "skip"


def test_a_native_build_that_fails_with_the_toolchain_present_is_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    from loadtest import native

    monkeypatch.setattr(native, "native_unavailable_reason", lambda: "cannot build (error: expected ';')")
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(components, "GRPCPP_HEADER", Path(__file__))  # a file that exists
    kind, message = outcome(components.native_available)
    assert kind == "fail" and "expected ';'" in message
    monkeypatch.setattr(components, "GRPCPP_HEADER", Path("/nonexistent/generic_stub.h"))
    assert components.native_available() is False  # `make native` could not install gRPC's C++ library
