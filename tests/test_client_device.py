"""Device placement, checked without a GPU: which device a ClientApp is given, with CUDA reported present or
absent (a GPU machine runs the same code on CUDA; benchmarks/gpu_clients.py measures it there)."""

from __future__ import annotations

import pytest
import torch

from fedrec_flwr.config import load_config
from fedrec_flwr.flower.client_app import client_device


def _cfg(*overrides: str):
    return load_config("fedgnn_paper", "synthetic", list(overrides))


@pytest.mark.parametrize("overrides", [(), ("simulation.num_gpus=0.5",), ("simulation.device=cpu",)])
def test_clients_stay_on_cpu_without_cuda(monkeypatch, overrides):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert client_device(_cfg(*overrides)) == torch.device("cpu")


def test_asking_for_cuda_without_cuda_is_an_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="simulation.device = 'cuda' but torch sees no CUDA device"):
        client_device(_cfg("simulation.device=cuda"))


@pytest.mark.parametrize("overrides, expected", [
    (("simulation.device=cuda",), "cuda"),
    (("simulation.num_gpus=0.25",), "cuda"),  # auto: a GPU share moves the models to CUDA
    ((), "cpu"),  # auto without a GPU share: a visible GPU is not taken
    (("simulation.device=cpu", "simulation.num_gpus=1"), "cpu"),  # an explicit cpu wins
])
def test_cuda_is_chosen_only_when_visible_and_asked_for(monkeypatch, overrides, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # chosen, never run on
    assert client_device(_cfg(*overrides)) == torch.device(expected)
