"""Webhook authentication and strict JSON, pure: GitHub's and Stripe's documented signature
schemes, checked with a fixed clock; hostile headers answered with a reason, never an error."""

from __future__ import annotations

import hashlib
import hmac

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conveyor.sources import strict_json
from conveyor.sources.webhook_auth import (
    check_bearer,
    check_github,
    check_hex_signature,
    check_stripe,
    verifier,
)

SECRET = b"It's a Secret to Everybody"
BODY = b"Hello, World!"


def test_github_documented_example():
    # GitHub's docs ("Validating webhook deliveries"): this secret and payload give this digest.
    sig = "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"
    assert check_github(sig, BODY, SECRET) is None
    assert check_github(sig, BODY + b" ", SECRET) == "signature does not match"
    assert check_github(sig.removeprefix("sha256="), BODY, SECRET) == "malformed signature"
    assert check_github(None, BODY, SECRET) == "missing signature"


def _stripe(t: int, body: bytes, secret: bytes = SECRET) -> str:
    return f"t={t},v1=" + hmac.new(secret, f"{t}.".encode() + body, hashlib.sha256).hexdigest()


def test_stripe_tolerance_both_ways_and_several_v1():
    now = 1_700_000_000
    assert check_stripe(_stripe(now, BODY), BODY, SECRET, tolerance_s=300, now=now + 300) is None
    late = check_stripe(_stripe(now, BODY), BODY, SECRET, tolerance_s=300, now=now + 301)
    assert late == "timestamp outside the tolerance"
    early = check_stripe(_stripe(now, BODY), BODY, SECRET, tolerance_s=300, now=now - 301)
    assert early == "timestamp outside the tolerance"
    both = _stripe(now, BODY, b"old") + "," + _stripe(now, BODY).split(",")[1] + ",v0=abc"
    assert check_stripe(both, BODY, SECRET, tolerance_s=300, now=now) is None
    two_t = f"t={now}," + _stripe(now, BODY)
    assert check_stripe(two_t, BODY, SECRET, tolerance_s=300, now=now) == "malformed signature"


def test_bearer_scheme_and_value():
    assert check_bearer("Bearer tok", b"tok") is None
    assert check_bearer("bearer tok", b"tok") is None
    assert check_bearer("Basic tok", b"tok") == "unauthorized"
    assert check_bearer("Bearer tok2", b"tok") == "unauthorized"
    assert check_bearer(None, b"tok") == "missing bearer token"


@given(st.text(max_size=300))
def test_hostile_headers_get_a_reason_never_an_exception(value: str):
    for check in (
        lambda v: check_bearer(v, b"t"),
        lambda v: check_github(v, BODY, SECRET),
        lambda v: check_hex_signature(v, BODY, SECRET),
        lambda v: check_stripe(v, BODY, SECRET, tolerance_s=300, now=0),
    ):
        assert isinstance(check(value), str | None)


def test_verifier_none_accepts_and_header_names_are_lower_case():
    v = verifier("none", None, clock=lambda: 0)
    assert v({}, b"") is None
    mac = hmac.new(b"k", BODY, hashlib.sha256).hexdigest()
    v = verifier("hmac_sha256", "k", signature_header="X-Sig", clock=lambda: 0)
    assert v({"x-sig": mac}, BODY) is None
    assert v({"x-sig": mac}, BODY + b"!") == "signature does not match"


@pytest.mark.parametrize(
    "text",
    ["NaN", "[Infinity]", '{"a": -Infinity}', "1e999", "[" * 50_000 + "]" * 50_000, b"\xff"],
)
def test_strict_json_refuses_what_would_not_be_json_again(text: str | bytes):
    with pytest.raises(ValueError):
        strict_json.loads(text)


def test_strict_json_keeps_ordinary_values_and_every_number_as_written():
    assert strict_json.loads(b'{"a": [1, 2.5, -0.0, "x", null, true]}') == {
        "a": [1, 2.5, -0.0, "x", None, True]
    }
    text = '{"a":[1,2.5,-0.0,1e308,1.10,-0,12345678901234567.89,"x",null,true]}'
    assert strict_json.dumps(strict_json.loads(text)) == text


def test_two_connectors_on_one_webhook_port_or_one_mqtt_session_are_refused():
    from conveyor.config.specs import dedupe, from_mapping

    def spec(name: str, source: dict[str, object]):
        return from_mapping(
            {"name": name, "kind": "source", "source": source},
            source=f"{name}.yaml",
            fallback_name=name,
        )

    hook = {"type": "webhook", "auth": "none", "port": 9001}
    out = dedupe([spec("a", hook), spec("b", hook), spec("c", {**hook, "port": 9002})])
    assert out[0].ok and out[2].ok
    assert "HTTP port 127.0.0.1:9001 is already used by connector 'a'" in str(out[1].error)
    mq = {"type": "mqtt", "topics": ["x/#"], "client_id": "same"}
    out = dedupe([spec("m1", mq), spec("m2", mq), spec("m3", {**mq, "port": 1884})])
    assert out[0].ok and out[2].ok
    assert "MQTT session 'same' on 127.0.0.1:1883 is already used by connector 'm1'" in str(
        out[1].error
    )
