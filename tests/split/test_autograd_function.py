"""Custom torch.autograd.Functions keep their own backward (gradient reversal, straight-through round)."""

import re

import pytest
import torch
import torch.nn as nn

import pipecheck as pc


class GradReverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -g


class RoundSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, g):
        return g


class FnModel(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.c(self.b(self.fn.apply(self.a(x) * 3.0)))


X = torch.randn(8, 4)
CUTS = {"before": {"a": "end"}, "after": {"b": "beginning"}, "later": {"c": "beginning"}}


@pytest.mark.parametrize("fn", [GradReverse, RoundSTE])
def test_fx_keeps_one_call(fn):
    pipe = pc.split(FnModel(fn), (X,), split_spec=CUTS["after"])
    calls = [n for n in pipe.stage_module(0).graph.nodes if n.op == "call_function"]
    assert [getattr(n.target, "autograd_function", None) for n in calls] == [None, fn]  # mul, then fn


@pytest.mark.parametrize("fn", [GradReverse, RoundSTE])
@pytest.mark.parametrize("cut", sorted(CUTS))
@pytest.mark.parametrize("runner", ["reference", "distributed"])
def test_fx_function_backward(fn, cut, runner):
    pc.assert_equivalent(FnModel(fn), (X,), split_spec=CUTS[cut], runner=runner, n_microbatches=2)


def test_fx_function_single_stage():
    pc.assert_equivalent(FnModel(GradReverse), (X,), runner="reference", n_microbatches=2)


@pytest.mark.parametrize("fn", [GradReverse, RoundSTE])
@pytest.mark.parametrize("cut", sorted(CUTS))
@pytest.mark.parametrize("runner", ["reference", "distributed", "torch"])
def test_export_function_backward(fn, cut, runner):
    pc.assert_equivalent(FnModel(fn), (X,), split_spec=CUTS[cut], runner=runner, n_microbatches=2, tracer="export")


@pytest.mark.parametrize("cut", sorted(CUTS))
def test_fx_function_torch_runner(cut):
    pc.assert_equivalent(FnModel(GradReverse), (X,), split_spec=CUTS[cut], runner="torch", n_microbatches=2)


def test_export_keeps_one_call():
    pipe = pc.split(FnModel(GradReverse), (X,), split_spec=CUTS["after"], tracer="export")
    targets = [getattr(n.target, "autograd_function", None) for n in pipe.stage_module(0).graph.nodes
               if n.op == "call_function"]
    assert GradReverse in targets
    assert not [n for n in pipe.stage_module(0).graph.nodes if n.op == "get_attr" and "spec" in str(n.target)]


def test_export_refuses_a_function_it_cannot_keep():
    class LocalReverse(torch.autograd.Function):  # not importable by module.qualname
        @staticmethod
        def forward(ctx, x):
            return x * 1.0

        @staticmethod
        def backward(ctx, g):
            return -g

    with pytest.raises(pc.TraceError, match=r"autograd.Function .*LocalReverse.*tracer='fx'"):
        pc.split(FnModel(LocalReverse), (X,), split_spec=CUTS["after"], tracer="export")
    pc.assert_equivalent(FnModel(LocalReverse), (X,), split_spec=CUTS["after"], runner="reference",
                         n_microbatches=2)  # fx keeps it


def test_a_torch_without_the_export_wrapper_refuses_with_its_version(monkeypatch):
    """The keeper is a feature probe: where torch lacks it (before 2.9), export refuses every Function
    and says why, never a misleading fix; fx still keeps it."""
    from pipecheck._split import autograd_functions as _autograd_functions

    monkeypatch.setattr(_autograd_functions, "_export_keeper", lambda: None)
    with pytest.raises(pc.TraceError, match=re.escape(f"torch {torch.__version__} has no way") + r".*"
                                            r"Fix: use tracer='fx'.*use a supported torch \(>= 2.10\)"):
        pc.split(FnModel(GradReverse), (X,), split_spec=CUTS["after"], tracer="export")
    assert pc.split(FnModel(GradReverse), (X,), split_spec=CUTS["after"]).tracer == "fx"


@torch.library.custom_op("pipecheck_test::reverse", mutates_args=())
def reverse_op(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@reverse_op.register_fake
def _(x):
    return torch.empty_like(x)


reverse_op.register_autograd(lambda ctx, g: -g)


class OpModel(FnModel):
    def forward(self, x):
        return self.c(self.b(reverse_op(self.a(x) * 3.0)))


@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize("runner", ["reference", "torch"])
def test_custom_op_with_autograd_is_not_refused(tracer, runner):
    pc.assert_equivalent(OpModel(GradReverse), (X,), split_spec=CUTS["after"], runner=runner, n_microbatches=2,
                         tracer=tracer)
