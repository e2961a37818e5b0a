"""Which device and backend each tensor-parallel rank gets (services/parallel/devices.py)."""

from __future__ import annotations

import pytest
import torch

from nibble.services.config import DeviceConfig
from nibble.services.errors import ConfigError
from nibble.services.parallel.devices import comm_backend, local_rank_device, rank_placement


def test_cpu_ranks_use_gloo_and_refuse_nccl():
    assert comm_backend("auto", "cpu") == "gloo"
    with pytest.raises(ConfigError, match="needs --device cuda"):
        comm_backend("nccl", "cpu")
    assert local_rank_device("cpu", 1, 2, 0, "gloo") == torch.device("cpu")


def test_nccl_takes_one_gpu_per_rank_from_the_base():
    assert comm_backend("auto", "cuda") == "nccl"
    got = [local_rank_device("cuda", r, 4, 2, "nccl", visible=8) for r in range(4)]
    assert got == [torch.device("cuda", i) for i in (2, 3, 4, 5)]


def test_nccl_refuses_more_ranks_than_gpus_and_names_the_way_out():
    with pytest.raises(ConfigError, match=r"needs one GPU per rank.*shows 1.*--tp-backend gloo"):
        local_rank_device("cuda", 0, 2, 0, "nccl", visible=1)
    with pytest.raises(ConfigError, match="--base-gpu-id 3"):
        local_rank_device("cuda", 0, 1, 3, "nccl", visible=2)


def test_gloo_ranks_may_share_gpus():
    got = [local_rank_device("cuda", r, 3, 1, "gloo", visible=2) for r in range(3)]
    assert got == [torch.device("cuda", i) for i in (1, 0, 1)]


def test_ray_ranks_use_the_one_gpu_they_see():
    cfg = DeviceConfig(device="cuda", tp_size=4, base_gpu_id=5)
    assert rank_placement(cfg, "cuda", 3, in_ray=True) == ("nccl", torch.device("cuda", 0))
    assert rank_placement(DeviceConfig(tp_size=2), "cpu", 1) == ("gloo", torch.device("cpu"))
