"""What torch.distributed.pipelining does on the installed torch, where it differs by release: the
expectations of the tests that pin torch's behaviour, keyed by the release ranges measured
(docs/torch-versions.md has the whole table, from ``nox -s matrix``)."""

from __future__ import annotations

import importlib.metadata
import importlib.util

import torch
from packaging.version import Version

from pipecheck._torch_versions import at_least

VERSION = torch.__version__

# A skip connection's backward: torch up to 2.11 asserts (a built-in error, shown with its type); from
# 2.12 it raises its own PipeliningMetadataError (shown by its message alone).
SKIP = ("" if at_least(VERSION, "2.12") else "AssertionError: ") + "Backward of skip connections not supported yet"

# GPT-2 and BERT (hf_gpt2, hf_bert) under pipeline(): from 2.13 torch runs them and leaves the tied word
# embedding unsynchronised (a silent wrong answer); before, stage 1 fails making an integer tensor it is
# handed require grad (measured on 2.10, 2.11 and 2.12).
HF_TIED_RUNS = at_least(VERSION, "2.13")
HF_TIED_CRASH = "RuntimeError: only Tensors of floating point dtype can require gradients"

# Llama and Mixtral under pipeline(): the rotary embedding, computed under no_grad, is outlined into a
# submodule and called without its inputs; how torch fails on it depends on the release. transformers
# 5.24 dropped the rotary embedding's @torch.no_grad() (measured: 5.23.0 outlines it, 5.24.0 does not);
# torch then runs both models and, as for GPT-2 and BERT, leaves their tied embedding unsynchronised.
ROTARY_OUTLINED = Version(importlib.metadata.version("transformers")) < Version("5.24") if importlib.util.find_spec(
    "transformers") else True
# Up to 2.12 it fails in pipeline() itself, before any stage is built (stage None); on 2.10 with a bare assert.
ROTARY = ("RuntimeError: Expected positional argument for parameter" if at_least(VERSION, "2.13")
          else "AssertionError: unexpected placeholder node" if at_least(VERSION, "2.11")
          else "AssertionError")
ROTARY_STAGE = 0 if at_least(VERSION, "2.13") else None
