import pytest
import torch


def _gpu_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine (GPU tests run on an sm_90 device)"
    if torch.cuda.get_device_capability() != (9, 0):
        return f"kernels are built for sm_90a; this GPU is sm_{''.join(map(str, torch.cuda.get_device_capability()))}"
    return None


GPU_SKIP = _gpu_reason()


def pytest_collection_modifyitems(config, items):
    if GPU_SKIP is None:
        return
    skip = pytest.mark.skip(reason=GPU_SKIP)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
