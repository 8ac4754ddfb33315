"""Webhook request authentication: a bearer token, or an HMAC-SHA256 signature of the raw body.

Pure functions (no I/O, a clock passed in), every comparison constant-time
(``hmac.compare_digest`` on bytes). A check returns None when the request is
authentic, else a short reason for the 401 answer that never echoes a secret.

- ``token``: ``Authorization: Bearer <token>``.
- ``hmac_sha256``: a header (``signature_header``) holding the hex HMAC-SHA256 of the
  body, optionally prefixed ``sha256=``.
- ``github``: ``X-Hub-Signature-256: sha256=<hex HMAC-SHA256 of the body>``.
- ``stripe``: ``Stripe-Signature: t=<unix seconds>,v1=<hex>[,v1=<hex>...]``, each ``v1``
  the HMAC-SHA256 of ``<t>.<body>``; ``t`` must lie within the tolerance of now (a
  replayed request is refused once it is older).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Callable, Mapping
from typing import Literal

AuthMode = Literal["token", "hmac_sha256", "github", "stripe", "none"]
GITHUB_HEADER = "x-hub-signature-256"
STRIPE_HEADER = "stripe-signature"

_HEX64 = re.compile(r"[0-9a-fA-F]{64}")
_MAX_STRIPE_PARTS = 16

# (headers with lower-case names, raw body) -> None when authentic, else the reason
Verifier = Callable[[Mapping[str, str], bytes], "str | None"]


def needs_body(mode: AuthMode) -> bool:
    """Whether the check covers the body (a signature), so it runs after the body is read."""
    return mode in ("hmac_sha256", "github", "stripe")


def check_bearer(authorization: str | None, token: bytes) -> str | None:
    """``Authorization: Bearer <token>``, compared in constant time."""
    if not authorization:
        return "missing bearer token"
    scheme, _, given = authorization.partition(" ")
    ok = hmac.compare_digest(given.strip().encode("utf-8", "replace"), token)
    return None if scheme.lower() == "bearer" and ok else "unauthorized"


def _mac(secret: bytes, payload: bytes) -> bytes:
    return hmac.new(secret, payload, hashlib.sha256).hexdigest().encode()


def check_hex_signature(value: str | None, body: bytes, secret: bytes) -> str | None:
    """A hex HMAC-SHA256 of the body, with or without a ``sha256=`` prefix."""
    if not value:
        return "missing signature"
    given = value.strip()
    if given[:7].lower() == "sha256=":
        given = given[7:]
    if not _HEX64.fullmatch(given):
        return "malformed signature"
    ok = hmac.compare_digest(given.lower().encode(), _mac(secret, body))
    return None if ok else "signature does not match"


def check_github(value: str | None, body: bytes, secret: bytes) -> str | None:
    """GitHub's ``X-Hub-Signature-256: sha256=<hex>``: the prefix is required."""
    if value and not value.strip().lower().startswith("sha256="):
        return "malformed signature"
    return check_hex_signature(value, body, secret)


def check_stripe(
    value: str | None, body: bytes, secret: bytes, *, tolerance_s: float, now: float
) -> str | None:
    """Stripe's ``t=<ts>,v1=<hex>...``: any ``v1`` matching ``<t>.<body>``, ``t`` within tolerance."""
    if not value:
        return "missing signature"
    parts = value.split(",")
    if len(parts) > _MAX_STRIPE_PARTS:
        return "malformed signature"
    stamps, sigs = [], []
    for part in parts:
        k, _, v = part.strip().partition("=")
        if k == "t":
            stamps.append(v)
        elif k == "v1":
            sigs.append(v)
    if len(stamps) != 1 or not stamps[0].isascii() or not stamps[0].isdigit() or not sigs:
        return "malformed signature"
    if len(stamps[0]) > 12 or abs(now - int(stamps[0])) > tolerance_s:
        return "timestamp outside the tolerance"
    expected = _mac(secret, stamps[0].encode() + b"." + body)
    # Every candidate is compared (no early exit) so timing says nothing about which matched.
    ok = False
    for sig in sigs:
        same = bool(_HEX64.fullmatch(sig)) and hmac.compare_digest(sig.lower().encode(), expected)
        ok = same or ok
    return None if ok else "signature does not match"


def verifier(
    mode: AuthMode,
    key: str | None,
    *,
    signature_header: str = "x-signature-256",
    tolerance_s: float = 300.0,
    clock: Callable[[], float],
) -> Verifier:
    """The check of one auth mode; ``key`` is the token or the HMAC secret (resolved)."""
    k = (key or "").encode("utf-8")
    header = signature_header.lower()
    if mode == "none":
        return lambda _h, _b: None
    if mode == "token":
        return lambda h, _b: check_bearer(h.get("authorization"), k)
    if mode == "github":
        return lambda h, b: check_github(h.get(GITHUB_HEADER), b, k)
    if mode == "stripe":
        return lambda h, b: check_stripe(
            h.get(STRIPE_HEADER), b, k, tolerance_s=tolerance_s, now=clock()
        )
    return lambda h, b: check_hex_signature(h.get(header), b, k)
