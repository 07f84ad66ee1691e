"""The moto S3 server for tests: real HTTP on 127.0.0.1, in a background thread.

moto is the only S3 server that can run here (research/reliability.md section 6). We
talk to it over HTTP exactly as to AWS/MinIO (no in-process mocking), with fake
credentials. Use it for protocol conformance, not to referee races (its conditional
PUT is an unlocked check-then-put).
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any

FAKE_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


class MotoS3:
    """A running ``ThreadedMotoServer``; ``endpoint`` is ``http://127.0.0.1:PORT``."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._saved_env: dict[str, str | None] = {}
        self.endpoint = ""
        self._stopped = True

    def start(self) -> MotoS3:
        for k, v in FAKE_ENV.items():
            self._saved_env[k] = os.environ.get(k)
            os.environ[k] = v
        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no per-request lines
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self._stopped = False
        return self

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._server.stop()
        for k, old in self._saved_env.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old

    def client(self) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            config=Config(
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
                s3={"addressing_style": "path"},
            ),
        )

    def create_bucket(self, prefix: str = "test") -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:16]}"
        self.client().create_bucket(Bucket=name)
        return name

    def blob_uri(self, bucket: str, prefix: str = "persist") -> str:
        """``s3://bucket/prefix?endpoint_url=...&region=us-east-1`` (credentials from env)."""
        return f"s3://{bucket}/{prefix}?endpoint_url={self.endpoint}&region=us-east-1"
