"""pc.split: stages, FQNs, tied weights, edges, kwarg routing, policies, and str(pipe)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from expecttest import assert_expected_inline

import pipecheck as pc
from pipecheck import fixtures

zoo_models = fixtures.models


def _pipe(name: str, style: str = "markers", tracer: str = "fx") -> pc.Pipe:
    entry = fixtures.get(name)
    args, kwargs = entry.inputs()
    return pc.split(entry.factory(style)(), args, kwargs, tracer=tracer, **entry.cut(style))


def _stage_names(pipe: pc.Pipe) -> list[list[str]]:
    return [pipe.stage_params(i) for i in range(pipe.num_stages)]


# --------------------------------------------------------------------------- parameters and FQNs


@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize("name", ["mlp", "tiny_gpt", "alias_reuse", "encoder_decoder"])
def test_stage_modules_keep_the_models_parameter_names(name: str, tracer: str) -> None:
    entry = fixtures.get(name)
    model = entry.factory("markers")()
    args, kwargs = entry.inputs()
    pipe = pc.split(model, args, kwargs, tracer=tracer)
    model_names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    canonical = [n for n, _ in model.named_parameters()]
    held: set[str] = set()
    for i in range(pipe.num_stages):
        local = [n for n, _ in pipe.stage_module(i).named_parameters(remove_duplicate=False)]
        assert set(local) <= model_names, f"stage {i} renamed parameters: {sorted(set(local) - model_names)}"
        assert set(pipe.stage_params(i)) <= set(canonical)
        held |= set(pipe.stage_params(i))
    assert held == set(canonical)  # every parameter lives in some stage


def test_stage_params_of_mlp_follow_the_markers() -> None:
    pipe = _pipe("mlp")
    block = ["fc.weight", "fc.bias", "norm.weight", "norm.bias"]
    assert _stage_names(pipe) == [
        [f"layers.0.{p}" for p in block],
        [f"layers.1.{p}" for p in block],
        [f"layers.2.{p}" for p in block],
        [f"layers.3.{p}" for p in block] + ["head.weight", "head.bias"],
    ]


def test_stage_modules_do_not_share_parameters_with_the_users_model() -> None:
    model = zoo_models.MLP()
    pipe = pc.split(model, (torch.randn(8, zoo_models.WIDTH),))
    user_ids = {id(p) for p in model.parameters()}
    for i in range(pipe.num_stages):
        assert not user_ids & {id(p) for p in pipe.stage_module(i).parameters()}


def test_split_accepts_a_model_factory() -> None:
    entry = fixtures.get("mlp")
    args, _ = entry.inputs()
    assert pc.split(entry.factory("markers"), args).num_stages == 4


# --------------------------------------------------------------------------- tied weights


@pytest.mark.parametrize("style", ["markers", "spec"])
def test_tiny_gpt_ties_token_embedding_to_lm_head_across_first_and_last_stage(style: str) -> None:
    pipe = _pipe("tiny_gpt", style)
    assert pipe.tied_groups == [pc.TiedGroup("tok_emb.weight", ("lm_head.weight",), (0, 3))]
    assert pipe.param_stages("tok_emb.weight") == (0, 3)
    assert "tok_emb.weight" in pipe.stage_params(0) and "tok_emb.weight" in pipe.stage_params(3)
    assert "lm_head.weight" not in pipe.stage_params(3)  # aliases are reported under the canonical FQN


def test_alias_and_module_reuse_are_both_tied_groups() -> None:
    pipe = _pipe("alias_reuse")
    assert pipe.tied_groups == [
        pc.TiedGroup("proj.weight", ("head.weight",), (0, 2)),
        pc.TiedGroup("shared.fc.weight", (), (0, 2)),
        pc.TiedGroup("shared.fc.bias", (), (0, 2)),
        pc.TiedGroup("shared.norm.weight", (), (0, 2)),
        pc.TiedGroup("shared.norm.bias", (), (0, 2)),
    ]


def test_a_model_without_shared_parameters_has_no_tied_groups() -> None:
    assert _pipe("long_skip", "spec").tied_groups == []


# --------------------------------------------------------------------------- edges and kwargs


def test_long_skip_sends_stage_0_straight_to_stage_3() -> None:
    pipe = _pipe("long_skip", "spec")
    assert pc.Edge(0, 3, "blocks_0_norm") in pipe.edges
    assert pipe.edges == [
        pc.Edge(None, 0, "x"),
        pc.Edge(0, 1, "blocks_0_norm"),
        pc.Edge(1, 2, "blocks_1_norm"),
        pc.Edge(0, 3, "blocks_0_norm"),
        pc.Edge(2, 3, "blocks_2_norm"),
    ]


def test_encoder_output_feeds_every_decoder_stage() -> None:
    pipe = _pipe("encoder_decoder", "spec")
    memory_consumers = [e.dst for e in pipe.edges if e.src == 0]
    assert memory_consumers == [1, 2, 3]


def _input_consumers(pipe: pc.Pipe, name: str) -> list[int]:
    return [e.dst for e in pipe.edges if e.src is None and e.name == name]


@pytest.mark.parametrize("style", ["markers", "spec"])
def test_keyword_input_goes_only_to_the_last_stage(style: str) -> None:
    pipe = _pipe("kwarg_last", style)
    assert _input_consumers(pipe, "bias") == [2]
    assert _input_consumers(pipe, "x") == [0]


@pytest.mark.parametrize("style", ["markers", "spec"])
def test_keyword_defaults_route_only_what_is_passed(style: str) -> None:
    pipe = _pipe("kwarg_default", style)
    assert _input_consumers(pipe, "gate") == [1]
    assert _input_consumers(pipe, "mask") == []
    assert "mask" not in pipe.input_names


def test_a_passed_optional_kwarg_reaches_the_stage_that_uses_it() -> None:
    entry = fixtures.get("kwarg_default")
    args, kwargs = entry.inputs()
    kwargs = {**kwargs, "mask": torch.zeros(8, zoo_models.WIDTH, dtype=torch.bool)}
    pipe = pc.split(entry.factory("markers")(), args, kwargs)
    assert _input_consumers(pipe, "mask") == [2]
    report = pc.assert_equivalent(entry.factory("markers"), args, kwargs, runner="reference",
                                  n_microbatches=2)
    assert report.ok


# --------------------------------------------------------------------------- fx and export agree


def _layout(pipe: pc.Pipe) -> tuple[list[list[str]], list[tuple[int, int]], list[pc.TiedGroup]]:
    between_stages = sorted({(e.src, e.dst) for e in pipe.edges if e.src is not None})
    return _stage_names(pipe), between_stages, pipe.tied_groups


SPEC_CASES = [pytest.param(e.name, id=e.name) for e in fixtures.ZOO if "spec" in e.cut_styles]


@pytest.mark.parametrize("name", SPEC_CASES)
def test_fx_and_export_cut_a_split_spec_the_same_way(name: str) -> None:
    assert _layout(_pipe(name, "spec", tracer="export")) == _layout(_pipe(name, "spec"))


@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize(("point", "first_stage_params"), [
    (pc.SplitPoint.BEGINNING, ["proj.weight", "proj.bias"]),
    (pc.SplitPoint.END, ["proj.weight", "proj.bias", "shared.fc.weight", "shared.fc.bias",
                         "shared.norm.weight", "shared.norm.bias"]),
])
def test_a_spec_naming_a_module_called_twice_cuts_at_both_calls(
        tracer: str, point: pc.SplitPoint, first_stage_params: list[str]) -> None:
    model = zoo_models.AliasAndReuse(markers=False)  # ``shared`` runs before and after ``mid``
    x = torch.randn(8, zoo_models.WIDTH)
    pipe = pc.split(model, (x,), split_spec={"shared": point}, tracer=tracer)
    assert pipe.num_stages == 3
    assert pipe.stage_params(0) == first_stage_params
    assert pc.assert_equivalent(model, (x,), split_spec={"shared": point}, tracer=tracer, runner="reference",
                                n_microbatches=2).ok


# --------------------------------------------------------------------------- outputs


def test_outputs_can_come_from_a_middle_stage() -> None:
    pipe = _pipe("dict_outputs")
    # leaves in pytree order: logits, extra[0] (aux), extra[1][0] (mean)
    assert [s.stage if s else None for s in pipe.output_sources] == [2, 1, 2]
    assert pipe.output_sources[1] == pc.Source(1, "aux")


def test_reference_outputs_keep_the_models_nested_structure() -> None:
    entry = fixtures.get("dict_outputs")
    args, _ = entry.inputs()
    model = entry.factory("markers")()
    result = pc.DetachExecutor(pc.split(model, args)).step(args, n_microbatches=2)
    eager = model(*args)
    assert type(result.outputs) is dict and result.outputs.keys() == eager.keys()
    aux, (mean,) = result.outputs["extra"]
    assert type(result.outputs["extra"]) is tuple and type(result.outputs["extra"][1]) is list
    torch.testing.assert_close(aux, eager["extra"][0])
    torch.testing.assert_close(mean, eager["extra"][1][0])


# --------------------------------------------------------------------------- non-tensor values


class ShapeAcrossStages(nn.Module):
    """Ints computed in stage 0 (a width and the batch size) are used in stage 1."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        width = h.shape[-1]
        batch = x.shape[0]
        pc.pipe_split()
        return self.b(h).reshape(batch, width // 4, 4) * (1.0 / width)


@pytest.mark.parametrize("n_microbatches", [1, 4])
@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_non_tensor_values_cross_a_stage_boundary(tracer: str, n_microbatches: int) -> None:
    x = torch.randn(8, 16)
    pipe = pc.split(ShapeAcrossStages(), (x,), tracer=tracer)
    assert pipe.num_stages == 2
    result = pc.DetachExecutor(pipe).step((x,), n_microbatches=n_microbatches)
    assert result.outputs.shape == (8, 4, 4)
    report = pc.assert_equivalent(ShapeAcrossStages, (x,), runner="reference", tracer=tracer,
                                  n_microbatches=n_microbatches)
    assert report.ok


def test_fx_sends_the_ints_themselves_to_the_next_stage() -> None:
    pipe = pc.split(ShapeAcrossStages(), (torch.randn(8, 16),))
    assert pipe.stages[0].outputs == ("a", "getitem", "getitem_1")
    assert [str(s) for s in pipe.stages[1].inputs] == ["stage 0.a", "stage 0.getitem", "stage 0.getitem_1"]


# --------------------------------------------------------------------------- nothing of the user's is touched


def _snapshot(model: nn.Module) -> dict[str, object]:
    return {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "param_ids": [id(p) for p in model.parameters()],
        "grads": [p.grad for p in model.parameters()],
        "requires_grad": [p.requires_grad for p in model.parameters()],
        "training": [m.training for m in model.modules()],
        "instance_attrs": sorted(model.__dict__),
        "dtypes": [p.dtype for p in model.parameters()],
    }


def _assert_same(before: dict[str, object], after: dict[str, object]) -> None:
    state_before, state_after = before.pop("state"), after.pop("state")
    assert state_before.keys() == state_after.keys()  # type: ignore[attr-defined]
    for key in state_before:  # type: ignore[attr-defined]
        assert torch.equal(state_before[key], state_after[key]), key  # type: ignore[index]
    assert before == after


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", ["tiny_gpt", "kwarg_last", "buffers"])
def test_split_and_check_leave_the_users_model_and_inputs_alone(name: str, training: bool) -> None:
    entry = fixtures.get(name)
    model = entry.factory("spec")().train(training)
    args, kwargs = entry.inputs()
    args = tuple(a.clone().requires_grad_() if a.is_floating_point() else a for a in args)
    inputs_before = [a.detach().clone() for a in args] + [v.clone() for v in kwargs.values()]
    kwargs_keys = list(kwargs)
    spec = entry.cut("spec")["split_spec"]
    spec_before = dict(spec)
    before = _snapshot(model)

    pc.split(model, args, kwargs, split_spec=spec)
    pc.assert_equivalent(model, args, kwargs, runner="reference", split_spec=spec, n_microbatches=2,
                         loss_fn=entry.loss_fn, target=entry.target())
    pc.assert_equivalent(model, args, kwargs, runner="reference", split_spec=spec, dtype=torch.bfloat16,
                         loss_fn=entry.loss_fn, target=entry.target())

    _assert_same(before, _snapshot(model))
    assert "forward" not in model.__dict__  # forward was not replaced on the instance
    assert type(model) is entry.model
    assert spec == spec_before
    assert list(kwargs) == kwargs_keys
    for tensor, original in zip([*args, *kwargs.values()], inputs_before, strict=True):
        assert torch.equal(tensor.detach(), original)
        assert tensor.grad is None


def test_split_does_not_change_a_models_deepcopy_equality() -> None:
    model = zoo_models.LongSkip(markers=False)
    twin = copy.deepcopy(model)
    x = torch.randn(8, zoo_models.WIDTH)
    pc.split(model, (x,), policy=pc.policies.balanced_params(4))
    torch.testing.assert_close(model(x), twin(x), rtol=0, atol=0)


# --------------------------------------------------------------------------- policies


def _mlp_with(policy: pc.policies.Policy) -> pc.Pipe:
    return pc.split(zoo_models.MLP(markers=False), (torch.randn(8, zoo_models.WIDTH),), policy=policy)


def _first_params(pipe: pc.Pipe) -> list[str]:
    return [pipe.stage_params(i)[0] for i in range(pipe.num_stages)]


# MLP: 4 blocks of 1088 + 64 + 64 parameter bytes (fc, norm) and a 272-byte head; 13 compute nodes.
@pytest.mark.parametrize(("policy", "first_params"), [
    pytest.param(pc.policies.balanced_params(2), ["layers.0.fc.weight", "layers.2.fc.weight"],
                 id="balanced_params(2)"),
    pytest.param(pc.policies.balanced_params(4),
                 ["layers.0.fc.weight", "layers.1.fc.weight", "layers.2.fc.weight", "layers.3.fc.weight"],
                 id="balanced_params(4)"),
    pytest.param(pc.policies.balanced_nodes(2), ["layers.0.fc.weight", "layers.2.norm.weight"],
                 id="balanced_nodes(2)"),
    pytest.param(pc.policies.balanced_nodes(3),
                 ["layers.0.fc.weight", "layers.1.norm.weight", "layers.3.fc.weight"],
                 id="balanced_nodes(3)"),
    pytest.param(pc.policies.param_bytes_buckets(1200),
                 ["layers.0.fc.weight", "layers.1.fc.weight", "layers.2.fc.weight", "layers.3.fc.weight"],
                 id="param_bytes_buckets(1200)"),
    pytest.param(pc.policies.param_bytes_buckets(2000), ["layers.0.fc.weight", "layers.2.fc.weight"],
                 id="param_bytes_buckets(2000)"),
    pytest.param(pc.policies.param_bytes_buckets(10**9), ["layers.0.fc.weight"],
                 id="param_bytes_buckets(1GB)"),
])
def test_policy_cuts_mlp_where_expected(policy: pc.policies.Policy, first_params: list[str]) -> None:
    assert _first_params(_mlp_with(policy)) == first_params


def test_balanced_nodes_gives_one_node_per_stage_at_the_limit() -> None:
    pipe = _mlp_with(pc.policies.balanced_nodes(13))
    assert pipe.num_stages == 13


def test_policy_ignores_pipe_split_markers() -> None:
    pipe = pc.split(zoo_models.MLP(markers=True), (torch.randn(8, zoo_models.WIDTH),),
                    policy=pc.policies.balanced_params(2))
    assert pipe.num_stages == 2


def test_policy_counts_a_tied_parameter_once() -> None:
    entry = fixtures.get("tiny_gpt")
    args, _ = entry.inputs()
    pipe = pc.split(entry.factory("spec")(), args, policy=pc.policies.balanced_params(2))
    assert pipe.num_stages == 2
    assert pipe.tied_groups == [pc.TiedGroup("tok_emb.weight", ("lm_head.weight",), (0, 1))]


# --------------------------------------------------------------------------- str(pipe), golden


def test_repr_is_one_line() -> None:
    assert repr(_pipe("mlp")) == "<Pipe MLP: 4 stages, tracer='fx'>"


def test_str_mlp() -> None:
    assert_expected_inline(str(_pipe("mlp")), """\
Pipe(MLP, 4 stages, tracer=fx)
  stage 0:
    inputs:  input x
    outputs: layers_0_norm
    params:  layers.0.fc.weight, layers.0.fc.bias, layers.0.norm.weight, layers.0.norm.bias
  stage 1:
    inputs:  stage 0.layers_0_norm
    outputs: layers_1_norm
    params:  layers.1.fc.weight, layers.1.fc.bias, layers.1.norm.weight, layers.1.norm.bias
  stage 2:
    inputs:  stage 1.layers_1_norm
    outputs: layers_2_norm
    params:  layers.2.fc.weight, layers.2.fc.bias, layers.2.norm.weight, layers.2.norm.bias
  stage 3:
    inputs:  stage 2.layers_2_norm
    outputs: model outputs
    params:  layers.3.fc.weight, layers.3.fc.bias, layers.3.norm.weight, layers.3.norm.bias, head.weight, head.bias""")


def test_str_long_skip_spec() -> None:
    assert_expected_inline(str(_pipe("long_skip", "spec")), """\
Pipe(LongSkip, 4 stages, tracer=fx)
  stage 0:
    inputs:  input x
    outputs: blocks_0_norm
    params:  blocks.0.fc.weight, blocks.0.fc.bias, blocks.0.norm.weight, blocks.0.norm.bias
  stage 1:
    inputs:  stage 0.blocks_0_norm
    outputs: blocks_1_norm
    params:  blocks.1.fc.weight, blocks.1.fc.bias, blocks.1.norm.weight, blocks.1.norm.bias
  stage 2:
    inputs:  stage 1.blocks_1_norm
    outputs: blocks_2_norm
    params:  blocks.2.fc.weight, blocks.2.fc.bias, blocks.2.norm.weight, blocks.2.norm.bias
  stage 3:
    inputs:  stage 0.blocks_0_norm, stage 2.blocks_2_norm
    outputs: model outputs
    params:  blocks.3.fc.weight, blocks.3.fc.bias, blocks.3.norm.weight, blocks.3.norm.bias""")


def test_str_tiny_gpt() -> None:
    assert_expected_inline(str(_pipe("tiny_gpt")), """\
Pipe(TinyGPT, 4 stages, tracer=fx)
  stage 0:
    inputs:  input ids
    outputs: add
    params:  pos_emb, tok_emb.weight
  stage 1:
    inputs:  stage 0.add
    outputs: add_1
    params:  blocks.0.fc.weight, blocks.0.fc.bias, blocks.0.norm.weight, blocks.0.norm.bias
  stage 2:
    inputs:  stage 1.add_1
    outputs: add_2
    params:  blocks.1.fc.weight, blocks.1.fc.bias, blocks.1.norm.weight, blocks.1.norm.bias
  stage 3:
    inputs:  stage 2.add_2
    outputs: model outputs
    params:  tok_emb.weight, blocks.2.fc.weight, blocks.2.fc.bias, blocks.2.norm.weight, blocks.2.norm.bias, ln_f.weight, ln_f.bias
  tied: tok_emb.weight (aliases: lm_head.weight) in stages 0, 3""")


def test_str_kwarg_default() -> None:
    assert_expected_inline(str(_pipe("kwarg_default", "spec")), """\
Pipe(KwargDefault, 3 stages, tracer=fx)
  stage 0:
    inputs:  input x
    outputs: blocks_0_norm
    params:  blocks.0.fc.weight, blocks.0.fc.bias, blocks.0.norm.weight, blocks.0.norm.bias
  stage 1:
    inputs:  input gate, stage 0.blocks_0_norm
    outputs: blocks_1_norm
    params:  blocks.1.fc.weight, blocks.1.fc.bias, blocks.1.norm.weight, blocks.1.norm.bias
  stage 2:
    inputs:  stage 1.blocks_1_norm
    outputs: model outputs
    params:  blocks.2.fc.weight, blocks.2.fc.bias, blocks.2.norm.weight, blocks.2.norm.bias""")


def test_str_encoder_decoder() -> None:
    assert_expected_inline(str(_pipe("encoder_decoder", "spec")), """\
Pipe(EncoderDecoder, 4 stages, tracer=fx)
  stage 0:
    inputs:  input src
    outputs: encoder_layers_2_norm
    params:  encoder.layers.0.fc.weight, encoder.layers.0.fc.bias, encoder.layers.0.norm.weight, encoder.layers.0.norm.bias, encoder.layers.1.fc.weight, encoder.layers.1.fc.bias, encoder.layers.1.norm.weight, encoder.layers.1.norm.bias, ... (12 in all)
  stage 1:
    inputs:  input tgt, stage 0.encoder_layers_2_norm
    outputs: decoder_0_norm
    params:  decoder.0.self_fc.weight, decoder.0.self_fc.bias, decoder.0.cross_fc.weight, decoder.0.cross_fc.bias, decoder.0.norm.weight, decoder.0.norm.bias
  stage 2:
    inputs:  stage 1.decoder_0_norm, stage 0.encoder_layers_2_norm
    outputs: decoder_1_norm
    params:  decoder.1.self_fc.weight, decoder.1.self_fc.bias, decoder.1.cross_fc.weight, decoder.1.cross_fc.bias, decoder.1.norm.weight, decoder.1.norm.bias
  stage 3:
    inputs:  stage 2.decoder_1_norm, stage 0.encoder_layers_2_norm
    outputs: model outputs
    params:  decoder.2.self_fc.weight, decoder.2.self_fc.bias, decoder.2.cross_fc.weight, decoder.2.cross_fc.bias, decoder.2.norm.weight, decoder.2.norm.bias, out.weight, out.bias""")


def test_str_alias_reuse() -> None:
    assert_expected_inline(str(_pipe("alias_reuse")), """\
Pipe(AliasAndReuse, 3 stages, tracer=fx)
  stage 0:
    inputs:  input x
    outputs: shared_norm
    params:  proj.weight, proj.bias, shared.fc.weight, shared.fc.bias, shared.norm.weight, shared.norm.bias
  stage 1:
    inputs:  stage 0.shared_norm
    outputs: mid_norm
    params:  mid.fc.weight, mid.fc.bias, mid.norm.weight, mid.norm.bias
  stage 2:
    inputs:  stage 1.mid_norm
    outputs: model outputs
    params:  proj.weight, shared.fc.weight, shared.fc.bias, shared.norm.weight, shared.norm.bias, head.bias
  tied: proj.weight (aliases: head.weight) in stages 0, 2
  tied: shared.fc.weight in stages 0, 2
  tied: shared.fc.bias in stages 0, 2
  tied: shared.norm.weight in stages 0, 2
  tied: shared.norm.bias in stages 0, 2""")


def test_str_buffers_export() -> None:
    assert_expected_inline(str(_pipe("buffers", "markers", tracer="export")), """\
Pipe(Buffers, 3 stages, tracer=export)
  stage 0:
    inputs:  input x
    outputs: layer_norm
    params:  blocks.0.fc.weight, blocks.0.fc.bias, blocks.0.norm.weight, blocks.0.norm.bias
  stage 1:
    inputs:  stage 0.layer_norm
    outputs: layer_norm_1
    params:  blocks.1.fc.weight, blocks.1.fc.bias, blocks.1.norm.weight, blocks.1.norm.bias
    buffers: scale
  stage 2:
    inputs:  stage 1.layer_norm_1
    outputs: model outputs
    params:  blocks.2.fc.weight, blocks.2.fc.bias, blocks.2.norm.weight, blocks.2.norm.bias
    buffers: scale, step""")


class TorchMarked(nn.Module):
    """Marked for torch.distributed.pipelining's pipeline(), with torch's own pipe_split()."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.pipelining import pipe_split as torch_pipe_split

        h = torch.relu(self.a(x))
        torch_pipe_split()
        return self.b(h)


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_torch_s_own_pipe_split_markers_cut_too(tracer: str) -> None:
    """A model already marked for torch's pipeline() is cut where torch would cut it, not checked as
    one stage; torch's markers are left working for torch afterwards."""
    import torch.distributed.pipelining  # noqa: F401 - registers torch's marker op

    x = torch.randn(8, 4)
    pipe = pc.split(TorchMarked(), (x,), tracer=tracer)
    assert pipe.num_stages == 2 and pipe.stage_params(1) == ["b.weight", "b.bias"]
    assert pc.assert_equivalent(TorchMarked, (x,), runner="reference", n_microbatches=2, tracer=tracer).num_stages == 2
    TorchMarked()(x)  # eager still runs torch's marker as torch's no-op
