"""Whether torch would compute on a CUDA GPU in this process, asked without importing torch: a process that runs no
model (the runtime's manager) picks its defaults by the device its workers will use on its node, and torch's import
costs it about a CPU-second. The answer is torch.cuda.is_available()'s: a CUDA build of torch and a device that the
CUDA driver shows this process (CUDA_VISIBLE_DEVICES applies); the driver is initialized as torch's check does it.
It only picks defaults (transport, overlap, prefill budget): the workers report the device they actually use.
"""
from __future__ import annotations

import ast
import ctypes
import functools
import importlib.util
from pathlib import Path


def torch_built_with_cuda() -> bool:
    """torch.version.cuda is set: the literal assigned to `cuda` in torch/version.py, read without running it."""
    try:
        spec = importlib.util.find_spec("torch")
        if spec is None or not spec.submodule_search_locations:
            return False
        tree = ast.parse((Path(spec.submodule_search_locations[0]) / "version.py").read_text())
        for node in tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == "cuda" for t in targets) and node.value is not None:
                    return ast.literal_eval(node.value) is not None
    except (OSError, SyntaxError, ValueError):
        pass
    return False


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


@functools.cache
def cuda_available() -> bool:
    """torch.cuda.is_available(), without importing torch (asked once per process)."""
    return torch_built_with_cuda() and cuda_device_count() > 0
