"""What every rank of a torchrun launch runs (tests/world/test_torchrun.py starts it as two "nodes").

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
             --rdzv-id ID tests/_torchrun_check.py [model:schedule[:stages_per_rank] ...]

Every rank runs this whole file: it joins the launched world with ``World.from_env()`` and calls
``assert_equivalent`` with it. Each rank computes the eager and fp64 references itself, runs its own
stages, and receives every rank's results, so every rank holds the whole report. Each rank prints one
``RANK <rank> <model>:<schedule> MATCH|MISMATCH`` line per check; the rank that is global rank 0 also
prints the reports. The exit code is 0 when every check matched.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
from pipecheck.fixtures import get

import pipecheck as pc

# 4-stage zoo models on the 4 ranks of two 2-process nodes: a tied weight in stages 0 and 3 (its gradients
# all-reduced across the nodes), and a skip connection from stage 0 to stage 3 under the zero-bubble schedule
CHECKS = ("tiny_gpt:1f1b", "long_skip:zb")


def main(checks: list[str]) -> int:
    warnings.simplefilter("ignore", FutureWarning)
    torch.set_num_threads(1)
    world = pc.World.from_env(device="cpu", timeout=120)
    rank = int(os.environ["RANK"])
    failed = 0
    for check in checks:
        name, schedule, *per_rank = check.split(":")
        entry = get(name)
        style = entry.cut_styles[0]
        args, kwargs = entry.inputs()
        try:
            report = pc.assert_equivalent(
                entry.factory(style), args, kwargs, runner="distributed", schedule=schedule, n_microbatches=4,
                stages_per_rank=int(per_rank[0]) if per_rank else 1, loss_fn=entry.loss_fn, target=entry.target(),
                world=world, **entry.cut(style))
            status, text = "MATCH", str(report)
        except pc.EquivalenceError as err:
            status, text, failed = "MISMATCH", str(err), failed + 1
        # one write each: the ranks share stdout, and print() writes a line in pieces another rank's
        # line can land between (seen on torch 2.15)
        os.write(1, f"RANK {rank} {check} {status}\n".encode())
        if rank == 0:
            os.write(1, f"{text}\n".encode())
    world.close()
    return 1 if failed else 0


if __name__ == "__main__":
    # arguments starting with "--" only tag the process (the test finds its ranks by them)
    sys.exit(main([arg for arg in sys.argv[1:] if not arg.startswith("--")] or list(CHECKS)))
