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

import enum

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


def is_marker(node: fx.Node) -> bool:
    """True for the node a ``pipe_split()`` call becomes under either tracer."""
    return node.op == "call_function" and node.target in (pipe_split, PIPE_SPLIT_OP)
