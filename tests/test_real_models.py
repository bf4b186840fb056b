"""The real-model suite (benchmarks/real_models.py, ``nox -s real_models``): CI keeps a few families through
runner="reference", and the verdicts the table is made of, each outcome planted once."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))
import real_models  # noqa: E402
from mutants.runners import MUTANTS, check  # noqa: E402

import pipecheck as pc  # noqa: E402
from pipecheck.errors import AdapterError, EngineError, SplitError  # noqa: E402

# What each representative family does through runner="reference", in its default config, in train mode:
# Llama as users write it (use_cache=True: the cache is left out), a decoder with a custom autograd.Function
# (RecurrentGemma), a vision transformer, an encoder whose default dropout export cannot key (BERT), and
# ALBERT's one shared layer (cut by a policy; slow).
EXPECTED = {
    "llama": ("pass", ""),
    "recurrent_gemma": ("pass", ""),
    "vit": ("pass", ""),
    "albert": ("pass", ""),
    "bert": ("pass", ""),
}


@pytest.mark.parametrize("family", [pytest.param(name, marks=[pytest.mark.slow] if name == "albert" else [])
                                    for name in sorted(EXPECTED)])
def test_a_family_through_the_reference_runner(family: str) -> None:
    cell = real_models.row(family, ["reference"], stages=2)["reference"]
    outcome, why = EXPECTED[family]
    assert (cell.outcome, why in cell.why) == (outcome, True), cell


CONTIGUOUS = "RuntimeError: input tensor has to be contiguous\ntorch.distributed.pipelining failed on rank 0"


@pytest.mark.parametrize(("runner", "error", "outcome", "why"), [
    pytest.param("torch", EngineError(CONTIGUOUS, rank=0), "torch bug", "gloo sends only contiguous", id="torch-contiguous"),
    pytest.param("distributed", EngineError(CONTIGUOUS, rank=0), "fail", "contiguous", id="ours-same-message-fails"),
    pytest.param("torch", EngineError("stage 1 fails\nmore", rank=1), "fail", "stage 1 fails", id="torch-unknown-fails"),
    pytest.param("torch", EngineError("torch cannot cut where the policy cuts: ...\nFix: markers.", engine="torch"),
                 "refused", "EngineError: torch cannot cut where the policy cuts", id="torch-cannot-cut"),
    pytest.param("distributed", EngineError("pipecheck's runtime did not finish within 9 s (rank 1 hung)", rank=1),
                 "error", "did not finish within 9 s", id="timeout"),
    pytest.param("torch", EngineError("RuntimeError: odd\nThis is torch.distributed.pipelining's bug, not your "
                                      "model's: it does X. Fix: Y.\nmore"), "torch bug", "it does X. Fix: Y",
                 id="torch-runner-says-so"),
    pytest.param("torch", EngineError("forward() got an unexpected keyword argument 'mask'\n... refused before any "
                                      "rank started."), "torch bug", "stage 0's forward only", id="torch-kwarg"),
    pytest.param("torch", EngineError("torch returns only last-stage outputs; output['encoder_last_hidden_state'] is "
                                      "stage 0's", rank=0), "torch bug", "only the last stage's outputs",
                 id="torch-last-stage-outputs"),
    pytest.param("reference", SplitError("Model.forward returns a Cache. Fix: use_cache=False."), "refused",
                 "SplitError: Model.forward returns a Cache. Fix: use_cache=False", id="refusal-one-line"),
    pytest.param("distributed", AdapterError("torch moved an API"), "error", "AdapterError", id="adapter"),
    pytest.param("reference", ValueError("boom"), "error", "ValueError: boom", id="not-ours"),
])
def test_a_verdict_says_whose_it_is(runner: str, error: Exception, outcome: str, why: str) -> None:
    cell = real_models.classify(runner, error)
    assert (cell.outcome, why in cell.why) == (outcome, True), cell


def test_an_unsynchronised_tied_weight_is_torchs_bug_only_on_the_torch_runner() -> None:
    with pytest.raises(pc.EquivalenceError) as caught:
        check(MUTANTS["tied_one_stage"], "tiny_gpt")
    assert real_models.classify("torch", caught.value).outcome == "torch bug"
    assert real_models.classify("distributed", caught.value).outcome == "fail"


def test_the_table_counts_every_outcome_per_runner() -> None:
    cells = {"a": {"reference": real_models.Cell("pass", "pass"), "torch": real_models.Cell("torch bug", "torch bug",
                                                                                             "why a")},
             "b": {"reference": real_models.Cell("refused", "refused", "why b"),
                   "torch": real_models.Cell("error", "ERROR", "why c")}}
    text = real_models.table(cells, ["reference", "torch"], stages=2)
    assert "- reference: 1 pass, 1 refused, 0 torch bug, 0 fail, 0 error" in text
    assert "- torch: 0 pass, 0 refused, 1 torch bug, 0 fail, 1 error" in text
    assert "- b, reference: why b" in text and "| b | torchvision | refused | ERROR |" in text


@pytest.mark.parametrize(("script", "why"), [("raise SystemExit('died')", "crashed: died"),
                                             ("import time; time.sleep(60)", "timeout: no result within 1 s")])
def test_a_hung_or_crashed_model_is_its_rows_error(script: str, why: str, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "model.py").write_text(script)
    monkeypatch.setattr(real_models, "__file__", str(tmp_path / "model.py"))  # what the subprocess runs
    cells = real_models.row_in_subprocess("vit", ["reference", "torch"], stages=2, timeout_s=1)
    assert {runner: (cell.outcome, cell.why) for runner, cell in cells.items()} == {
        "reference": ("error", why), "torch": ("error", why)}
