"""The loader builds a model with its parameters on the meta device: only in the thread that
builds it, so other threads' modules (a server building an encoder and a user's code, two
engines loading at once) are made as usual meanwhile."""

from __future__ import annotations

import threading

import torch
from torch import nn

from vlmserve.models.loader import _parameters_on_meta


def _elsewhere(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def _plain_linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(4, 3)  # its reset_parameters runs nn.init.kaiming_uniform_


def test_parameters_on_meta_only_in_the_building_thread():
    expected = _plain_linear().weight.detach().clone()
    register, init = nn.Module.register_parameter, nn.init.kaiming_uniform_
    with _parameters_on_meta():
        here = nn.Linear(4, 3)
        assert here.weight.device.type == "meta"
        other = _elsewhere(_plain_linear)  # another thread meanwhile: real, initialised
        assert other.weight.device.type == "cpu" and torch.equal(other.weight, expected)
        with _parameters_on_meta():  # nested in the same thread: still on meta after it
            pass
        assert nn.Linear(2, 2).weight.device.type == "meta"
    assert nn.Module.register_parameter is register and nn.init.kaiming_uniform_ is init
    assert nn.Linear(2, 2).weight.device.type == "cpu"


def test_two_threads_building_at_once():
    inside, release = threading.Barrier(2), threading.Event()

    def build() -> str:
        with _parameters_on_meta():
            inside.wait(5)  # both threads inside: the patches stay until both leave
            release.wait(5)
            return nn.Linear(2, 2).weight.device.type

    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(build())) for _ in range(2)]
    for t in threads:
        t.start()
    release.set()
    for t in threads:
        t.join()
    assert results == ["meta", "meta"]
    assert nn.Linear(2, 2).weight.device.type == "cpu"
