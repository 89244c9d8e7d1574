import contextlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers import root_only

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


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    """``small_disk(free)``: a tmpfs with about ``free`` bytes (whole pages) left."""
    root_only()
    mounts: list[Path] = []

    def make_disk(free: int) -> Path:
        folder = tmp_path / f"disk{len(mounts)}"
        folder.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=1777", "tmpfs", str(folder)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounts.append(folder)
        filler = folder / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o644)
        try:  # fill it, then give back what should stay free
            with contextlib.suppress(OSError):
                while os.write(fd, b"\0" * 4096):
                    pass
        finally:
            os.close(fd)
        os.truncate(filler, max(0, filler.stat().st_size - free))
        return folder

    yield make_disk
    for folder in mounts:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)
