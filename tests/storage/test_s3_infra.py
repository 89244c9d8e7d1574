"""Self-tests of the S3 test infrastructure (``s3env``, ``faultproxy`` and the conftest fixtures).

They use s3fs directly, not diffckpt, and pin down what the s3fs/aiobotocore/aiohttp stack does
with each injected fault, since the storage layer's retry logic is built on exactly that:

- 503 SlowDown is retried by s3fs itself (``S3FileSystem.retries`` times); once exhausted it is
  ``OSError(errno.EBUSY)``. 500 InternalError is not retried by s3fs: ``OSError(EREMOTEIO)``.
- A reset connection becomes ``botocore.exceptions.EndpointConnectionError`` (not an ``OSError``),
  which s3fs does not retry; aiohttp itself resends an idempotent request (GET/HEAD/PUT/DELETE,
  not POST) once, so one reset of a PUT goes unnoticed.
- ``mode="create"`` on an existing key is ``FileExistsError`` (from 412 PreconditionFailed).
"""

from __future__ import annotations

import errno
import http.client
import os
import subprocess
import sys
import threading
import time

import pytest
import s3fs
from botocore.exceptions import EndpointConnectionError
from faultproxy import FaultProxy
from s3env import S3Target, limit_s3fs_retries

MiB = 2**20
# moto refuses reads without credentials; it does not check signatures.
FAKE_AUTH = {"Authorization": "AWS4-HMAC-SHA256 Credential=testing/20260101/us-east-1/s3/"
                              "aws4_request, SignedHeaders=host, Signature=0"}


def _key(target: S3Target, name: str) -> str:
    return f"{target.url}/{name}"


def test_environment_alone_reaches_moto(s3_bucket: S3Target) -> None:
    # The session fixture exports s3_env(): AWS_ENDPOINT_URL is honoured without storage options.
    assert os.environ["AWS_ENDPOINT_URL"] == s3_bucket.endpoint
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.pipe_file(_key(s3_bucket, "env"), b"from env")
    assert s3_bucket.fs().cat_file(_key(s3_bucket, "env")) == b"from env"


def test_roundtrip_through_proxy(s3_via_proxy: S3Target, fault_proxy: FaultProxy) -> None:
    fs = s3_via_proxy.fs()
    fs.pipe_file(_key(s3_via_proxy, "a/x"), b"hello")
    fs.pipe_file(_key(s3_via_proxy, "a/y"), b"")
    assert fs.cat_file(_key(s3_via_proxy, "a/x")) == b"hello"
    assert fs.cat_file(_key(s3_via_proxy, "a/y")) == b""
    assert fs.info(_key(s3_via_proxy, "a/x"))["size"] == 5
    assert sorted(fs.ls(_key(s3_via_proxy, "a"))) == [
        f"{s3_via_proxy.bucket}/run/a/x", f"{s3_via_proxy.bucket}/run/a/y"]
    fs.rm(_key(s3_via_proxy, "a/y"))
    assert not s3_via_proxy.fs().exists(_key(s3_via_proxy, "a/y"))
    assert fault_proxy.count("PUT", r"/run/a/") == 2
    assert fault_proxy.count("PUT", outcome=200) == 2
    assert fault_proxy.count("GET", r"list-type=2") >= 1


def test_keepalive_chunked_and_head(s3_via_proxy: S3Target, fault_proxy: FaultProxy) -> None:
    # aiohttp sends Content-Length; other clients send chunked bodies: both must go through,
    # several requests on one kept-alive connection, HEAD answered without a body.
    conn = http.client.HTTPConnection("127.0.0.1", int(fault_proxy.url.rsplit(":", 1)[1]))
    path = f"/{s3_via_proxy.bucket}/run/chunked"
    conn.request("PUT", path, body=iter([b"abc", b"", b"defg"]), encode_chunked=True,
                 headers=FAKE_AUTH)
    assert conn.getresponse().read() == b"" and fault_proxy.log[-1].outcome == 200
    conn.request("HEAD", path, headers=FAKE_AUTH)
    head = conn.getresponse()
    assert head.read() == b"" and head.getheader("Content-Length") == "7"
    conn.request("GET", path, headers=FAKE_AUTH)
    assert conn.getresponse().read() == b"abcdefg"
    conn.close()
    assert fault_proxy.log[0].body_bytes == 7


def test_503_is_retried_by_s3fs(s3_via_proxy: S3Target, fault_proxy: FaultProxy) -> None:
    fault_proxy.fail(2, 503, method="PUT")
    s3_via_proxy.fs().pipe_file(_key(s3_via_proxy, "slow"), b"data")
    assert [e.outcome for e in fault_proxy.log if e.method == "PUT"] == ["failed", "failed", 200]
    assert s3_via_proxy.fs().cat_file(_key(s3_via_proxy, "slow")) == b"data"


@pytest.mark.parametrize("status, code, exc_type, exc_errno", [
    (503, None, OSError, errno.EBUSY),
    (500, None, OSError, getattr(errno, "EREMOTEIO", errno.EIO)),
    (403, None, PermissionError, None),
    (404, "NoSuchBucket", FileNotFoundError, None),
])
def test_error_answers_translate(s3_via_proxy: S3Target, fault_proxy: FaultProxy,
                                 monkeypatch: pytest.MonkeyPatch, status: int, code: str | None,
                                 exc_type: type[OSError], exc_errno: int | None) -> None:
    limit_s3fs_retries(monkeypatch, 1)  # one attempt: the first injected error surfaces
    fault_proxy.fail(1, status, method="PUT", code=code)
    with pytest.raises(exc_type) as info:
        s3_via_proxy.fs().pipe_file(_key(s3_via_proxy, "err"), b"data")
    assert type(info.value) is exc_type and info.value.errno == exc_errno
    assert fault_proxy.count("PUT", outcome="failed") == 1
    assert not s3_via_proxy.fs().exists(_key(s3_via_proxy, "err"))


def test_reset_mid_upload(s3_bucket: S3Target, s3_via_proxy: S3Target,
                          fault_proxy: FaultProxy) -> None:
    data = os.urandom(1 * MiB)
    # aiohttp resends a PUT once by itself, so reset both tries.
    fault_proxy.reset(2, after_body_bytes=64 * 1024, method="PUT")
    with pytest.raises(EndpointConnectionError):
        s3_via_proxy.fs().pipe_file(_key(s3_via_proxy, "cut"), data)
    assert [(e.body_bytes, e.outcome) for e in fault_proxy.log] == [(64 * 1024, "reset")] * 2
    assert not s3_bucket.fs().exists(_key(s3_bucket, "cut"))
    # One reset only: aiohttp's own resend succeeds.
    fault_proxy.reset(1, after_body_bytes=1000, method="PUT")
    s3_via_proxy.fs().pipe_file(_key(s3_via_proxy, "cut"), data)
    assert [e.outcome for e in fault_proxy.log[2:]] == ["reset", 200]
    assert s3_bucket.fs().cat_file(_key(s3_bucket, "cut")) == data


def _retry_until_ok(fn, deadline_s: float = 15.0) -> None:
    """Call ``fn`` until it stops raising ``EndpointConnectionError`` (generous deadline)."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            return fn()
        except EndpointConnectionError:
            assert time.monotonic() < deadline, "still failing long after the outage ended"
            time.sleep(0.1)


def test_outage_then_recovery(s3_via_proxy: S3Target, fault_proxy: FaultProxy) -> None:
    fs = s3_via_proxy.fs()
    fs.pipe_file(_key(s3_via_proxy, "before"), b"1")
    fault_proxy.outage(1.0)
    with pytest.raises(EndpointConnectionError):
        fs.pipe_file(_key(s3_via_proxy, "during"), b"2")
    _retry_until_ok(lambda: fs.pipe_file(_key(s3_via_proxy, "during"), b"2"))
    assert fs.cat_file(_key(s3_via_proxy, "before")) == b"1"
    assert fault_proxy.count(outcome="reset") >= 2

    fault_proxy.outage_until_cleared()
    with pytest.raises(EndpointConnectionError):
        fs.cat_file(_key(s3_via_proxy, "before"))
    fault_proxy.clear()
    assert fs.cat_file(_key(s3_via_proxy, "during")) == b"2"


def test_pause_holds_put_until_release(s3_bucket: S3Target, s3_via_proxy: S3Target,
                                       fault_proxy: FaultProxy) -> None:
    handle = fault_proxy.pause("PUT", r"/run/held$", after_body_bytes=10)
    errors: list[BaseException] = []

    def upload() -> None:
        try:
            s3_via_proxy.fs().pipe_file(_key(s3_via_proxy, "held"), b"x" * 1000)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    thread = threading.Thread(target=upload)
    thread.start()
    assert handle.reached.wait(10)
    assert not s3_bucket.fs().exists(_key(s3_bucket, "held"))
    handle.release()
    thread.join(10)
    assert not thread.is_alive() and errors == []
    assert s3_bucket.fs().cat_file(_key(s3_bucket, "held")) == b"x" * 1000


def test_pause_then_kill_client(s3_bucket: S3Target, s3_via_proxy: S3Target,
                                fault_proxy: FaultProxy) -> None:
    # A subprocess configured only through the environment, killed with SIGKILL mid-upload.
    handle = fault_proxy.pause("PUT", r"/run/killed$", after_body_bytes=1000)
    script = ("import s3fs, sys; s3fs.S3FileSystem().pipe_file(sys.argv[1], b'k' * 200000); "
              "print('DONE')")
    env = {**os.environ, **s3_via_proxy.env}
    proc = subprocess.Popen([sys.executable, "-c", script, _key(s3_via_proxy, "killed")], env=env)
    try:
        assert handle.reached.wait(30)
        proc.kill()
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    handle.release()
    deadline = time.monotonic() + 10
    while fault_proxy.count("PUT", outcome="client-gone") == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert not s3_bucket.fs().exists(_key(s3_bucket, "killed"))


def test_multipart_upload(s3_bucket: S3Target, s3_via_proxy: S3Target,
                          fault_proxy: FaultProxy) -> None:
    data = os.urandom(12 * MiB)
    with s3_via_proxy.fs().open(_key(s3_via_proxy, "big"), "wb", block_size=5 * MiB) as f:
        for i in range(0, len(data), MiB):  # one large write() would go up as a single part
            f.write(data[i:i + MiB])
    assert fault_proxy.count("POST", r"\?uploads(=|&|$)") == 1
    assert fault_proxy.count("PUT", r"[?&]partNumber=\d+", outcome=200) == 3
    assert fault_proxy.count("POST", r"\?uploadId=", outcome=200) == 1
    assert s3_bucket.fs().cat_file(_key(s3_bucket, "big")) == data


def test_conditional_create(s3_via_proxy: S3Target, fault_proxy: FaultProxy) -> None:
    fs = s3_via_proxy.fs()
    fs.pipe_file(_key(s3_via_proxy, "once"), b"first", mode="create")
    with pytest.raises(FileExistsError) as info:
        fs.pipe_file(_key(s3_via_proxy, "once"), b"second", mode="create")
    assert info.value.errno is None
    assert "pre-conditions" in str(info.value)
    assert [e.outcome for e in fault_proxy.log if e.method == "PUT"] == [200, 412]
    assert fs.cat_file(_key(s3_via_proxy, "once")) == b"first"


def test_latency_still_serves(s3_via_proxy: S3Target, fault_proxy: FaultProxy) -> None:
    fault_proxy.latency(0.05)
    fs = s3_via_proxy.fs()
    fs.pipe_file(_key(s3_via_proxy, "slowly"), b"z")
    assert fs.cat_file(_key(s3_via_proxy, "slowly")) == b"z"
    assert fault_proxy.count(outcome=200) >= 2
