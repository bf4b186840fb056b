"""The real-model suite: HuggingFace families and torchvision models as users write them, through
runner="reference", "distributed" and "torch"; its table is docs/real-models.md.

    python benchmarks/real_models.py                          # every family, every runner (about an hour on 2 cores)
    python benchmarks/real_models.py --families llama,bert --runners reference
    python benchmarks/real_models.py --write                  # and rewrite docs/real-models.md's table
    nox -s real_models                                        # the nightly session: the whole suite, --write

Each HF family is built from its own config class with small sizes (hidden 32, 4 layers, 2 heads, a
128-token vocabulary) and every other setting at its default, as a user writes it: ``use_cache``, dropout
and attention implementation included, in train mode, random weights, nothing downloaded. The torchvision
models are their constructors' defaults (1000 classes, BatchNorm, dropout), in train mode, on 64x64 images.
Every check is ``pc.assert_equivalent(factory, inputs, split_spec=..., n_microbatches=2)``: the HF models
cut evenly along their longest stack of layers (``model.layers.2`` of 4), the others (torchvision's,
ALBERT's one shared layer) by ``policies.balanced_params(stages)``; the default loss (a projection of every output).

Each model runs in a subprocess of its own with a timeout, so that a hang or a crash is one row's
cell, not the run's end. A cell is one of: ``pass``; ``refused`` (pipecheck declines the check and
says why; one line each below the table); ``torch bug`` (runner="torch" only: torch.distributed.pipelining
fails, or runs and is wrong, in one of its known ways, named in ``TORCH_BUGS``); ``fail`` (a mismatch, or
an engine failure nobody has explained: to look at); ``error`` (pipecheck's own bug, a timeout or a
crash).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

import pipecheck as pc
from pipecheck.errors import (
    AdapterError,
    EngineError,
    EquivalenceError,
    PipecheckError,
    PowerError,
    first_line,
)

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "real-models.md"
RUNNERS = ("reference", "distributed", "torch")
OUTCOMES = ("pass", "refused", "torch bug", "fail", "error")
VOCAB, BATCH, SEQ, IMAGE = 128, 4, 8, 64
MICROBATCHES = 2
CHECK_TIMEOUT_S = 180.0  # one check's ranks; a model's subprocess gets all its checks' worth and more

# The sizes every HF family gets (mapped onto its own names by its config's attribute_map); the rest is its default.
SMALL: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                             num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
                             bos_token_id=0, eos_token_id=0, pad_token_id=0)

# family: (config class, model class, inputs, the family's own names for the small sizes)
HF: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    "albert": ("AlbertConfig", "AlbertForMaskedLM", "tokens", {"embedding_size": 16}),
    "bart": ("BartConfig", "BartForConditionalGeneration", "seq2seq",
             {"encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "decoder_layers": 4, "decoder_attention_heads": 2}),
    "bert": ("BertConfig", "BertForMaskedLM", "tokens", {}),
    "biogpt": ("BioGptConfig", "BioGptForCausalLM", "tokens", {}),
    "bloom": ("BloomConfig", "BloomForCausalLM", "tokens", {}),
    "codegen": ("CodeGenConfig", "CodeGenForCausalLM", "tokens", {"rotary_dim": 8}),
    "cohere": ("CohereConfig", "CohereForCausalLM", "tokens", {}),
    "distilbert": ("DistilBertConfig", "DistilBertForMaskedLM", "tokens", {"hidden_dim": 64}),
    "electra": ("ElectraConfig", "ElectraForMaskedLM", "tokens", {"embedding_size": 16}),
    "falcon": ("FalconConfig", "FalconForCausalLM", "tokens", {}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", "tokens", {"head_dim": 16}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", "tokens", {"head_dim": 16}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", "tokens", {}),
    "gpt_neo": ("GPTNeoConfig", "GPTNeoForCausalLM", "tokens", {"attention_types": [[["global", "local"], 2]]}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", "tokens", {}),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", "tokens", {"rotary_dim": 8}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", "tokens", {}),
    "jamba": ("JambaConfig", "JambaForCausalLM", "tokens",
              {"num_experts": 4, "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
               "expert_layer_offset": 1, "mamba_d_state": 8, "mamba_expand": 2}),
    "llama": ("LlamaConfig", "LlamaForCausalLM", "tokens", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", "tokens", {}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", "tokens", {"num_local_experts": 4}),
    "mpt": ("MptConfig", "MptForCausalLM", "tokens", {}),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", "tokens", {}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", "tokens", {}),
    "opt": ("OPTConfig", "OPTForCausalLM", "tokens", {"ffn_dim": 64, "word_embed_proj_dim": 32}),
    "phi": ("PhiConfig", "PhiForCausalLM", "tokens", {}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", "tokens", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "tokens", {}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", "tokens",
                  {"num_experts": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "tokens", {"head_dim": 16}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "tokens",
                  {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
    "recurrent_gemma": ("RecurrentGemmaConfig", "RecurrentGemmaForCausalLM", "tokens",
                        {"lru_width": 32, "attention_window_size": 16, "head_dim": 16,
                         "block_types": ["recurrent", "attention"]}),
    "roberta": ("RobertaConfig", "RobertaForMaskedLM", "tokens", {}),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", "tokens", {}),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", "tokens", {}),
    "t5": ("T5Config", "T5ForConditionalGeneration", "seq2seq", {"d_kv": 16, "d_ff": 64}),
    "vit": ("ViTConfig", "ViTForImageClassification", "image", {"image_size": 16, "patch_size": 4}),
    "xglm": ("XGLMConfig", "XGLMForCausalLM", "tokens", {"ffn_dim": 64}),
}

VISION = ("convnext_tiny", "densenet121", "efficientnet_b0", "efficientnet_v2_s", "googlenet", "mnasnet0_5",
          "mobilenet_v2", "mobilenet_v3_large", "mobilenet_v3_small", "regnet_x_400mf", "regnet_y_400mf",
          "resnet18", "resnet50", "resnext50_32x4d", "shufflenet_v2_x0_5", "squeezenet1_1")

# torch.distributed.pipelining's known failures (docs/zoo.md): a runner="torch" cell whose message has
# one of these is torch's, said in a line. Anything else that fails there is a "fail", to look at.
TORCH_BUGS: dict[str, str] = {
    "tied parameter not synchronised": "torch gives each stage its own copy of a tied weight and never sums "
                                       "their gradients: each keeps one stage's share (torch's bug)",
    "Backward of skip connections not supported yet": "torch's stages cannot send a gradient past the previous "
                                                      "stage (a value used two or more stages later; torch's limit)",
    "only supports adjacent-stage communication": "torch's multi-stage schedule cannot send past the next stage "
                                                  "(a skip connection; torch's limit)",
    "unexpected keyword argument": "torch's schedule hands the step's keyword inputs to stage 0's forward only "
                                   "(a kwarg read by a later stage; torch's bug)",
    "torch returns only last-stage outputs": "torch's schedule returns only the last stage's outputs: a model "
                                             "output computed on an earlier stage (an encoder's last hidden "
                                             "state, an auxiliary head) is lost (torch's limit)",
    "input tensor has to be contiguous": "torch's PipelineStage sends a stage's output (or input gradient) as "
                                         "it is, and gloo sends only contiguous tensors: a transposed or sliced "
                                         "value crosses the cut (torch's bug: stage.py's isend never calls "
                                         ".contiguous())",
}


TORCH_SAYS_SO = "torch.distributed.pipelining's bug"  # how runner="torch" itself names a known bug of torch


def build_hf(family: str, train: bool = True) -> nn.Module:
    """The family's model, built from its config class with ``SMALL`` sizes and its own defaults, in train
    mode (``train=False``: eval mode, as benchmarks/bench_warm.py times it)."""
    import transformers

    config_class, model_class, _, own = HF[family]
    config = getattr(transformers, config_class)(**{**SMALL, **own})
    return getattr(transformers, model_class)(config).train(train)


def build_vision(name: str) -> nn.Module:
    """torchvision's ``name`` as its constructor makes it (random weights), in train mode."""
    import torchvision

    return getattr(torchvision.models, name)().train()


@dataclasses.dataclass(frozen=True)
class Model:
    """One row: how to build the model (a picklable factory), its inputs and its cut."""

    name: str
    factory: Callable[[], nn.Module]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    cut: dict[str, Any]


def model(name: str, stages: int = 2, train: bool = True) -> Model:
    """The suite's ``name`` (an HF family or a torchvision model), cut into ``stages``."""
    generator = torch.Generator().manual_seed(0)
    if name in HF:
        factory = functools.partial(build_hf, name, train)
        kind = HF[name][2]
        if kind == "image":
            args: tuple[Any, ...] = (torch.randn(BATCH, 3, 16, 16, generator=generator),)
        else:
            args = (torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator),)
        kwargs = ({"decoder_input_ids": torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)}
                  if kind == "seq2seq" else {})
        cuts = layer_cuts(factory(), stages)
        cut = {"split_spec": cuts} if cuts else {"policy": pc.policies.balanced_params(stages)}
        return Model(name, factory, args, kwargs, cut)
    if name in VISION:
        return Model(name, functools.partial(build_vision, name),
                     (torch.randn(BATCH, 3, IMAGE, IMAGE, generator=generator),), {},
                     {"policy": pc.policies.balanced_params(stages)})
    raise KeyError(f"no model {name!r} in the suite. Fix: choose from {', '.join(names())}.")


def layer_cuts(built: nn.Module, stages: int) -> dict[str, pc.SplitPoint] | None:
    """Cuts before evenly spaced layers of the model's longest ``nn.ModuleList`` (its decoder layers); None
    where it has too few (ALBERT runs one shared layer 4 times: it is cut by ``balanced_params``)."""
    path, layers = max(((name, m) for name, m in built.named_modules() if isinstance(m, nn.ModuleList)),
                       key=lambda item: len(item[1]), default=("", nn.ModuleList()))
    if len(layers) < stages:
        return None
    return {f"{path}.{i * len(layers) // stages}": pc.SplitPoint.BEGINNING for i in range(1, stages)}


def names(which: str = "all") -> list[str]:
    """The suite's models: ``"hf"``, ``"vision"``, ``"all"`` or a comma-separated list of names."""
    groups = {"hf": sorted(HF), "vision": list(VISION), "all": [*sorted(HF), *VISION]}
    return groups.get(which) or which.split(",")


@dataclasses.dataclass(frozen=True)
class Cell:
    """One model x runner: its outcome (one of ``OUTCOMES``), the table's text and the one-line why."""

    outcome: str
    text: str
    why: str = ""


def classify(runner: str, result: Any) -> Cell:
    """The verdict of one check: ``result`` is the check's Report or the exception it raised."""
    if isinstance(result, pc.Report):
        worst = max((row.max_abs for row in result.rows if row.numel), default=0.0)
        return Cell("pass", f"pass ({worst:.0e})")
    message = first_line(result)
    if isinstance(result, EquivalenceError):
        failure = result.report.failures[0]
        hint = result.report.hints.get(failure.name, "")
        message = f"{failure.name}: {hint.split(':')[0]}" if hint else f"{failure.name} differs from eager"
    if runner == "torch" and isinstance(result, EngineError | EquivalenceError):
        known = next((why for sign, why in TORCH_BUGS.items() if sign in message or sign in str(result)), None)
        said = [line for line in str(result).splitlines() if TORCH_SAYS_SO in line]  # the torch runner's own word
        known = known or (one_line(said[0]) if said else None)
        if known is not None:
            return Cell("torch bug", "torch bug", f"{message[:100]} — {known}")
    if isinstance(result, EquivalenceError):
        return Cell("fail", "FAIL", message)
    if isinstance(result, AdapterError) or not isinstance(result, PipecheckError):
        return Cell("error", "ERROR", f"{type(result).__name__}: {message}")
    if isinstance(result, EngineError) and " did not finish within " in message:
        return Cell("error", "ERROR (timeout)", one_line(str(result)))
    if isinstance(result, EngineError) and (result.rank is not None or result.cause is not None):
        return Cell("fail", "FAIL (engine)", one_line(str(result)))  # an engine failed mid-step, for no known reason
    # else an engine's refusal of the split, said before any rank started (what torch cannot express or run)
    if isinstance(result, PowerError):
        return Cell("refused", "refused", f"blind: {one_line(str(result))}")
    return Cell("refused", "refused", f"{type(result).__name__}: {one_line(str(result))}")


def one_line(message: str) -> str:
    """A message's first sentence and its fix, if any (pipecheck's messages are the rule, the values, the fix)."""
    first = first_line(message).split(". ")[0].rstrip(".")
    fix = first_line(message.partition("Fix: ")[2])
    first = first if len(first) <= 240 else first[:237] + "..."
    return f"{first}. Fix: {fix[:160]}" if fix and fix not in first else first


def check(entry: Model, runner: str, stages: int) -> Cell:
    """One cell, in this process."""
    try:
        report = pc.assert_equivalent(entry.factory, entry.args, entry.kwargs, runner=runner,
                                      n_microbatches=MICROBATCHES, world_size=stages, timeout=CHECK_TIMEOUT_S,
                                      **entry.cut)
    except KeyboardInterrupt:
        raise
    except Exception as err:  # every other outcome is a cell
        return classify(runner, err)
    return classify(runner, report)


def row(name: str, runners: Sequence[str], stages: int) -> dict[str, Cell]:
    """One model's cells, in this process (the build itself may fail: every cell then says so)."""
    try:
        entry = model(name, stages)
    except Exception as err:
        return {runner: Cell("error", "ERROR", f"building it: {type(err).__name__}: {first_line(err)}")
                for runner in runners}
    return {runner: check(entry, runner, stages) for runner in runners}


def row_in_subprocess(name: str, runners: Sequence[str], stages: int, timeout_s: float) -> dict[str, Cell]:
    """``row`` in a fresh interpreter: a hang is killed at ``timeout_s``, a crash is its row's cells."""
    command = [sys.executable, __file__, "--one", name, "--runners", ",".join(runners), "--stages", str(stages)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    except subprocess.TimeoutExpired:  # run() kills the child; its ranks die with their parent's pipes
        return {runner: Cell("error", "ERROR", f"timeout: no result within {timeout_s:.0f} s") for runner in runners}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = first_line("\n".join(done.stderr.strip().splitlines()[-1:])) or f"exit status {done.returncode}"
        return {runner: Cell("error", "ERROR", f"crashed: {tail}") for runner in runners}
    return {runner: Cell(**cell) for runner, cell in json.loads(lines[-1]).items()}


def totals(rows: dict[str, dict[str, Cell]], runners: Sequence[str]) -> dict[str, dict[str, int]]:
    """How many cells of each outcome, per runner."""
    return {runner: {outcome: sum(cells[runner].outcome == outcome for cells in rows.values() if runner in cells)
                     for outcome in OUTCOMES} for runner in runners}


def table(rows: dict[str, dict[str, Cell]], runners: Sequence[str], stages: int) -> str:
    """The markdown of docs/real-models.md's generated part: the table, the totals and each cell's why."""
    lines = [f"| model | kind | {' | '.join(runners)} |", "| --- | --- |" + " --- |" * len(runners)]
    whys = []
    for name, cells in rows.items():
        kind = "HF" if name in HF else "torchvision"
        lines.append(f"| {name} | {kind} | " + " | ".join(cells[r].text for r in runners) + " |")
        whys += [f"- {name}, {runner}: {cells[runner].why}" for runner in runners if cells[runner].why]
    counted = totals(rows, runners)
    lines += ["", f"Totals ({len(rows)} models, {stages} stages, {MICROBATCHES} micro-batches):", ""]
    lines += [f"- {runner}: " + ", ".join(f"{counted[runner][o]} {o}" for o in OUTCOMES) for runner in runners]
    return "\n".join([*lines, "", "Why, cell by cell:", "", *whys]) if whys else "\n".join(lines)


BEGIN, END = "<!-- real-models:begin -->", "<!-- real-models:end -->"


def write_doc(body: str) -> None:
    """Replace the generated part of docs/real-models.md (between its markers) with ``body``."""
    text = DOC.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    DOC.write_text(text[:start] + "\n" + body.strip() + "\n" + text[end:])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="all", help="hf, vision, all, or a comma-separated list of names")
    parser.add_argument("--runners", default=",".join(RUNNERS))
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per model (all its runners)")
    parser.add_argument("--write", action="store_true", help="rewrite docs/real-models.md's table")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the subprocess of one model: its cells as JSON
    opts = parser.parse_args(argv)
    runners = opts.runners.split(",")
    if opts.one:
        cells = row(opts.one, runners, opts.stages)
        print(json.dumps({runner: dataclasses.asdict(cell) for runner, cell in cells.items()}), flush=True)
        return 0
    started = time.perf_counter()
    rows: dict[str, dict[str, Cell]] = {}
    for name in names(opts.families):
        begun = time.perf_counter()
        rows[name] = row_in_subprocess(name, runners, opts.stages, opts.timeout)
        print(f"{name:20} " + "  ".join(f"{r}={rows[name][r].text}" for r in runners)
              + f"  ({time.perf_counter() - begun:.0f}s)", flush=True)
    wall = time.perf_counter() - started
    import transformers

    command = "python benchmarks/real_models.py " + " ".join(argv if argv is not None else sys.argv[1:])
    body = (f"{table(rows, runners, opts.stages)}\n\n_torch {torch.__version__}, transformers "
            f"{transformers.__version__}{_torchvision()}; {len(rows)} models in {wall / 60:.0f} min on "
            f"{_machine()}; generated by `{command.strip()}`._")
    print(body)
    if opts.write:
        write_doc(body)
    return 0


def _torchvision() -> str:
    try:
        import torchvision
    except ImportError:
        return ", no torchvision"
    return f", torchvision {torchvision.__version__}"


def _machine() -> str:
    import os
    import platform

    return f"{platform.machine()}, {os.cpu_count()} CPUs, CPU only"


if __name__ == "__main__":
    sys.exit(main())
