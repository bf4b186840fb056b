"""Check a model through Megatron Core's pipeline schedules, with Megatron's own settings.

    from pipecheck.engines import megatron as pcm

    report = pcm.check(make_model, (tokens,), loss_fn=lm_loss, target=labels, n_microbatches=4)
    report = pcm.check(make_model, (tokens,), schedule="interleaved", stages_per_rank=2,
                       batch_p2p_comm=False)                      # a TransformerConfig knob
    pc.assert_equivalent(model, (x,), runner=pcm.MegatronRunner(overlap_p2p_comm=True), ...)
    report = pcm.check_chunks(model_provider, tokens, num_stages=2, loss_fn=lm_loss, target=labels)  # your chunks

pipecheck's split runs as Megatron model chunks through ``forward_backward_func`` and
``finalize_model_grads`` on pipecheck's World (CPU and gloo, or ``device="cuda"`` with one GPU per
rank and NCCL); ``runner="megatron"`` is the same with
Megatron Core's defaults. Needs ``pip install "torch-pipecheck[megatron]"`` (megatron-core 0.16).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pipecheck._check.equivalence import assert_equivalent
from pipecheck._check.numerics import ToleranceLike
from pipecheck._check.report import Report
from pipecheck._runners.megatron.chunks import MegatronChunksRunner, chunk_list_factory
from pipecheck._runners.megatron.driver import MegatronRunner
from pipecheck._split.inputs import detached_batch
from pipecheck.losses import LossFn

if TYPE_CHECKING:
    from pipecheck._world.world import World

__all__ = ["MegatronRunner", "check", "check_chunks"]


def check(model: Any, args: Sequence[Any] | Any, kwargs: Mapping[str, Any] | None = None, *,
          split_spec: Mapping[str, Any] | None = None, policy: Any = None, loss_fn: LossFn | None = None,
          target: Any = None, n_microbatches: int = 1, schedule: str = "1f1b", stages_per_rank: int = 1,
          tolerance: ToleranceLike = "auto", seed: int = 0, device: str | None = None, world: World | None = None,
          timeout: float | None = None, **megatron_config: Any) -> Report:
    """One training step of ``model``, cut as pipecheck cuts it (markers, ``split_spec`` or ``policy``),
    through Megatron Core's 1F1B (``schedule="1f1b"``) or interleaved schedule, compared with the
    model run eagerly. ``megatron_config``: Megatron's ``TransformerConfig`` knobs (``batch_p2p_comm``,
    ``overlap_p2p_comm``, ...); the rest are Megatron's defaults."""
    return assert_equivalent(model, args, kwargs, split_spec=split_spec, policy=policy, loss_fn=loss_fn,
                             target=target, n_microbatches=n_microbatches, schedule=schedule,
                             stages_per_rank=stages_per_rank, runner=MegatronRunner(**megatron_config),
                             tolerance=tolerance, seed=seed, device=device, world=world, timeout=timeout)


def check_chunks(model_provider: Callable[..., Any], inputs: Any, *, num_stages: int, loss_fn: LossFn | None = None,
                 target: Any = None, n_microbatches: int = 1, schedule: str = "1f1b", stages_per_rank: int = 1,
                 tolerance: ToleranceLike = "auto", seed: int = 0, device: str | None = None,
                 world: World | None = None, timeout: float | None = None, **megatron_config: Any) -> Report:
    """One training step of your own Megatron model chunks through Megatron Core's schedule, compared
    with the same chunks run one after another in this process.

    ``model_provider(pre_process, post_process)`` (and ``vp_stage`` for ``schedule="interleaved"``)
    builds one chunk, as Megatron's ``get_model`` calls it: a module that takes the previous chunk's
    output through ``set_input_tensor`` and ``inputs`` (a tensor or a tuple, split on dim 0 into
    ``n_microbatches``) as its arguments, and sends ``[seq, batch, hidden]`` hidden states. On the
    ranks each chunk is built after Megatron's ``parallel_state`` is set up, wrapped in Megatron's
    ``DistributedDataParallel``, run by ``forward_backward_func`` and ``finalize_model_grads``. The
    provider must be importable (a top-level function) and build its chunk from its arguments alone
    (pipecheck also builds every chunk in this process, where Megatron's process groups do not
    exist). Parameters are named ``"<stage>.<the chunk's name>"``; a word embedding tied between the
    first and the last chunk (``share_embeddings_and_output_weights``) is one parameter of the
    reference, named as the first chunk names it.
    """
    runner = MegatronChunksRunner(model_provider, num_stages, stages_per_rank, **megatron_config)
    inputs = detached_batch(inputs)
    return assert_equivalent(chunk_list_factory(model_provider, num_stages, stages_per_rank),
                             inputs if isinstance(inputs, tuple) else (inputs,),
                             loss_fn=loss_fn, target=target, n_microbatches=n_microbatches, schedule=schedule,
                             stages_per_rank=stages_per_rank, runner=runner, tolerance=tolerance, seed=seed,
                             device=device, world=world, timeout=timeout, tracer="fx")
