"""How a value of a row reads in a text table: bytes as text.

A ``bytes`` value (e.g. the ``raw`` field of ``orders.errors``: the record that failed to
decode) is shown as its text when it is valid UTF-8, with control characters and
backslashes escaped (``\\n``, ``\\t``, ``\\x00``, ``\\\\``) so one value stays on one line; bytes
that are not UTF-8 are shown as ``\\xNN`` escapes among the text that is. ``--json``
output keeps bytes as hex (lossless for scripts).
"""

from __future__ import annotations

_ESCAPES = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def bytes_text(b: bytes | bytearray | memoryview) -> str:
    """``b'{"id": 1}\\n'`` -> ``{"id": 1}\\n`` (escaped, one line); ``b'\\xff'`` -> ``\\xff``."""
    text = bytes(b).decode("utf-8", "surrogateescape")  # a byte that is not UTF-8: U+DC80..
    out = []
    for ch in text:
        if 0xDC80 <= ord(ch) <= 0xDCFF:
            out.append(f"\\x{ord(ch) - 0xDC00:02x}")
        elif ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out)
