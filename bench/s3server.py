"""A loopback S3 server for the benchmarks: moto in a process of its own, with one bucket.

A process of its own, like a real S3 endpoint: its CPU work does not share the benchmark's
interpreter (and GIL), though on a small machine it still shares the cores. ``options`` are the
fsspec storage options that reach it; ``env`` points s3fs at it through the environment, for
processes a benchmark starts (``export()`` sets it in this one too).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

__all__ = ["LoopbackS3"]

KEY = SECRET = "testing"
REGION = "us-east-1"


class LoopbackS3:
    """moto's S3 server on a free loopback port, holding ``bucket``; :meth:`stop` ends it."""

    def __init__(self, bucket: str) -> None:
        import boto3

        self.bucket = bucket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.endpoint = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.server.poll() is not None:
                    self.server.kill()
                    raise RuntimeError("the moto server did not start (is moto[server] installed?)") from None
                time.sleep(0.1)
        self.options = {"endpoint_url": self.endpoint, "key": KEY, "secret": SECRET,
                        "client_kwargs": {"region_name": REGION}}
        # No retries inside botocore and no look-ups of real credentials or instance metadata:
        # diffckpt's own retry policy is what is measured.
        self.env = {"AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": REGION,
                    "AWS_ENDPOINT_URL": self.endpoint, "AWS_MAX_ATTEMPTS": "1", "AWS_RETRY_MODE": "standard",
                    "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": "/nonexistent/diffckpt-bench/config",
                    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/diffckpt-bench/credentials"}
        self.client = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=KEY,
                                   aws_secret_access_key=SECRET, region_name=REGION)
        self.client.create_bucket(Bucket=bucket)

    def url(self, prefix: str) -> str:
        """The ``s3://`` URL of ``prefix`` in the bucket."""
        return f"s3://{self.bucket}/{prefix}"

    def export(self) -> None:
        """Point s3fs in this process at the server too (``open_storage(url)`` with no options)."""
        os.environ.update(self.env)

    def clear(self, prefix: str) -> None:
        """Delete every object under ``prefix`` of the bucket, or under an ``s3://`` URL in it
        (moto keeps them in memory)."""
        prefix = prefix.removeprefix(f"s3://{self.bucket}/")
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        for page in pages:
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys})

    def stop(self) -> None:
        self.client.close()
        self.server.terminate()
        self.server.wait(timeout=30)
