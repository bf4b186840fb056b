"""A real-size check on one GPU: a HuggingFace Llama of 0.87B parameters, time and peak memory against its step.

    python benchmarks/bench_real_gpu.py [--rounds 3] [--write]      # on a machine with a CUDA GPU
    python benchmarks/bench_real_gpu.py --device cpu --small          # the script itself, on a small Llama

The model (issue 34): ``LlamaForCausalLM`` with 16 layers, hidden size 2048, 16 heads, MLP 5504, vocab
32000, tied embeddings, ``use_cache=False`` (0.87B parameters), built by a plain zero-argument factory;
batch 8 of sequence 512, cut in two (``model.layers.8``), 4 micro-batches, its own loss (``labels``),
``runner="reference"``, ``device="cuda"``. Measured in one process, alternating: the eager micro-batched
step alone (the model built beforehand: every micro-batch's forward and loss, then the mean's backward),
the first check (its split included) and warm checks; and the peak allocated CUDA memory of the eager
step (the model's build included: parameters, gradients, activations) against a check's (its build
included), and a second check's. Targets: a warm check <= 3x the eager step; its peak <= 1.5x the step's;
the second check's peak no higher than the first's. With --write the result replaces this benchmark's
section of benchmarks/RESULTS.md; without a GPU the section says so and nothing is measured.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from pathlib import Path

import torch

import pipecheck as pc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import machine, write_section  # noqa: E402
from bench_check import _peak, _timed  # noqa: E402

HEADING = "Real size on one GPU (Llama 0.87B)"
MICROBATCHES = 4


def llama(small: bool) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    size = dict(hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
                vocab_size=512) if small else dict(hidden_size=2048, intermediate_size=5504, num_hidden_layers=16,
                                                   num_attention_heads=16, vocab_size=32000)
    config = LlamaConfig(**size, max_position_embeddings=512, tie_word_embeddings=True, use_cache=False)
    return LlamaForCausalLM(config)


def eager_step(model: torch.nn.Module, ids: torch.Tensor) -> None:
    losses = [model(chunk, labels=chunk).loss for chunk in ids.chunk(MICROBATCHES)]
    torch.stack(losses).mean().backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="a 2-layer Llama (the script itself, anywhere)")
    parser.add_argument("--write", action="store_true")
    opts = parser.parse_args()
    if opts.device == "cuda" and not torch.cuda.is_available():
        text = (f"Not measured: no CUDA GPU on this machine ({machine()}). Run `python benchmarks/bench_real_gpu.py "
                "--rounds 3 --write` on one.")
        print(text)
        if opts.write:
            write_section(HEADING, text)
        return
    factory = functools.partial(llama, opts.small)
    batch, seq = (8, 512) if not opts.small else (8, 64)
    vocab = 512 if opts.small else 32000
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0)).to(opts.device)
    split_spec = {f"model.layers.{1 if opts.small else 8}": pc.SplitPoint.BEGINNING}

    def check() -> pc.Report:
        return pc.assert_equivalent(factory, (ids,), {"labels": ids}, loss_fn=pc.losses.model_loss,
                                    split_spec=split_spec, n_microbatches=MICROBATCHES, runner="reference",
                                    device=opts.device)

    def built_and_stepped() -> None:
        eager_step(pc.ModelFactory(factory, device=opts.device)(), ids)

    peak_eager = _peak(built_and_stepped, opts.device)
    first: list[pc.Report] = []
    first_s = _timed(lambda: first.append(check()), opts.device)
    peak_first = _peak(check, opts.device)
    peak_second = _peak(check, opts.device)
    model = pc.ModelFactory(factory, device=opts.device)()
    params = sum(p.numel() for p in model.parameters())
    eager_step(model, ids)  # warm-up
    steps, checks = [], []
    reports: list[pc.Report] = []
    for _ in range(opts.rounds):
        model.zero_grad(set_to_none=True)
        steps.append(_timed(lambda: eager_step(model, ids), opts.device))
        checks.append(_timed(lambda: reports.append(check()), opts.device))
    timings = [report.timings for report in reports]
    step, warm = statistics.median(steps), statistics.median(checks)
    device = torch.cuda.get_device_name() if opts.device == "cuda" else "CPU"
    phases = sorted({k for t in timings for k in t})
    lines = [
        f"Command: `python benchmarks/bench_real_gpu.py --device {opts.device} --rounds {opts.rounds}"
        f"{' --small' if opts.small else ''}`  ",
        f"Machine: {machine()}; device: {device}", "",
        f"LlamaForCausalLM, {params / 1e9:.2f}B parameters, batch {batch} x {seq}, {MICROBATCHES} micro-batches, cut "
        f"in two, its own loss, runner reference. Medians of {opts.rounds} rounds, eager step and check alternating.",
        "", "| | time (s) | / eager step |", "| --- | --- | --- |",
        f"| eager micro-batched step | {step:.3f} | 1.00 |",
        f"| first check (split included) | {first_s:.3f} | {first_s / step:.1f} |",
        f"| warm check | {warm:.3f} | {warm / step:.1f} (target <= 3: {'met' if warm <= 3 * step else 'NOT met'}) |",
        "", "Where a warm check's time goes (`Report.timings`, medians, s): "
        + ", ".join(f"{name} {statistics.median([t.get(name, 0.0) for t in timings]):.3f}" for name in phases)]
    if opts.device == "cuda":
        ratio = peak_first / max(peak_eager, 1)
        lines += ["", f"Peak allocated CUDA memory, the build included: eager step {peak_eager / 2**30:.1f} GiB, "
                      f"check {peak_first / 2**30:.1f} GiB ({ratio:.2f}x; target <= 1.5: "
                      f"{'met' if ratio <= 1.5 else 'NOT met'}), the same check again {peak_second / 2**30:.1f} GiB."]
    text = "\n".join(lines)
    print(text)
    if opts.write:
        write_section(HEADING, text)


if __name__ == "__main__":
    main()
