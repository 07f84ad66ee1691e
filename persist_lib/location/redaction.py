"""Keeping passwords out of reprs, logs and error messages.

A URI or DSN that may carry a secret is held as a ``SensitiveUrl``; its ``repr``/``str``
is a *redacted* form built by parsing the URI, not by pattern-matching its text:

* the userinfo password (``scheme://user:PASSWORD@host``) becomes ``****``;
* the value of every query parameter becomes ``****`` unless the parameter is one of
  ``HARMLESS_SETTINGS``, an allow-list of settings known to hold no secret (host names,
  ports, regions, modes, timeouts: ``region``, ``sslmode``, ``security_protocol``,
  ``group_id``, ...). Redacting by *name* (``password``, ``*secret*``, ``*token*``) let
  ``ssl_key_pem`` (a private key) and ``sasl_oauthbearer_config`` through; a secret
  under a name nobody thought of is now hidden too;
* a URL nested in an allowed query parameter (``endpoint_url=http://u:p@minio``) is
  redacted the same way;
* a libpq conninfo string (``host=h password=x``) is parsed with libpq's own parser,
  and its values shown by the same allow-list.

``redacted_settings`` / ``settings_secrets`` apply the same allow-list to a settings
mapping (a Kafka source's librdkafka configuration).

Correct by construction, also for hostile input: a URI is parsed three ways (as
``urllib`` splits it, as libpq splits it -- the userinfo ends at the first ``@`` unless
a ``/`` comes first --, and greedily up to the last ``@``); if the readings disagree
about where the password is (an unencoded ``@``, ``/``, ``?`` or ``#`` in the password,
a ``%`` not followed by two hex digits, a space, an ``&`` inside a secret parameter
that is not followed by a known parameter...) the URI is **ambiguous**: its redacted
form keeps only the scheme (``postgresql://****``), ``SensitiveUrl.problem`` says what
to percent-encode, and ``open_blob``/``open_consensus`` refuse it before any driver
sees it (a driver's error message would quote a piece of the password).

Every candidate secret of every reading, in every spelling a message could show it
(raw, percent-decoded, percent-encoded upper and lower case, ``+``-encoded, Python- and
JSON-escaped), is known to the ``SensitiveUrl``: ``scrub(text)`` replaces all of them,
for error messages that quote what a driver said. ``redact(text)`` is the best effort
for text that does not come with its URI (it removes userinfo passwords and
secret-named parameters by pattern; it over-redacts rather than under-redacts).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Iterable
from typing import Any, NamedTuple
from urllib.parse import quote, quote_plus, unquote, unquote_plus, urlsplit

__all__ = [
    "HARMLESS_SETTINGS",
    "REDACTED",
    "SensitiveUrl",
    "is_harmless_name",
    "is_secret_name",
    "redact",
    "redacted_dataclass_repr",
    "redacted_settings",
    "scrub",
    "secret_forms",
    "settings_secrets",
]

REDACTED = "****"

# Parameter names whose value is a secret (case-insensitive, anywhere in the name):
# scrubbed from messages whatever their length, and never shown even if allow-listed.
# (librdkafka: sasl.password, sasl.oauthbearer.config / .client.secret, ssl.key.pem,
# ssl.key.password, ssl.keystore.password, ssl.certificate.pem, sasl.kerberos.keytab.)
_SECRET_WORDS = (
    r"password|passwd|pwd|passfile|passphrase|secret|token|signature|credential|"
    r"pem|keytab|private|jaas|oauthbearer[._\-]config|api[._\-]?key|ssl[._\-]?key"
)
_SECRET_NAME_RE = re.compile(rf"[A-Za-z0-9_.\-]*(?:{_SECRET_WORDS})[A-Za-z0-9_.\-]*", re.I)

# Parameters some URI form accepts: an '&' inside a secret value that is followed by
# one of these ends the secret; followed by anything else, the URI is ambiguous.
_STATIC_PARAMS = frozenset(
    {
        # s3 blob / landing zone
        "endpoint_url", "region", "access_key_id", "secret_access_key", "session_token",
        # sqlite consensus
        "synchronous", "busy_timeout_ms",
        # unreliable+ wrappers
        "unreliable_seed", "unreliable_rate", "unreliable_stall", "unreliable_stall_s",
        # libpq (the rest is read from libpq itself)
        "host", "hostaddr", "port", "dbname", "user", "password", "passfile", "options",
        "application_name", "connect_timeout", "sslmode", "sslpassword", "target_session_attrs",
    }
)  # fmt: skip


# librdkafka's secret-bearing settings, as kafka:// URL parameters ('_' for '.').
_KAFKA_SECRET_PARAMS = frozenset(
    {
        "sasl_username", "sasl_password", "sasl_oauthbearer_config",
        "sasl_oauthbearer_client_id", "sasl_oauthbearer_client_secret",
        "sasl_oauthbearer_token_endpoint_url", "sasl_oauthbearer_extensions",
        "sasl_kerberos_keytab", "sasl_kerberos_principal", "ssl_key_pem", "ssl_key_location",
        "ssl_key_password", "ssl_keystore_location", "ssl_keystore_password",
        "ssl_certificate_pem", "ssl_certificate_location", "ssl_ca_pem", "ssl_ca_location",
    }
)  # fmt: skip

# Settings whose values are shown in reprs, ``describe()`` and error messages: known to
# hold no secret. Everything else is ``****``. Names are compared lower-case with '.'
# and '-' read as '_' (``bootstrap.servers`` = ``bootstrap_servers``).
HARMLESS_SETTINGS = frozenset(
    {
        # s3 blob / landing zone (endpoint_url: a nested URL, itself redacted)
        "endpoint_url", "region",
        # sqlite consensus
        "synchronous", "busy_timeout_ms",
        # unreliable+ wrappers
        "unreliable_seed", "unreliable_rate", "unreliable_stall", "unreliable_stall_s",
        # libpq: where to connect, as whom, how (never a password, a key or a file)
        "host", "hostaddr", "port", "dbname", "user", "connect_timeout", "sslmode",
        "sslnegotiation", "sslcompression", "gssencmode", "channel_binding", "require_auth",
        "ssl_min_protocol_version", "ssl_max_protocol_version", "target_session_attrs",
        "load_balance_hosts", "application_name", "fallback_application_name",
        "client_encoding", "keepalives", "keepalives_idle", "keepalives_interval",
        "keepalives_count", "tcp_user_timeout", "replication", "krbsrvname",
        # librdkafka: brokers, protocol and mechanism names, group, offsets, fetching,
        # timeouts (not sasl.username: with API keys it is half a credential)
        "bootstrap_servers", "metadata_broker_list", "security_protocol", "sasl_mechanism",
        "sasl_mechanisms", "sasl_kerberos_service_name", "sasl_oauthbearer_method",
        "ssl_endpoint_identification_algorithm", "enable_ssl_certificate_verification",
        "client_id", "client_rack", "group_id", "auto_offset_reset", "isolation_level",
        "enable_auto_commit", "enable_auto_offset_store", "enable_partition_eof",
        "session_timeout_ms", "heartbeat_interval_ms", "max_poll_interval_ms",
        "partition_assignment_strategy", "fetch_wait_max_ms", "fetch_min_bytes",
        "fetch_max_bytes", "fetch_message_max_bytes", "fetch_error_backoff_ms",
        "fetch_queue_backoff_ms", "queued_min_messages", "queued_max_messages_kbytes",
        "receive_message_max_bytes", "message_max_bytes", "socket_timeout_ms",
        "socket_connection_setup_timeout_ms", "socket_keepalive_enable",
        "socket_nagle_disable", "reconnect_backoff_ms", "reconnect_backoff_max_ms",
        "retry_backoff_ms", "retry_backoff_max_ms", "metadata_max_age_ms",
        "topic_metadata_refresh_interval_ms", "api_version_request",
        "api_version_request_timeout_ms", "broker_version_fallback", "broker_address_family",
        "allow_auto_create_topics", "check_crcs", "statistics_interval_ms", "log_level",
        "debug", "client_dns_lookup",
    }
)  # fmt: skip

# A value of a setting that is neither allow-listed nor secret-named is hidden in reprs
# whatever its length, and scrubbed from free text (error messages) from this length on:
# scrubbing a '1' or a 'true' from every message would garble them, and no key, token,
# certificate or configuration string is that short.
_MIN_SCRUBBED = 6


def _norm(name: str) -> str:
    return name.strip().lower().replace(".", "_").replace("-", "_")


def is_harmless_name(name: str) -> bool:
    """Whether a setting/query parameter named ``name`` may be shown (``HARMLESS_SETTINGS``)."""
    return _norm(name) in HARMLESS_SETTINGS and not is_secret_name(name)


def _shown_value(name: str, value: str) -> str:
    """``value`` as a repr may show the setting ``name``: itself if harmless (a nested
    URL redacted), else ``****``."""
    if not is_harmless_name(name):
        return REDACTED
    return _parse(value).redacted if "://" in value else value


def _hidden_values(items: Iterable[tuple[str, str]]) -> list[str]:
    """The values to scrub from text among ``(name, value)`` settings: every secret-named
    one, every other non-harmless one of ``_MIN_SCRUBBED`` characters or more, and the
    secrets of URLs nested in harmless ones."""
    out: list[str] = []
    for name, value in items:
        if not value:
            continue
        if is_harmless_name(name):
            if "://" in value:
                out += list(_parse(value).secrets)
        elif is_secret_name(name) or len(value) >= _MIN_SCRUBBED:
            out.append(value)
    return out


def _setting_items(settings: Any) -> list[tuple[str, str]]:
    return [
        (str(k), v.decode("utf-8", "replace") if isinstance(v, bytes) else v)
        for k, v in dict(settings or {}).items()
        if isinstance(v, str | bytes)
    ]


def redacted_settings(settings: Any) -> dict[str, Any]:
    """A settings mapping (librdkafka configuration, ...) as it may be shown: allow-listed
    values as they are, every other string ``****`` (numbers and booleans as they are)."""
    out: dict[str, Any] = {}
    for k, v in dict(settings or {}).items():
        if isinstance(v, bytes):
            v = v.decode("utf-8", "replace")
        out[str(k)] = _shown_value(str(k), v) if isinstance(v, str) else v
    return out


def settings_secrets(settings: Any) -> tuple[str, ...]:
    """Every spelling of every value of ``settings`` that must not show in a message
    (see ``_hidden_values``), longest first, for ``scrub``."""
    return secret_forms(_hidden_values(_setting_items(settings)))


@functools.cache
def _known_params() -> frozenset[str]:
    try:
        from psycopg.pq import Conninfo

        libpq = {o.keyword.decode() for o in Conninfo.get_defaults()}
    except Exception:  # noqa: BLE001 - psycopg missing or broken: the static list will do
        libpq = set()
    return _STATIC_PARAMS | HARMLESS_SETTINGS | _KAFKA_SECRET_PARAMS | libpq


def is_secret_name(name: str) -> bool:
    """Whether a parameter/field named ``name`` holds a secret (``password``, ``*_secret``...)."""
    return bool(_SECRET_NAME_RE.fullmatch(name.strip()))


def secret_forms(values: Iterable[str | None]) -> tuple[str, ...]:
    """Every spelling under which a message could show one of ``values``, longest first."""
    forms: set[str] = set()
    for v in values:
        if not v:
            continue
        for d in {v, unquote(v), unquote_plus(v)}:
            enc = quote(d, safe="")
            forms |= {
                d,
                enc,
                re.sub(r"%[0-9A-F]{2}", lambda m: m.group().lower(), enc),
                quote(d),
                quote_plus(d),
                quote_plus(d, safe=""),
                repr(d)[1:-1],
                json.dumps(d)[1:-1],
                json.dumps(d, ensure_ascii=False)[1:-1],
                d.replace("\\", "\\\\").replace("'", "\\'"),  # a libpq conninfo value
            }
    return tuple(sorted((f for f in forms if f), key=lambda f: (-len(f), f)))


def scrub(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every occurrence of every string in ``secrets`` replaced by ``****``
    (``secrets`` as ``secret_forms`` returns them: longest first)."""
    for s in secrets:
        if s and s in text:
            text = text.replace(s, REDACTED)
    return text


# -- free text (no URI at hand) -------------------------------------------------------

# scheme://user:PASSWORD@ -- the password runs to the last '@' of the non-blank run.
_USERINFO_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*://[^\s/:@]*):\S*@")
# name=value in a query string or a libpq conninfo (value possibly quoted)
_SECRET_PARAM_RE = re.compile(
    rf"(?<![A-Za-z0-9_])([A-Za-z0-9_.\-]*(?:{_SECRET_WORDS})[A-Za-z0-9_.\-]*)(\s*=\s*)"
    r"('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|[^&\s]*)",
    re.IGNORECASE,
)


_URL_TOKEN_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://\S+")


def redact(text: str) -> str:
    """``text`` with every URL password and secret-looking parameter replaced by ``****``.

    For text that does not come with its URI (when it does, use
    ``SensitiveUrl.scrub``, which knows the secrets exactly): each URL-looking token
    (up to a blank) is parsed and replaced by its redacted form, and its secrets are
    scrubbed from the whole text; then userinfo passwords and ``name=value`` secrets
    left over (a URL cut by a blank in its password, a libpq conninfo) go by pattern."""
    found: list[str] = []

    def one(m: re.Match[str]) -> str:
        parsed = _parse(m.group())
        found.extend(parsed.secrets)
        return parsed.redacted

    text = _URL_TOKEN_RE.sub(one, text)
    text = _USERINFO_RE.sub(lambda m: f"{m.group(1)}:{REDACTED}@", text)
    text = _SECRET_PARAM_RE.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", text)
    return scrub(text, sorted(set(found), key=lambda f: (-len(f), f)))


# -- parsing ---------------------------------------------------------------------------


class _Parsed(NamedTuple):
    redacted: str
    secrets: tuple[str, ...]  # secret_forms of every candidate secret
    problem: str | None  # why the URI is ambiguous (None: it is not)

    def __repr__(self) -> str:
        return (
            f"_Parsed(redacted={self.redacted!r}, secrets=<{len(self.secrets)} hidden>, "
            f"problem={self.problem!r})"
        )


_SCHEME_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*)://")
_CONNINFO_RE = re.compile(r"\s*[A-Za-z_][A-Za-z0-9_]*\s*=")
_BAD_PERCENT_RE = re.compile(r"%(?![0-9A-Fa-f]{2})")
_ENCODE_HINT = (
    "percent-encode it (e.g. urllib.parse.quote(password, safe='')): '@' as %40, '/' as "
    "%2F, '?' as %3F, '#' as %23, '&' as %26, '%' as %25, a space as %20"
)


def _password_of(userinfo: str) -> str | None:
    return userinfo.partition(":")[2] if ":" in userinfo else None


def _port_ok(hostport: str) -> bool:
    port = hostport.rpartition("]")[2] if hostport.startswith("[") else hostport
    return ":" not in port or port.partition(":")[2].isdigit() or not port.partition(":")[2]


def _is_known_param(piece: str) -> bool:
    name, eq, _ = piece.partition("=")
    return bool(eq) and unquote(name).lower() in _known_params()


@functools.lru_cache(maxsize=4096)
def _parse(raw: str) -> _Parsed:
    m = _SCHEME_RE.match(raw)
    if m is None:
        return _parse_conninfo(raw)
    scheme = m.group(1).lower()
    rest = raw[m.end() :]
    candidates: list[str] = []
    problems: list[str] = []

    # -- where is the password? three readings that must agree --------------------
    # greedy: up to the last '@' before the query (which starts at the first '?' followed
    # by a known parameter: a '?' in an unencoded password does not start it); an empty
    # authority, as in file:///dir or sqlite:///path, has no userinfo at all
    qpos = [i for i, c in enumerate(rest) if c == "?" and _is_known_param(rest[i + 1 :])]
    head = rest[: qpos[0]] if qpos else rest
    last_at = head.rfind("@")
    pw_greedy = _password_of(head[:last_at]) if last_at >= 0 and rest[:1] != "/" else None
    first = re.search(r"[@/]", rest)
    pw_libpq = _password_of(rest[: first.start()]) if first and first.group() == "@" else None
    try:
        parts = urlsplit(raw)
        netloc, path, query, fragment = parts.netloc, parts.path, parts.query, parts.fragment
    except ValueError:
        parts = None  # not a URI at all (the opener says so): show only its scheme
        netloc = path = query = fragment = ""
    userinfo, at, hostport = netloc.rpartition("@")
    pw_std = _password_of(userinfo) if at else None
    candidates += [p for p in (pw_greedy, pw_libpq, pw_std) if p]
    # a ':' in the authority followed by something that is not a port, with an '@'
    # further on: an unencoded '/', '?' or '#' ended the authority inside a password
    bad_port = (
        not at and "@" in rest[len(netloc) :] and any(not _port_ok(h) for h in netloc.split(","))
    )
    if bad_port or not pw_greedy == pw_libpq == pw_std:
        problems.append(
            "the password (or another part of the URI) contains '@', '/', '?' or '#': "
            + _ENCODE_HINT
        )
    elif pw_std is not None and (
        _BAD_PERCENT_RE.search(pw_std) or any(c.isspace() or not c.isprintable() for c in pw_std)
    ):
        problems.append(
            "the password contains a '%' not followed by two hex digits or a blank: " + _ENCODE_HINT
        )
    if any(c in raw for c in "\x00\r\n\t"):
        problems.append("control characters are not allowed")

    # -- query parameters ---------------------------------------------------------
    pieces = query.split("&") if query else []
    out_pieces: list[str] = []
    i = 0
    while i < len(pieces):
        name, eq, value = pieces[i].partition("=")
        secret = bool(eq) and is_secret_name(unquote(name))
        hidden = bool(eq) and not is_harmless_name(unquote(name))  # not allow-listed
        if secret or (eq and "://" in unquote(value)):
            # a secret, or a URL that may hold one (endpoint_url): an '&' not followed by
            # a known parameter may be part of it
            j = i + 1
            while j < len(pieces) and not _is_known_param(pieces[j]):
                j += 1
            whole = "&".join([value, *pieces[i + 1 : j]])
            if j == len(pieces) and fragment:
                whole += "#" + fragment
            if whole != value:
                problems.append(
                    f"the value of {unquote(name)!r} contains '&' or '#' (or is followed by an "
                    "unknown parameter): " + _ENCODE_HINT
                )
            if secret:
                candidates += [value, whole]
                out_pieces.append(f"{name}={REDACTED}")
            else:
                for v in {value, whole}:
                    nested = _parse(unquote(v))
                    candidates += list(nested.secrets)
                    if nested.problem:
                        problems.append(f"parameter {unquote(name)!r}: {nested.problem}")
                nested = _parse(unquote(value))
                if hidden:  # a URL in a setting not known to be harmless: hidden whole
                    candidates += _hidden_values([(unquote(name), value)])
                    out_pieces.append(f"{name}={REDACTED}")
                else:
                    out_pieces.append(f"{name}={nested.redacted}" if nested.secrets else pieces[i])
            i = j
            continue
        if hidden:
            candidates += _hidden_values([(unquote(name), value)])
            out_pieces.append(f"{name}={REDACTED}")
        else:
            out_pieces.append(pieces[i])
        i += 1

    # -- libpq's own reading, for Postgres URLs -------------------------------------
    base = scheme.rpartition("+")[2]
    if base in ("postgres", "postgresql") and parts is not None:
        inner = raw[m.end() - len(base) - 3 :]
        keep = [
            p for p in inner.partition("?")[2].split("&") if p and not p.startswith("unreliable_")
        ]
        inner = inner.partition("?")[0] + ("?" + "&".join(keep) if keep else "")
        try:
            from psycopg.conninfo import conninfo_to_dict

            params = conninfo_to_dict(inner)
        except ImportError:  # pragma: no cover - psycopg is a dependency
            params = {}
        except Exception:  # noqa: BLE001 - libpq rejects it (the opener says why, scrubbed)
            params = {}
        candidates += _hidden_values((k, str(v)) for k, v in params.items())
        if params and pw_std is not None and str(params.get("password", "")) != unquote(pw_std):
            problems.append("libpq reads another password from it: " + _ENCODE_HINT)

    secrets = secret_forms(candidates)
    if problems or parts is None:
        # Say nothing about a URI nobody can parse unambiguously but its scheme.
        problem = "; ".join(dict.fromkeys(problems)) or None
        return _Parsed(raw[: m.end()] + REDACTED, secrets, problem)
    out = raw[: m.end()]
    if at:
        user = userinfo.partition(":")[0]
        out += user + (f":{REDACTED}" if ":" in userinfo else "") + "@"
    out += hostport + path
    if "?" in raw:
        out += "?" + "&".join(out_pieces)
    if fragment:
        out += "#" + REDACTED
    # A safety net, not the mechanism: a secret that also shows elsewhere (a password
    # equal to the user name) is scrubbed there too.
    return _Parsed(scrub(out, secrets), secrets, None)


def _parse_conninfo(raw: str) -> _Parsed:
    """A string without ``scheme://``: a libpq conninfo (``k=v ...``) or plain text."""
    found = [m.group(3).strip("'\"") for m in _SECRET_PARAM_RE.finditer(raw)]
    if not _CONNINFO_RE.match(raw):
        # Not a URL, not a conninfo: a path or a name. Still catch a pasted secret.
        forms = secret_forms(found)
        return _Parsed(scrub(redact(raw), forms), forms, None)
    try:
        from psycopg.conninfo import conninfo_to_dict

        params = conninfo_to_dict(raw)
    except Exception:  # noqa: BLE001 - unparsable: show nothing of it
        return _Parsed(REDACTED, secret_forms(found), "libpq cannot parse it as a conninfo")
    secrets = _hidden_values((k, str(v)) for k, v in params.items())
    shown = " ".join(
        f"{k}={REDACTED}" if not is_harmless_name(k) else f"{k}={_conninfo_value(str(v))}"
        for k, v in params.items()
    )
    forms = secret_forms(found + secrets)
    return _Parsed(scrub(shown, forms), forms, None)


def _conninfo_value(v: str) -> str:
    if v and not re.search(r"[\s'\\]", v):
        return v
    return "'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'"


class SensitiveUrl:
    """A URI/DSN whose secrets never show in ``repr``/``str``/``format`` (``.raw`` is
    the real value; see the module docstring for how it is redacted)."""

    __slots__ = ("_raw",)

    def __init__(self, raw: str | SensitiveUrl) -> None:
        self._raw = raw.raw if isinstance(raw, SensitiveUrl) else str(raw)

    @property
    def raw(self) -> str:
        return self._raw

    @property
    def redacted(self) -> str:
        return _parse(self._raw).redacted

    @property
    def secrets(self) -> tuple[str, ...]:
        """Every spelling of every secret this URI may carry (longest first)."""
        return _parse(self._raw).secrets

    @property
    def problem(self) -> str | None:
        """Why the URI is ambiguous (where its password ends), or None."""
        return _parse(self._raw).problem

    def scrub(self, text: str) -> str:
        """``text`` (an error message, say) with this URI's secrets removed."""
        if self._raw:
            text = text.replace(self._raw, self.redacted)
        return scrub(redact(text), self.secrets)

    def __str__(self) -> str:
        return self.redacted

    def __repr__(self) -> str:
        return f"SensitiveUrl({self.redacted!r})"

    def __format__(self, spec: str) -> str:
        return format(self.redacted, spec)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SensitiveUrl) and other._raw == self._raw

    def __hash__(self) -> int:
        return hash(self._raw)

    def __reduce__(self) -> tuple[type[SensitiveUrl], tuple[str]]:
        return (SensitiveUrl, (self._raw,))


def scrub_all(text: str, *urls: str | SensitiveUrl | None) -> str:
    """``text`` with the secrets of every URI in ``urls`` (and free-text ones) removed."""
    text = redact(text)
    for u in urls:
        if u:
            text = SensitiveUrl(u).scrub(text)
    return text


_SENSITIVE_FIELD_RE = re.compile(rf"uri|url|dsn|conninfo|{_SECRET_WORDS}", re.I)


def redacted_value(name: str, value: Any) -> Any:
    """``value`` as a repr may show it: a string in a URI/DSN/secret-named field, or any
    string holding ``://``, becomes its redacted form; a secret-named field is ``****``."""
    if isinstance(value, SensitiveUrl):
        return value.redacted
    if not isinstance(value, str) or not value:
        return value
    if is_secret_name(name):
        return REDACTED
    if _SENSITIVE_FIELD_RE.search(name) or "://" in value:
        return SensitiveUrl(value).redacted
    return value


def redacted_dataclass_repr(obj: Any) -> str:
    """The repr ``@dataclass`` would generate, with URI/DSN/secret fields redacted."""
    shown = ", ".join(
        f"{f.name}={redacted_value(f.name, getattr(obj, f.name))!r}"
        for f in dataclasses.fields(obj)
        if f.repr
    )
    return f"{type(obj).__qualname__}({shown})"
