"""Cut markers: ``pipe_split()`` in a model's forward and ``SplitPoint`` for split specs.

    class Model(nn.Module):
        def forward(self, x):
            x = self.block0(x)
            pipecheck.pipe_split()      # stage 0 ends here
            return self.block1(x)

Run eagerly, ``pipe_split()`` does nothing. Traced with ``torch.fx`` it becomes a
leaf call; traced with ``torch.export`` it becomes the custom op
``pipecheck::pipe_split``, which export keeps because it is marked
side-effectful.
"""

from __future__ import annotations

import contextlib
import enum
import sys
from collections.abc import Iterator

import torch
import torch.fx as fx
from torch.fx.node import _side_effectful_functions

torch.library.define("pipecheck::pipe_split", "() -> ()")


@torch.library.impl("pipecheck::pipe_split", "CompositeExplicitAutograd")
def _pipe_split_impl() -> None:
    return None


@torch.library.register_fake("pipecheck::pipe_split")
def _pipe_split_fake() -> None:
    return None


PIPE_SPLIT_OP = torch.ops.pipecheck.pipe_split.default
_side_effectful_functions.add(PIPE_SPLIT_OP)


# The fx tracer currently tracing, set by pipecheck's own tracer only. fx.wrap
# cannot be used: it patches the globals of the defining module, and users call
# ``pc.pipe_split()`` through their own namespace.
_active_fx_tracer: list[fx.Tracer] = []


def pipe_split() -> None:
    """Mark a stage boundary in ``forward``; a no-op when the model runs eagerly."""
    if _active_fx_tracer:
        _active_fx_tracer[-1].create_proxy("call_function", pipe_split, (), {})
    elif torch.compiler.is_compiling():
        torch.ops.pipecheck.pipe_split()


class SplitPoint(enum.Enum):
    """Where a cut goes relative to the module named in a ``split_spec``."""

    BEGINNING = "BEGINNING"
    END = "END"


# torch.distributed.pipelining's own ``pipe_split()``, which a model marked for torch's pipeline()
# calls: it runs ``torch.ops.pippy._pipe_split()``, an op registered when torch.distributed.pipelining
# is imported (the splitter itself imports nothing of torch.distributed).
TORCH_PIPE_SPLIT_MODULE = "torch.distributed.pipelining._IR"


@contextlib.contextmanager
def torch_markers_recorded() -> Iterator[None]:
    """While pipecheck's fx tracer runs, torch's ``pipe_split()`` records a cut as pipecheck's does
    (fx records no call without a traced argument, and torch's marker has none)."""
    if TORCH_PIPE_SPLIT_MODULE not in sys.modules:
        yield
        return
    namespace = torch.ops.pippy
    original = getattr(namespace, "_pipe_split")  # noqa: B009 - the op exists only at run time
    setattr(namespace, "_pipe_split", pipe_split)  # noqa: B010
    try:
        yield
    finally:
        setattr(namespace, "_pipe_split", original)  # noqa: B010


def is_marker(node: fx.Node) -> bool:
    """True for the node a ``pipe_split()`` call becomes under either tracer: pipecheck's, or
    torch.distributed.pipelining's (recorded as pipecheck's under fx, the ``pippy::_pipe_split`` op
    under export)."""
    if node.op != "call_function":
        return False
    if node.target in (pipe_split, PIPE_SPLIT_OP):
        return True
    return isinstance(node.target, torch._ops.OpOverload) and node.target.name() == "pippy::_pipe_split"
