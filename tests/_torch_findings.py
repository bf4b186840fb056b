"""What torch.distributed.pipelining does on the installed torch, where it differs by release: the
expectations of the tests that pin torch's behaviour, keyed by the release ranges measured
(docs/torch-versions.md has the whole table, from ``nox -s matrix``)."""

from __future__ import annotations

import importlib.metadata
import importlib.util

import torch
from packaging.version import Version

# private: the torch-version keys every finding is written against
from pipecheck._core.torch_versions import at_least

VERSION = torch.__version__

# A skip connection's backward: torch up to 2.11 asserts (a built-in error, shown with its type); from
# 2.12 it raises its own PipeliningMetadataError (shown by its message alone).
SKIP = ("" if at_least(VERSION, "2.12") else "AssertionError: ") + "Backward of skip connections not supported yet"

# GPT-2 and BERT (hf_gpt2, hf_bert) under pipeline(): from 2.13 torch runs them and leaves the tied word
# embedding unsynchronised (a silent wrong answer); before, stage 1 fails making an integer tensor it is
# handed require grad (measured on 2.10, 2.11 and 2.12).
HF_TIED_RUNS = at_least(VERSION, "2.13")
HF_TIED_CRASH = "RuntimeError: only Tensors of floating point dtype can require gradients"

# Llama and Mixtral under pipeline(), keyed by the transformers release: up to 5.23 their rotary embedding's
# forward is @torch.no_grad(); torch outlines that no_grad region into a submodule and calls it without its
# inputs, and how it fails depends on the torch release (ROTARY, below). transformers 5.24 dropped the
# decorator (every 5.x up to 5.23.0 has it; 5.23.0 and 5.24.0 measured, adjacent releases): torch traces the
# rotary embedding inline and meets Llama and Mixtral as it meets GPT-2 and BERT (HF_TIED_RUNS): from 2.13
# it leaves Llama's tied embedding unsynchronised (tiny config, tie_word_embeddings=True) and matches eager
# on Mixtral (untied); before 2.13 stage 1 fails with HF_TIED_CRASH (measured on 2.10).
TRANSFORMERS = (Version(importlib.metadata.version("transformers")) if importlib.util.find_spec("transformers")
                else None)
ROTARY_NO_GRAD = TRANSFORMERS is None or TRANSFORMERS < Version("5.24")
# Up to 2.12 it fails in pipeline() itself, before any stage is built (stage None); on 2.10 with a bare assert.
ROTARY = ("RuntimeError: Expected positional argument for parameter" if at_least(VERSION, "2.13")
          else "AssertionError: unexpected placeholder node" if at_least(VERSION, "2.11")
          else "AssertionError")
ROTARY_STAGE = 0 if at_least(VERSION, "2.13") else None
