"""The P/D proxy's proof that it knows the shared secret, without sending the secret.

vLLM's OpenAI server logs each request's ``SamplingParams`` with ``--enable-log-requests``
(INFO), and its whole JSON body at DEBUG. ``kv_transfer_params`` is in both. So the proxy
sends a one-time token, never the secret itself: ``kv_transfer_params.kvtier_pd_auth`` =
``v1.<unix seconds>.<nonce: 32 hex>.<HMAC-SHA256(secret, "kvtier-pd-auth.v1.<seconds>.<nonce>"): 64 hex>``.

The prefill side accepts a token once: its MAC must match (constant time), its time must be
within :data:`WINDOW_S` of this host's clock, and its nonce unseen. A token copied from a log
is spent already on the instance that logged it. It stays valid on other prefill instances
with the same secret until its time leaves the window (docs/security.md).

Who calls it: :class:`~vllm_kvtier.plan.peer_plan.PeerPlanner`, from vLLM's scheduler thread
only. Pure: the caller passes the time. ``examples/pd_proxy.py`` mints the tokens (it does
not import the plugin; a test checks the two agree).
"""

from __future__ import annotations

import hashlib
import hmac
import re

#: The ``kv_transfer_params`` field carrying the token.
AUTH_PARAM = "kvtier_pd_auth"
#: The field older proxies sent the secret itself in: refused, never compared.
SECRET_PARAM = "kvtier_pd_secret"
#: A token's time may be this far from this host's clock, either way. It covers the time a
#: prefill request waits and runs before it finishes (the proxy gives it 300 s by default)
#: plus clock skew.
WINDOW_S = 600
#: Spent nonces kept (each until its token leaves the window): about 100 hand-offs per
#: second over the window. Past that, new tokens are refused (the decode side recomputes).
MAX_SPENT = 1 << 17
_TOKEN = re.compile(r"v1\.(\d{1,12})\.([0-9a-f]{32})\.([0-9a-f]{64})")


def mac(secret: bytes, seconds: int, nonce: str) -> str:
    """The token's MAC (hex) for ``seconds`` and ``nonce``."""
    return hmac.new(secret, f"kvtier-pd-auth.v1.{seconds}.{nonce}".encode(), hashlib.sha256).hexdigest()


def token(secret: bytes, seconds: int, nonce: str) -> str:
    """A token for ``seconds`` (unix time) and ``nonce`` (32 hex digits, never reused)."""
    return f"v1.{seconds}.{nonce}.{mac(secret, seconds, nonce)}"


class HandOffAuth:
    """Checks the tokens of one prefill instance and remembers the spent ones."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret
        #: nonce -> the time after which its token is stale anyway (insertion order)
        self._spent: dict[str, float] = {}

    def refusal(self, params: dict, now: float) -> str | None:
        """Why ``params`` (a request's ``kv_transfer_params``) proves nothing (None: it
        does, and its nonce is now spent). ``now``: unix time. The reason never holds the
        token or the secret."""
        if SECRET_PARAM in params:
            return f"{SECRET_PARAM} is not accepted (vLLM logs it): the proxy must send {AUTH_PARAM}"
        given = params.get(AUTH_PARAM)
        m = _TOKEN.fullmatch(given) if isinstance(given, str) and len(given) <= 128 else None
        if m is None:
            return f"no valid {AUTH_PARAM} (a shared secret is configured)"
        seconds, nonce, got = int(m[1]), m[2], m[3]
        if not hmac.compare_digest(got, mac(self._secret, seconds, nonce)):
            return f"wrong {AUTH_PARAM} (another secret)"
        if abs(now - seconds) > WINDOW_S:
            return f"stale {AUTH_PARAM} ({now - seconds:+.0f} s from this host's clock; at most {WINDOW_S} s)"
        self._forget_stale(now)
        if nonce in self._spent:
            return f"{AUTH_PARAM} already used"
        if len(self._spent) >= MAX_SPENT:
            return f"more than {MAX_SPENT} hand-offs within {2 * WINDOW_S} s"
        self._spent[nonce] = seconds + WINDOW_S
        return None

    def _forget_stale(self, now: float) -> None:
        # oldest first, stopping at the first live one: O(1) a call on average (tokens come
        # about in time order; one out of order only keeps a few stale nonces a little longer)
        while self._spent:
            oldest = next(iter(self._spent))
            if self._spent[oldest] >= now:
                break
            del self._spent[oldest]
