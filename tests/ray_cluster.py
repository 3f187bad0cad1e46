"""One private Ray cluster per test session (per worker under `make test`'s `-n 2`), shared by its Ray test modules.

tests/conftest.py imports the fixture (`from ray_cluster import ray_cluster  # noqa: F401`). Logical GPUs
(num_gpus=2) let placement groups with GPU bundles schedule on a CPU machine; the actors still run torch
on the CPU. Never `ray stop`: it kills every Ray process on the host.
"""
import os
import shutil
import tempfile

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"   # every listener on 127.0.0.1
    temp_dir = tempfile.mkdtemp(prefix="mdray-", dir="/tmp")  # short: Ray's socket paths have a length limit
    ray.init(address="local", num_cpus=4, num_gpus=2, include_dashboard=False, _temp_dir=temp_dir,
             log_to_driver=False)
    try:
        yield ray
    finally:
        try:
            from ray import serve
            serve.shutdown()
        finally:
            ray.shutdown()
            shutil.rmtree(temp_dir, ignore_errors=True)
