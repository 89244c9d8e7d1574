import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` skip themselves without a CUDA device (``make gpu-check`` runs them)."""
    marked = [item for item in items if item.get_closest_marker("cuda")]
    if marked:
        import torch

        if not torch.cuda.is_available():
            for item in marked:
                item.add_marker(pytest.mark.skip(reason="no CUDA device (make gpu-check runs it on one)"))


@pytest.fixture
def python_env():
    """Environment for training subprocesses: single-threaded torch, the repo importable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture
def python_exe():
    return sys.executable


# ---- S3: a real moto server on loopback, and a fault-injecting proxy in front of it ----------


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server, started once per session; yields its endpoint (``http://127.0.0.1:PORT``).

    For the session, ``os.environ`` holds test credentials, region, ``AWS_ENDPOINT_URL`` (this
    server) and a single botocore attempt, so code that reads the environment finds moto.
    """
    from s3env import need_s3_packages, s3_env, start_moto

    need_s3_packages()
    server, endpoint = start_moto()
    with pytest.MonkeyPatch.context() as mp:
        for name, value in s3_env(endpoint).items():
            mp.setenv(name, value)
        yield endpoint
    server.stop()


@pytest.fixture
def s3_bucket(s3_server):
    """A fresh bucket per test, reached directly (no faults): an ``s3env.S3Target``."""
    import s3fs
    from s3env import S3Target, make_bucket, remove_bucket, unique_bucket_name

    name = unique_bucket_name()
    make_bucket(s3_server, name)
    yield S3Target.create(s3_server, name)
    # Cached instances keep listings and a connection pool that may point at a closed proxy.
    s3fs.S3FileSystem.clear_instance_cache()
    remove_bucket(s3_server, name)


@pytest.fixture
def fault_proxy(s3_server):
    """A ``faultproxy.FaultProxy`` in front of the session's moto server, closed after the test."""
    from faultproxy import FaultProxy

    proxy = FaultProxy(s3_server)
    yield proxy
    proxy.close()


@pytest.fixture
def s3_via_proxy(s3_bucket, fault_proxy):
    """``s3_bucket``'s bucket and url, reached through ``fault_proxy`` (``s3_bucket`` still reaches
    the same objects directly, e.g. to check what really landed)."""
    from s3env import S3Target

    return S3Target.create(fault_proxy.url, s3_bucket.bucket)
