"""Device selection, and the CUDA expert device where a GPU is present."""

from __future__ import annotations

import numpy as np
import pytest

from splitinfer.cloud.moe.device import NumpyDevice, select_device
from splitinfer.cloud.moe.executor import expert_forward
from splitinfer.shared.errors import ConfigError


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _weights(kind: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    w = {"w1": rng.standard_normal((16, 8)), "w2": rng.standard_normal((8, 16))}
    if kind == "swiglu":
        w["w3"] = rng.standard_normal((16, 8))
    return {k: v.astype(np.float32) for k, v in w.items()}


@pytest.mark.unit
def test_selection_on_a_cpu_only_machine() -> None:
    assert isinstance(select_device("cpu"), NumpyDevice)
    with pytest.raises(ConfigError, match="one of"):
        select_device("tpu")
    if not _has_cuda():
        assert isinstance(select_device("auto"), NumpyDevice)
        with pytest.raises(ConfigError, match="sees no CUDA GPU"):
            select_device("cuda")


@pytest.mark.unit
def test_the_numpy_device_copies_out_of_the_mapping() -> None:
    host = _weights("relu")
    dev = NumpyDevice().upload(host)
    host["w1"][:] = 0
    assert dev["w1"].any()


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["relu", "swiglu"])
def test_the_cuda_device_matches_numpy(kind: str) -> None:  # pragma: no cover - GPU only
    device = select_device("cuda")
    host = _weights(kind)
    x = np.random.default_rng(1).standard_normal((5, 8)).astype(np.float32)
    got = device.expert_forward(x, device.upload(host), kind)
    np.testing.assert_allclose(got, expert_forward(x, host, kind), atol=1e-4)
