"""Hostile passwords for the credential tests, and how a leak of one could look.

Every password is distinctive (``ary`` in the middle) so that a form of it showing up
in a text is a leak, not a coincidence. ``leak_forms`` is written independently of
``persist_lib.location.redaction`` (a test must not trust the code it checks).
"""

from __future__ import annotations

import json
import re
from urllib.parse import quote, quote_plus

CANARY = "canary-S3cr3t-pw"

NASTY_PASSWORDS: tuple[str, ...] = (
    CANARY,
    "can'ary-pw",  # single quote (got past the old regex)
    'can"ary-pw',  # double quote
    "can@ary-pw",  # the userinfo delimiter
    "can:ary-pw",  # the user:password delimiter
    "can/ary-pw",  # ends the authority
    "can%ary-pw",  # a bare percent
    "can#ary-pw",  # starts a fragment
    "can?ary-pw",  # starts a query
    "can&ary-pw",  # separates parameters
    "can ary pw",  # blanks
    "can%40ary%2Fpw",  # looks percent-encoded already
    "c\u00e4n\u00e4ry-pw-\u20ac",  # unicode
    "can=ary+pw",  # '=' and '+' (a space in form encoding)
    "can\\ary-pw",  # a backslash (escaped in reprs)
    "c'a\"n@a:r/y%2 #?&=+pw",  # all of them at once
)


def leak_forms(pw: str) -> set[str]:
    """Every spelling under which ``pw`` would count as leaked."""
    enc = quote(pw, safe="")
    return {
        pw,
        enc,
        re.sub(r"%[0-9A-F]{2}", lambda m: m.group().lower(), enc),
        quote(pw),
        quote_plus(pw),
        quote_plus(pw, safe=""),
        repr(pw)[1:-1],
        json.dumps(pw)[1:-1],
        json.dumps(pw, ensure_ascii=False)[1:-1],
        pw.encode("unicode_escape").decode("ascii"),
    }


def leaks(text: str, pw: str) -> list[str]:
    """The forms of ``pw`` that ``text`` shows (empty: no leak)."""
    return sorted(f for f in leak_forms(pw) if f and f in text)


def assert_no_leak(texts: list[str], pw: str, what: str = "") -> None:
    for t in texts:
        found = leaks(t, pw)
        assert not found, f"{what}: password {pw!r} leaked as {found} in: {t[:3000]}"
