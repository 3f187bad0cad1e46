"""Whether torch would compute on a CUDA GPU in this process, asked without importing torch: a process that runs no
model (the runtime's manager) picks its defaults by the device its workers will use on its node, and torch's import
costs it about a CPU-second. The answer is torch.cuda.is_available()'s: a CUDA build of torch and a device that the
CUDA driver shows this process (CUDA_VISIBLE_DEVICES applies); the driver is initialized as torch's check does it.
"""
from __future__ import annotations

import ctypes
import importlib.util
from pathlib import Path


def torch_built_with_cuda() -> bool:
    """torch.version.cuda is set, read from torch/version.py without importing torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    path = Path(spec.submodule_search_locations[0]) / "version.py"
    if not path.is_file():
        return False
    version: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), version)   # plain assignments (torch's build writes it)
    return version.get("cuda") is not None


def cuda_device_count() -> int:
    """The CUDA devices the driver shows this process; 0 without a driver (cuInit + cuDeviceGetCount, as the CUDA
    runtime's cudaGetDeviceCount, which torch asks, does)."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if driver.cuInit(0) != 0 or driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def cuda_available() -> bool:
    """torch.cuda.is_available(), without importing torch."""
    return torch_built_with_cuda() and cuda_device_count() > 0
