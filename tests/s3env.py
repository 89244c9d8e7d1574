"""A real S3-compatible HTTP server on loopback (moto in server mode) and how to point s3fs at it.

Tests talk to S3 over real HTTP so that the s3fs/aiobotocore/aiohttp stack, its connection pool
and its error translation are exercised exactly as in production; ``faultproxy.FaultProxy`` can sit
in between to break that traffic on purpose.

Retries, the part that decides how fast a failing test fails:

- botocore retries by itself (legacy mode: 5 attempts on 5xx, throttling and connection errors).
  ``s3_storage_options`` and ``s3_env`` limit it to a single attempt, because diffckpt does its own
  retry with backoff and a test should see each injected fault reach that layer.
- s3fs wraps every call in ``_error_wrapper`` and retries ``S3FileSystem.retries`` times (default
  5, backoff 0.1 s * 1.7**i, about 1.9 s in all) on ``S3_RETRYABLE_ERRORS`` (``socket.timeout``,
  botocore ``HTTPClientError`` -- which includes ``ConnectionClosedError`` and ``ReadTimeoutError``
  --, ``IncompleteRead``, ``FSTimeoutError``, ``ResponseParserError``, aiohttp
  ``ClientPayloadError``) and on ``ClientError``s whose text mentions ``SlowDown``, "reduce your
  request rate" or ``XAmzContentSHA256Mismatch``. ``EndpointConnectionError`` (refused) and other
  ``ClientError``s (e.g. 500 InternalError) are not retried by s3fs. ``retries`` is a class
  attribute, not a constructor argument: passing it in storage options reaches
  ``AioSession(**kwargs)`` and raises ``TypeError``; use ``limit_s3fs_retries`` to change it.
"""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass
from typing import Any

import pytest

REGION = "us-east-1"
KEY = SECRET = "testing"


def need_s3_packages() -> None:
    """Skip the calling test where s3fs or moto is missing (a machine without the ``s3`` and
    ``test`` extras, such as the lent GPU machine); in CI (``CI`` set) they are required, and
    their absence fails the test instead of skipping every S3 test in silence."""
    if os.environ.get("CI"):
        import moto  # noqa: F401
        import s3fs  # noqa: F401
        return
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")


def start_moto() -> tuple[Any, str]:
    """Start moto's threaded server on a free loopback port; return ``(server, endpoint_url)``.

    Call ``server.stop()`` when done. All buckets live in moto's process-wide in-memory backend, so
    tests keep apart by using unique bucket names (``make_bucket(..., unique_bucket_name())``).
    """
    from moto.server import ThreadedMotoServer

    # werkzeug logs every request at INFO even with verbose=False.
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"


def s3_storage_options(endpoint: str) -> dict[str, Any]:
    """fsspec/s3fs storage options for ``endpoint``: test credentials, one botocore attempt, short
    timeouts (a hung connection fails in seconds, not minutes)."""
    return {
        "endpoint_url": endpoint,
        "key": KEY,
        "secret": SECRET,
        "client_kwargs": {"region_name": REGION},
        "config_kwargs": {
            # total_max_attempts counts the first try; "max_attempts" would count retries only.
            "retries": {"total_max_attempts": 1, "mode": "standard"},
            "connect_timeout": 2,
            "read_timeout": 5,
        },
    }


def s3_env(endpoint: str) -> dict[str, str]:
    """Environment variables that point s3fs at ``endpoint`` the way users configure it, for
    subprocesses that open ``s3://`` URLs without storage options.

    ``AWS_ENDPOINT_URL`` is honoured by botocore/aiobotocore (checked with s3fs 2026.9 and botocore
    1.43). Merge into the subprocess environment: ``env={**python_env, **s3_env(endpoint)}``.
    """
    return {
        "AWS_ACCESS_KEY_ID": KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_ENDPOINT_URL": endpoint,
        # Same single botocore attempt as s3_storage_options (this one counts the first try);
        # timeouts have no environment variable.
        "AWS_MAX_ATTEMPTS": "1",
        "AWS_RETRY_MODE": "standard",
        # Nothing on the developer's machine may leak in, and no instance-metadata probing.
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": "/nonexistent/diffckpt-tests/config",
        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/diffckpt-tests/credentials",
    }


_session: Any = None


def new_fs(endpoint: str, **overrides: Any) -> Any:
    """A fresh ``S3FileSystem`` for ``endpoint``, never one from fsspec's instance cache (a cached
    instance keeps its directory listings and its connection pool from an earlier test).

    Instances share one aiobotocore session: each new session parses botocore's S3 model again,
    which costs a few tenths of a second per filesystem.
    """
    global _session
    import aiobotocore.session
    import s3fs

    if _session is None:
        _session = aiobotocore.session.AioSession()
    options = {"session": _session, **s3_storage_options(endpoint), **overrides}
    return s3fs.S3FileSystem(skip_instance_cache=True, **options)


def unique_bucket_name(prefix: str = "t") -> str:
    """A valid, unused bucket name (3-63 lowercase characters)."""
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


def make_bucket(endpoint: str, name: str) -> str:
    """Create bucket ``name`` and return ``s3://name``.

    Uses boto3 (a moto dependency): s3fs's ``mkdir`` sends ``LocationConstraint=us-east-1``, which
    S3 and moto reject.
    """
    import boto3

    client = boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id=KEY, aws_secret_access_key=SECRET,
        region_name=REGION,
    )
    try:
        client.create_bucket(Bucket=name)
    finally:
        client.close()
    return f"s3://{name}"


def remove_bucket(endpoint: str, name: str) -> None:
    """Best effort: delete bucket ``name`` and its objects, to keep moto's memory small."""
    try:
        new_fs(endpoint).rm(name, recursive=True)
    except Exception:
        pass


def limit_s3fs_retries(monkeypatch: pytest.MonkeyPatch, retries: int = 1) -> None:
    """Make s3fs's own retry loop (see module docstring) run ``retries`` attempts in this process,
    until the test ends. ``retries=1`` means no s3fs-level retry at all."""
    import s3fs

    monkeypatch.setattr(s3fs.S3FileSystem, "retries", retries)


@dataclass(frozen=True)
class S3Target:
    """Where a test keeps its checkpoints on S3, and how to reach it.

    Attributes:
        url: ``s3://<bucket>/run``, a prefix in a bucket of the test's own.
        bucket: The bucket name.
        endpoint: The HTTP endpoint (moto itself, or a ``FaultProxy`` in front of it).
        storage_options: For fsspec/s3fs in this process (``s3_storage_options(endpoint)``).
        env: For subprocesses that open ``url`` with no storage options (``s3_env(endpoint)``).
    """

    url: str
    bucket: str
    endpoint: str
    storage_options: dict[str, Any]
    env: dict[str, str]

    def fs(self) -> Any:
        """A fresh, uncached ``S3FileSystem`` on ``endpoint``."""
        return new_fs(self.endpoint)

    @classmethod
    def create(cls, endpoint: str, bucket: str, prefix: str = "run") -> S3Target:
        return cls(f"s3://{bucket}/{prefix}", bucket, endpoint, s3_storage_options(endpoint),
                   s3_env(endpoint))
