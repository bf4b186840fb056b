"""fx splits of forwards with **kwargs, decorators (functools.wraps, as HuggingFace's) and tensor defaults."""

import functools

import pytest
import torch
import torch.nn as nn

import pipecheck as pc


def passthrough(func):
    @functools.wraps(func)
    def wrapper(self, *args, **kwargs):
        return func(self, *args, **kwargs)
    return wrapper


class KW(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, mask=None, **kwargs):
        h = self.a(x)
        if mask is not None:
            h = h * mask
        if "extra" in kwargs:
            h = h + kwargs["extra"]
        return self.b(h)


class Decorated(KW):
    @passthrough
    def forward(self, x, mask=None, a=None, b=None, c=None, d=None, **kwargs):  # co_varnames of wrapper: 3
        return super().forward(x, mask, **kwargs)


class TensorDefault(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, bias: torch.Tensor = torch.full((1,), 0.5)):  # noqa: B008 - the case under test
        return self.b(self.a(x) + bias)


X, M = torch.randn(8, 4), torch.rand(8, 4)
SPEC = {"b": "beginning"}


@pytest.mark.parametrize("model", [KW, Decorated])
@pytest.mark.parametrize("kwargs", [{}, {"mask": M}, {"mask": M, "extra": torch.randn(8, 4)}, {"flag": 3}])
def test_kwargs_forward_matches(model, kwargs):
    pc.assert_equivalent(model, (X,), kwargs, split_spec=SPEC, runner="reference", n_microbatches=2)


def test_kwargs_tensor_is_a_named_input():
    pipe = pc.split(KW(), (X,), {"mask": M, "extra": torch.randn(8, 4)}, split_spec=SPEC)
    inputs = [n.target for n in pipe.stage_module(0).graph.nodes if n.op == "placeholder"]
    assert inputs == ["x", "mask", "extra"]


def test_kwargs_value_fixed_at_split():
    pipe = pc.split(KW(), (X,), {"flag": 3}, split_spec=SPEC)
    with pytest.raises(pc.InputError, match=r"flag=4, traced with flag=3"):
        pc.DetachExecutor(pipe).step((X,), {"flag": 4})
    with pytest.raises(pc.InputError, match=r"flag is not passed now"):
        pc.DetachExecutor(pipe).step((X,), {})


def test_tensor_default_not_passed():
    pc.assert_equivalent(TensorDefault, (X,), split_spec=SPEC, runner="reference", n_microbatches=2)


def test_tensor_default_passed():
    pc.assert_equivalent(TensorDefault, (X,), {"bias": torch.randn(8, 4)}, split_spec=SPEC, runner="reference",
                         n_microbatches=2)


def test_tensor_default_passed_after_split_without_it():
    pipe = pc.split(TensorDefault(), (X,), split_spec=SPEC)
    with pytest.raises(pc.InputError, match="bias is a tensor now, but was left to its default"):
        pc.DetachExecutor(pipe).step((X,), {"bias": torch.randn(8, 4)})


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        if x.shape[0] != x.size(0) * 1:  # a shape test fx cannot evaluate on a proxy; export can
            x = x * 2
        return self.b(self.a(x))


def test_auto_falls_back_to_export():
    pipe = pc.split(DataDependent(), (X,), split_spec=SPEC)
    assert str(pipe).startswith("Pipe(DataDependent, 2 stages, tracer=export)")
    assert str(pc.split(KW(), (X,), split_spec=SPEC)).startswith("Pipe(KW, 2 stages, tracer=fx)")
    with pytest.raises(pc.TraceError, match=r"at .*test_fx_signatures.py:\d+ in forward"):
        pc.split(DataDependent(), (X,), split_spec=SPEC, tracer="fx")


class Holder:  # not a pytree
    def __init__(self, value):
        self.value = value


class ReturnsHolder(DataDependent):
    def forward(self, x):
        return self.b(self.a(x)), Holder(x)


def test_export_names_an_output_class_it_cannot_flatten():
    with pytest.raises(pc.SplitError, match=r"returns an object of class .*Holder.*register_pytree_node"):
        pc.split(ReturnsHolder(), (X,), split_spec=SPEC, tracer="export")
