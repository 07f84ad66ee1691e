"""librdkafka's secret-bearing settings never show (issue 26, defect 6): a Kafka source's
repr, ``describe()`` (recorded by Dagster in the ingestion summary), its error messages
and logs hide every setting value that is not on the allow-list of harmless settings
(``redaction.HARMLESS_SETTINGS``), whatever the setting is called."""

from __future__ import annotations

import logging
import traceback
from urllib.parse import quote

import pytest

from persist_lib.ingest.errors import IngestError
from persist_lib.ingest.kafka import KafkaSource
from persist_lib.location.redaction import (
    HARMLESS_SETTINGS,
    SensitiveUrl,
    is_harmless_name,
    redact,
    redacted_settings,
)
from tests.support.kafka_server import free_port
from tests.support.secrets import CANARY, NASTY_PASSWORDS, assert_no_leak

pytest.importorskip("confluent_kafka")

#: librdkafka settings that carry a secret (a password, a private key, an OAuth client
#: secret or unsecured-JWT config, a keytab), plus one nobody would call secret by its
#: name (SASL extensions can carry identity-pool ids and tokens).
KAFKA_SECRET_SETTINGS = (
    "sasl.password",
    "sasl.oauthbearer.config",
    "sasl.oauthbearer.client.secret",
    "sasl.oauthbearer.extensions",
    "ssl.key.pem",
    "ssl.key.password",
    "ssl.keystore.password",
    "ssl.certificate.pem",
    "sasl.kerberos.keytab",
)


def _sources(pw: str) -> list[KafkaSource]:
    """The secrets in the bootstrap URL (``_`` for ``.``, percent-encoded) and in ``config``."""
    enc = quote(pw, safe="")
    in_url = "&".join(f"{k.replace('.', '_')}={enc}" for k in KAFKA_SECRET_SETTINGS)
    url = f"kafka://alice:userinfo-pw@127.0.0.1:9?security_protocol=SASL_SSL&sasl_mechanism=PLAIN&{in_url}"
    out = [
        KafkaSource(url, "t"),
        KafkaSource("127.0.0.1:9", "t", config={k: pw for k in KAFKA_SECRET_SETTINGS}),
        KafkaSource(f"kafka://127.0.0.1:9?ssl_key={enc}", "t"),  # other spellings
        KafkaSource(f"kafka://127.0.0.1:9?group_id=g&sasl_jaas_config={enc}", "t"),
    ]
    for s in out:
        s.attach(None, "nasty")  # type: ignore[arg-type]
    return out


@pytest.mark.parametrize("pw", NASTY_PASSWORDS)
def test_kafka_secret_settings_never_show(pw: str) -> None:
    for src in _sources(pw):
        texts = [repr(src), str(src), repr([src]), repr(src.describe()), src._where()]
        # what a failure message quotes (librdkafka, the broker), scrubbed
        texts.append(src._scrub(f"broker said: {pw!r} / {quote(pw, safe='')} / {pw} is wrong"))
        assert_no_leak(texts, pw, repr(src))
        assert "127.0.0.1:9" in src._where()  # the host still shows
    url = _sources(pw)[0].describe()["bootstrap"]
    assert "security_protocol=SASL_SSL&sasl_mechanism=PLAIN" in url  # harmless settings show
    assert "ssl_key_pem=****" in url and "sasl_oauthbearer_config=****" in url


def test_kafka_failures_and_logs_hide_secret_settings(caplog: pytest.LogCaptureFixture) -> None:
    """A broker that is down, and librdkafka rejecting the configuration: the errors (with
    their chain and traceback) and the DEBUG logs show no secret setting's value."""
    caplog.set_level(logging.DEBUG)
    enc = quote(CANARY, safe="")
    conf = {k: CANARY for k in KAFKA_SECRET_SETTINGS if k != "sasl.kerberos.keytab"}
    texts: list[str] = []
    down = KafkaSource(
        f"kafka://alice:userinfo-pw@127.0.0.1:{free_port()}?security_protocol=SASL_PLAINTEXT"
        f"&sasl_oauthbearer_config={enc}",
        "t",
        timeout_s=1.0,
        config={"sasl.oauthbearer.extensions": CANARY},
    )
    down.attach(None, "down")  # type: ignore[arg-type]
    bad = KafkaSource("127.0.0.1:9", "t", config={**conf, "security.protocol": "SSL"})
    bad.attach(None, "bad")  # type: ignore[arg-type]
    for src in (down, bad):
        with pytest.raises(IngestError) as ei:
            src.partition_count()
        texts += ["".join(traceback.format_exception(ei.value)), repr(ei.value), repr(src.describe())]
    assert "invalid consumer configuration" in texts[-2]
    texts.append(caplog.text)
    texts += [r.getMessage() + repr(r.args) for r in caplog.records]
    assert_no_leak(texts, CANARY, "kafka failures")


def test_allow_list() -> None:
    """Harmless settings show, every other value is hidden; a secret-looking name is
    never harmless, even if it were listed."""
    shown = redacted_settings(
        {
            "bootstrap.servers": "b1:9092,b2:9092",
            "group.id": "persist_orders",
            "auto.offset.reset": "error",
            "fetch.wait.max.ms": 100,
            "ssl.key.pem": "-----BEGIN PRIVATE KEY-----",
            "some.new.setting": "x",
        }
    )
    assert shown == {
        "bootstrap.servers": "b1:9092,b2:9092",
        "group.id": "persist_orders",
        "auto.offset.reset": "error",
        "fetch.wait.max.ms": 100,
        "ssl.key.pem": "****",
        "some.new.setting": "****",
    }
    assert all(is_harmless_name(n) for n in HARMLESS_SETTINGS)
    assert not is_harmless_name("sasl.username") and not is_harmless_name("access_key_id")
    # URIs: only allow-listed query values show
    s = SensitiveUrl("s3://b/p?region=eu-west-1&endpoint_url=http://minio:9000&access_key_id=AKIDEXAMPLE")
    assert s.redacted == "s3://b/p?region=eu-west-1&endpoint_url=http://minio:9000&access_key_id=****"
    pg = SensitiveUrl("postgresql://u@h:5432/db?sslmode=require&sslkey=/k.pem&options=-cfoo%3D1")
    assert pg.redacted == "postgresql://u@h:5432/db?sslmode=require&sslkey=****&options=****"
    assert redact("nothing secret: s3://b/p?region=x") == "nothing secret: s3://b/p?region=x"
