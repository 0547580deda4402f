import pytest
import torch


def _poisoned(factory):
    """Wrap a torch.empty-like factory so fresh memory is NaN (floats) or the most negative int."""
    def make(*args, **kwargs):
        t = factory(*args, **kwargs)
        if t.is_floating_point() or t.is_complex():
            return t.fill_(float("nan"))
        if t.dtype != torch.bool:
            return t.fill_(torch.iinfo(t.dtype).min)
        return t
    return make


@pytest.fixture(autouse=True)
def nan_empty(monkeypatch):
    """Fill every torch.empty / empty_like / Tensor.new_empty with NaN, so an output a kernel forgets
    to write fails the test."""
    monkeypatch.setattr(torch, "empty", _poisoned(torch.empty))
    monkeypatch.setattr(torch, "empty_like", _poisoned(torch.empty_like))
    monkeypatch.setattr(torch.Tensor, "new_empty", _poisoned(torch.Tensor.new_empty))
