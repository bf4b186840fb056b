"""Models with random ops in train mode, as users write them, checked under pipecheck's randomness contract.

HuggingFace GPT-2, BERT and BART in their default train configs (dropout everywhere, SDPA's dropout_p)
and Llama with attention_dropout, all traced by torch.export; functional dropout and SDPA dropout in
a model of one's own; a model that recomputes its dropout without restoring the RNG state is refused,
naming the cause, since its own gradients do not come from its forward's masks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import pipecheck as pc

transformers = pytest.importorskip("transformers")

IDS = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0))


def bert() -> nn.Module:
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64, vocab_size=64,
        max_position_embeddings=32))


def llama() -> nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,
        vocab_size=64, attention_dropout=0.1, use_cache=False))


def bart() -> nn.Module:
    torch.manual_seed(0)
    return transformers.BartForConditionalGeneration(transformers.BartConfig(
        encoder_layers=1, decoder_layers=1, d_model=32, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=64, max_position_embeddings=32))


HF = {"gpt2": (gpt2, "transformer.h.1"), "bert": (bert, "bert.encoder.layer.1"),
      "llama": (llama, "model.layers.1"), "bart": (bart, "model.decoder")}


@pytest.mark.parametrize("family", sorted(HF))
@pytest.mark.parametrize("runner", ["reference", "distributed"])
def test_hf_models_in_their_default_train_config_are_checked_by_the_contract(pipecheck_world, family: str,
                                                                             runner: str) -> None:  # type: ignore[no-untyped-def]
    factory, cut = HF[family]
    assert factory().training  # as from_config / the constructor gives it: train mode, dropout on
    report = pc.assert_equivalent(factory, (IDS,), split_spec={cut: pc.SplitPoint.BEGINNING}, n_microbatches=2,
                                  runner=runner, world=pipecheck_world(2) if runner == "distributed" else None)
    assert report.ok and report.tracer == "export" and "drawn by pipecheck's randomness contract" in report.headline()


def test_a_wrong_mask_in_a_hf_model_is_caught() -> None:
    """The contract makes eager draw the stages' numbers; a runner that draws any others fails."""
    from mutants.random_draws import DrawingEngine

    with pytest.raises(pc.EquivalenceError) as caught:
        pc.assert_equivalent(gpt2, (IDS,), split_spec={"transformer.h.1": pc.SplitPoint.BEGINNING}, n_microbatches=2,
                             runner=DrawingEngine(shift=1))
    assert "micro-batch 0 drew micro-batch 1's" in " ".join(caught.value.report.hints.values())


class FunctionalDropout(nn.Module):
    """F.dropout and SDPA's dropout_p in a forward of one's own (what HF attention does), checkpointed."""

    def __init__(self, preserve_rng_state: bool = True) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(8, 24), nn.Linear(8, 8)
        self.preserve_rng_state = preserve_rng_state

    def block(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, -1)
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.2 if self.training else 0.0).squeeze(1)
        return F.dropout(a, 0.1, self.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.block, x, use_reentrant=False, preserve_rng_state=self.preserve_rng_state)
        pc.pipe_split()
        return self.out(F.dropout(h, 0.3, self.training))


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_functional_dropout_and_sdpa_dropout_in_a_checkpointed_region_are_checked(tracer: str) -> None:
    torch.manual_seed(0)
    report = pc.assert_equivalent(FunctionalDropout(), (torch.randn(4, 5, 8),), n_microbatches=2, runner="reference",
                                  tracer=tracer, steps=2, optimizer=_sgd)
    assert report.ok and "3 random ops" in report.headline()


def test_a_model_that_recomputes_its_dropout_without_restoring_the_rng_state_is_refused() -> None:
    torch.manual_seed(0)
    with pytest.raises(pc.InputError, match=r"recomputes random ops in backward .* without restoring torch's RNG "
                                            r"state.*Fix: preserve_rng_state=True"):
        pc.assert_equivalent(FunctionalDropout(preserve_rng_state=False), (torch.randn(4, 5, 8),), n_microbatches=2,
                             runner="reference")


def _sgd(params):  # type: ignore[no-untyped-def]
    return torch.optim.SGD(params, lr=0.1)


@pytest.mark.gpu(n=1)
def test_dropout_on_a_gpu_draws_by_the_contract_and_fused_attention_dropout_is_refused() -> None:
    """On CUDA the stages draw from the device's generator (fused native_dropout), eager and the float64
    truth replay those masks; flash/efficient attention draws its mask inside the kernel: refused, with
    the math kernel as the fix, which then checks."""
    from _training_models import make_dropout_net
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with pc.World(2, device="cuda") as world:
        for runner in ("reference", "distributed"):
            report = pc.assert_equivalent(make_dropout_net, (torch.randn(16, 8),), n_microbatches=4, device="cuda",
                                          runner=runner, world=world, steps=2)
            assert report.ok, report
    spec = {"transformer.h.1": pc.SplitPoint.BEGINNING}
    with pytest.raises(pc.InputError, match="fused kernel"):
        pc.assert_equivalent(gpt2, (IDS,), split_spec=spec, n_microbatches=2, device="cuda", dtype=torch.float16,
                             runner="reference")
    with sdpa_kernel(SDPBackend.MATH):
        assert pc.assert_equivalent(gpt2, (IDS,), split_spec=spec, n_microbatches=2, device="cuda",
                                    runner="reference").ok


class TorchLayers(nn.Module):
    """nn.TransformerEncoderLayer (dropout 0.1 inside, F.dropout and attention dropout) kept whole by fx."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_dropout_inside_a_module_fx_keeps_whole_is_seen_and_checked() -> None:
    torch.manual_seed(0)
    report = pc.assert_equivalent(TorchLayers(), (torch.randn(4, 5, 16),), split_spec={"layers.1":
                                  pc.SplitPoint.BEGINNING}, n_microbatches=2, runner="reference")
    assert report.ok and report.tracer == "fx", report
    assert "2 random ops" in report.headline()


class LstmDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.head = nn.LSTM(8, 8, num_layers=2, dropout=0.3, batch_first=True), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.rnn(x)[0]
        pc.pipe_split()
        return self.head(h)


class RandomSlope(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.act, self.drop, self.b = nn.Linear(8, 8), nn.RReLU(), nn.Dropout(0.2), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.act(self.a(x)))
        pc.pipe_split()
        return self.b(h)


def test_an_lstm_s_dropout_between_its_layers_is_seen_and_checked_on_the_cpu() -> None:
    """fx keeps nn.LSTM whole; on the CPU its dropout runs as dropout ops (cuDNN's fused RNN on a GPU draws
    inside itself: refused as the next test's op is)."""
    torch.manual_seed(0)
    report = pc.assert_equivalent(LstmDropout(), (torch.randn(4, 3, 8),), n_microbatches=2, runner="reference")
    assert report.ok and "1 random op" in report.headline()


def test_an_op_that_draws_inside_itself_is_refused_naming_it() -> None:
    torch.manual_seed(0)
    with pytest.raises(pc.InputError) as refused:
        pc.assert_equivalent(RandomSlope(), (torch.randn(4, 8),), n_microbatches=2, runner="reference")
    text = str(refused.value)
    assert ("the model's op aten::rrelu_with_noise (stage 0) draws its random numbers inside the op, whose output is "
            "not the draw") in text and "attention" not in text, text


def test_a_loss_that_draws_random_numbers_is_refused_whatever_the_model_draws() -> None:
    """A deterministic model with dropout in its loss: eager and a runner would draw other masks for it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(F.dropout(out, 0.2), target)

    for make in (lambda: model, lambda: nn.Sequential(*model, nn.Dropout(0.1))):
        with pytest.raises(pc.InputError, match=r"the loss function draws random numbers \(aten::bernoulli_\)"):
            pc.assert_equivalent(make(), (torch.randn(8, 8),), loss_fn=loss, target=torch.randn(8, 4),
                                 split_spec={"2": pc.SplitPoint.BEGINNING}, n_microbatches=2, runner="reference")


def test_a_gradient_eager_does_not_have_fails_a_check_of_a_random_model() -> None:
    """A model with dropout is checked as a training check: a runner's extra gradient (of a parameter eager
    leaves without one) is a failing row there too, as in a one-step check."""
    from mutants.random_draws import DrawingEngine

    class Extra(DrawingEngine):
        def train(self, job):  # type: ignore[no-untyped-def]
            results = super().train(job)
            for result in results:
                result.grads["l0.weight"] = result.grads["l0.weight"]
                result.grads["unused"] = torch.ones(3)
            return results

    from _training_models import make_dropout_net

    with pytest.raises(pc.EquivalenceError) as caught:
        pc.assert_equivalent(make_dropout_net, (torch.randn(8, 8),), n_microbatches=2, runner=Extra())
    assert not caught.value.report.row("grad unused").ok


class LearnedGate(nn.Module):
    """A draw from probabilities the model computes: bernoulli(sigmoid(logit))."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.logit, self.b = nn.Linear(8, 8), nn.Parameter(torch.zeros(8)), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x) * torch.bernoulli(torch.sigmoid(self.logit).expand(x.shape[0], 8))
        pc.pipe_split()
        return self.b(h)


def test_a_draw_from_values_the_optimizer_moves_is_refused_over_several_steps_and_checked_in_one() -> None:
    """Draws are recorded once, from the starting parameters: replaying them into eager's later steps
    would fail a correct engine (found by review)."""
    torch.manual_seed(0)
    x = torch.randn(8, 8)
    assert pc.assert_equivalent(LearnedGate(), (x,), n_microbatches=2, runner="reference").ok
    with pytest.raises(pc.InputError, match=r"aten::bernoulli \(stage 0\) draws from values the model computes"):
        pc.assert_equivalent(LearnedGate(), (x,), n_microbatches=2, runner="reference", steps=2, optimizer=_sgd)


def _one_call(job: pc.Job) -> pc.StepResult:  # no follows_random_contract: fine for a deterministic model
    return pc.DetachExecutor(job.split()).step(job.args, job.kwargs, loss_fn=job.loss_fn, target=job.target,
                                               n_microbatches=job.n_microbatches)


class QuietRnn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.head = nn.LSTM(8, 8, dropout=0.2, batch_first=True), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.rnn(x)[0]
        pc.pipe_split()
        return self.head(h)


@pytest.mark.filterwarnings("ignore:dropout option adds dropout after all but last recurrent layer")
def test_a_one_layer_rnn_s_dropout_draws_nothing_and_leaves_the_check_deterministic() -> None:
    """torch applies an RNN's dropout= between its layers only: any runner checks a one-layer LSTM."""
    torch.manual_seed(0)
    report = pc.assert_equivalent(QuietRnn(), (torch.randn(4, 3, 8),), n_microbatches=2, runner=_one_call)
    assert report.ok and "random op" not in report.headline()


def test_stochastic_depth_with_p_0_draws_nothing_and_leaves_the_check_deterministic() -> None:
    StochasticDepth = pytest.importorskip("torchvision.ops").StochasticDepth  # the [vision] extra

    class Quiet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.depth, self.head = nn.Linear(8, 8), StochasticDepth(0.0, "row"), nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            pc.pipe_split()
            return self.head(h + self.depth(h))

    torch.manual_seed(0)
    report = pc.assert_equivalent(Quiet(), (torch.randn(4, 8),), n_microbatches=2, runner=_one_call)
    assert report.ok and "random op" not in report.headline()


def test_a_one_call_runner_that_follows_the_contract_checks_a_random_model() -> None:
    """A one-step check of a random model runs as a training check: a runner with no train method is called
    once, as in any one-step check (it was refused as needing an engine kept from step to step)."""
    from _training_models import make_dropout_net

    def one_call(job: pc.Job) -> pc.StepResult:
        from mutants.random_draws import DrawingEngine

        return DrawingEngine().train(job)[0]

    one_call.follows_random_contract = True  # type: ignore[attr-defined]
    assert pc.assert_equivalent(make_dropout_net, (torch.randn(8, 8),), n_microbatches=2, runner=one_call).ok
