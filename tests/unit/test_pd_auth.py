"""The P/D hand-off token (plan/pd_auth.py): accepted once, with the right secret, within
the window; the secret itself, a wrong or malformed token, a stale one and a replay are
refused, and no refusal names the token."""

from __future__ import annotations

import pytest

from vllm_kvtier.plan import pd_auth
from vllm_kvtier.plan.pd_auth import HandOffAuth, token

SECRET = b"shared-secret-0123456789"
NOW = 1_800_000_000
NONCE = "0123456789abcdef" * 2


def params(tok: object) -> dict:
    return {"do_remote_decode": True, "kvtier_pd_auth": tok}


def test_a_token_is_accepted_once():
    auth = HandOffAuth(SECRET)
    t = token(SECRET, NOW, NONCE)
    assert auth.refusal(params(t), NOW + 5) is None
    assert auth.refusal(params(t), NOW + 6) == "kvtier_pd_auth already used"
    assert auth.refusal(params(token(SECRET, NOW, "f" * 32)), NOW + 6) is None  # another nonce


@pytest.mark.parametrize(("given", "now", "why"), [
    (token(b"another-secret-0123456789", NOW, NONCE), NOW, "wrong"),
    (token(SECRET, NOW, NONCE)[:-1] + "0", NOW, "wrong"),
    (token(SECRET, NOW, NONCE), NOW + pd_auth.WINDOW_S + 1, "stale"),
    (token(SECRET, NOW, NONCE), NOW - pd_auth.WINDOW_S - 1, "stale"),
    ("v1.1.2.3", NOW, "no valid"),
    (12345, NOW, "no valid"),
    (None, NOW, "no valid"),
    (token(SECRET, NOW, NONCE) + "0" * 200, NOW, "no valid"),
])
def test_a_wrong_stale_or_malformed_token_is_refused(given, now, why):
    reason = HandOffAuth(SECRET).refusal(params(given), now)
    assert reason is not None and why in reason and str(given) not in reason


def test_the_secret_itself_is_refused_even_when_right():
    reason = HandOffAuth(SECRET).refusal({"do_remote_decode": True, "kvtier_pd_secret": SECRET.decode(),
                                          "kvtier_pd_auth": token(SECRET, NOW, NONCE)}, NOW)
    assert reason is not None and "kvtier_pd_secret is not accepted" in reason and SECRET.decode() not in reason


def test_spent_nonces_are_bounded_and_forgotten_when_stale(monkeypatch):
    monkeypatch.setattr(pd_auth, "MAX_SPENT", 3)
    auth = HandOffAuth(SECRET)
    for i in range(3):
        assert auth.refusal(params(token(SECRET, NOW, f"{i:032x}")), NOW) is None
    full = auth.refusal(params(token(SECRET, NOW, f"{9:032x}")), NOW)
    assert full is not None and "hand-offs within" in full  # refused, never an unbounded set
    later = NOW + pd_auth.WINDOW_S + 1  # the three are stale now: forgotten, room again
    assert auth.refusal(params(token(SECRET, later, f"{9:032x}")), later) is None
