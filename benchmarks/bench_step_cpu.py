"""Where a 1F1B step's CPU time goes on CPU ranks, and what gloo's transport costs.

    python benchmarks/bench_step_cpu.py [--steps 30] [--rounds 5]

The step of bench_runtime.py (b): a 4-stage MLP (width 512, batch 64), 8 micro-batches, 4 gloo ranks on
this machine's cores. In each round, alternating on one World: pipecheck's 1F1B, torch's Schedule1F1B,
and, as an experiment only, pipecheck's 1F1B with its tensors passed through shared memory (a slot per
message, a futex to wake the receiver) where it sends them through gloo. Per step: the wall time between
barriers (median of the steps, slowest rank), the CPU time of all ranks together (user, system), and the
part of it spent in gloo's socket threads (``gloo_tcp_loop``). Also the same model's eager micro-batched
step in this process on one thread: the compute every engine has to do.

The experiment is not pipecheck's runtime: SPEC.md asks for real torch.distributed (gloo on CPU). It
measures how much of the step is gloo's, and so what ratio against torch an engine on gloo can reach.
Results go to the "Runtime step on CPU: where the time goes" section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import mmap
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

import pipecheck as pc

# private: the runtime's step timed rank by rank, and its transport, replaced in the experiment
from pipecheck._runners.runtime.driver import plan_schedule, step_spec
from pipecheck._runtime import comm, executor
from pipecheck._runtime.executor import StageExecutor, StepSpec

try:
    import bench_runtime as runtime_bench
    from _results import machine, median, write_section
except ImportError:  # run as a module from the repo root
    from benchmarks import bench_runtime as runtime_bench
    from benchmarks._results import machine, median, write_section

BenchMLP, MICROBATCHES, SPEC, STAGES = runtime_bench.BenchMLP, runtime_bench.MICROBATCHES, runtime_bench.SPEC, \
    runtime_bench.STAGES

TICK = os.sysconf("SC_CLK_TCK")


def _gloo_thread_cpu() -> float:
    """CPU seconds (user + system) of this process's gloo socket threads so far."""
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as stat:
                text = stat.read()
        except OSError:
            continue
        name, fields = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()
        if name.startswith("gloo_tcp_loop"):
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / TICK


def _timed(step: Any, n_steps: int) -> dict[str, float]:
    """Median wall time of ``n_steps`` steps between barriers, and the CPU time they took, per step."""
    step()  # warm-up
    before, gloo_before = os.times(), _gloo_thread_cpu()
    walls = runtime_bench.step_walls(step, n_steps)
    after, gloo_after = os.times(), _gloo_thread_cpu()
    return {"wall": median(walls), "user": (after.user - before.user) / n_steps,
            "system": (after.system - before.system) / n_steps, "gloo": (gloo_after - gloo_before) / n_steps}


def pipecheck_steps(ctx: Any, plan: StepSpec, n_steps: int) -> dict[str, float]:
    return runtime_bench.pipecheck_steps(ctx, plan, n_steps, timed=_timed)


def torch_engine_steps(ctx: Any, n_steps: int) -> dict[str, float]:
    return runtime_bench.torch_steps(ctx, n_steps, timed=_timed)


# --- the experiment: tensors through shared memory ----------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_SYS_FUTEX = 202  # x86_64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_HEADER = 64  # seq (int32), ack (int32), padding


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_SLICE = _Timespec(0, 50_000_000)
_WAIT_S = 60.0  # a step takes ~0.1 s: a slot this late means a peer is gone


class _Slot:
    """One message's shared memory (the same tag every step): the sender bumps ``seq`` after writing,
    the receiver bumps ``ack`` after reading; each waits on the other's word with a futex."""

    def __init__(self, path: str, nbytes: int) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        if os.fstat(fd).st_size < _HEADER + nbytes:
            os.ftruncate(fd, _HEADER + nbytes)
        self.memory = mmap.mmap(fd, _HEADER + nbytes)
        os.close(fd)
        self.seq = ctypes.c_int32.from_buffer(self.memory, 0)
        self.ack = ctypes.c_int32.from_buffer(self.memory, 4)
        self.data = torch.frombuffer(self.memory, dtype=torch.uint8, count=nbytes, offset=_HEADER)
        self.sent = self.got = 0

    @staticmethod
    def wait(word: ctypes.c_int32, value: int) -> None:
        deadline = time.monotonic() + _WAIT_S
        while (now := word.value) != value:
            if time.monotonic() > deadline:
                raise TimeoutError(f"shared-memory slot: waited {_WAIT_S} s for {value}, still {now} (a peer "
                                   "that failed, or one that disagrees on the message)")
            _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(ctypes.addressof(word)), _FUTEX_WAIT, now,
                          ctypes.byref(_SLICE), None, 0)

    @staticmethod
    def wake(word: ctypes.c_int32) -> None:
        _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(ctypes.addressof(word)), _FUTEX_WAKE, 1, None, None, 0)


class _Received:
    def __init__(self, slot: _Slot, buffer: torch.Tensor) -> None:
        self.slot, self.buffer = slot, buffer

    def wait(self) -> bool:
        slot = self.slot
        slot.got += 1
        slot.wait(slot.seq, slot.got)
        self.buffer.view(-1).view(torch.uint8).copy_(slot.data)
        slot.ack.value = slot.got
        slot.wake(slot.ack)
        return True


class SharedMemoryLinks(comm.Links):
    """pipecheck's links with every tensor leaf through a shared-memory slot (layouts still via gloo)."""

    folder = ""
    slots: dict[str, _Slot] = {}

    def _slot(self, src: int, dst: int, tag: int, nbytes: int) -> _Slot:
        path = f"{self.folder}/{src}-{dst}-{tag}-{nbytes}"
        if path not in self.slots:
            self.slots[path] = _Slot(path, nbytes)
        return self.slots[path]

    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        if tag % comm.LEAF_SLOTS < 2:  # a layout's size or bytes
            return super()._isend(tensor, dst, tag)
        data = tensor.detach().contiguous().view(-1).view(torch.uint8)
        slot = self._slot(dist.get_rank(), dst, tag, data.numel())
        slot.wait(slot.ack, slot.sent)  # the last step's message on this slot was read
        slot.data.copy_(data)
        slot.sent += 1
        slot.seq.value = slot.sent
        slot.wake(slot.seq)

    def _irecv(self, posted: comm.Posted, shape: tuple[int, ...], dtype: torch.dtype, src: int, tag: int,
               channel: comm.Channel) -> None:
        buffer = torch.empty(shape, dtype=dtype)
        posted.works.append(_Received(self._slot(src, dist.get_rank(), tag, buffer.nbytes), buffer))
        posted.buffers.append(buffer)


@contextlib.contextmanager
def shared_memory(folder: str) -> Iterator[None]:
    """StageExecutors made inside pass their tensors through slots in ``folder`` (a new one each time: a
    slot's counters start at zero with its file)."""
    os.makedirs(folder, exist_ok=True)
    SharedMemoryLinks.folder = folder
    executor.Links = SharedMemoryLinks  # type: ignore[misc]
    try:
        yield
    finally:
        executor.Links = comm.Links  # type: ignore[misc]
        SharedMemoryLinks.slots.clear()


def shared_memory_steps(ctx: Any, plan: StepSpec, n_steps: int, folder: str) -> dict[str, float]:
    with shared_memory(folder):
        return pipecheck_steps(ctx, plan, n_steps)


def same_gradients(ctx: Any, plan: StepSpec, folder: str) -> bool:
    """The experiment's step gives pipecheck's gradients bit for bit (its numbers are of the same work)."""
    ours = StageExecutor(ctx, plan).run()
    with shared_memory(folder):
        shared = StageExecutor(ctx, plan).run()
    same_keys = {s: set(g) for s, g in ours.stage_grads.items()} == {s: set(g) for s, g in shared.stage_grads.items()}
    return bool(ours.stage_grads) and same_keys and all(
        torch.equal(grad, shared.stage_grads[s][fqn]) for s, grads in ours.stage_grads.items()
        for fqn, grad in grads.items()) and all(
        torch.equal(loss, shared.losses[mb]) for mb, loss in ours.losses.items())


# --- the compute alone ---------------------------------------------------------------------------

def eager_step_cpu(n_steps: int) -> float:
    """CPU seconds of one eager micro-batched step of the whole model, one thread, this process."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = BenchMLP()
    x, target = runtime_bench.bench_inputs()

    def step() -> None:
        for xm, tm in zip(x.chunk(MICROBATCHES), target.chunk(MICROBATCHES)):
            (runtime_bench._loss(model(xm), tm) / MICROBATCHES).backward()

    try:
        step()
        before = os.times()
        for _ in range(n_steps):
            step()
        after = os.times()
    finally:
        torch.set_num_threads(threads)
    return (after.user - before.user + after.system - before.system) / n_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    opts = parser.parse_args()
    if not (sys.platform.startswith("linux") and platform.machine() == "x86_64" and os.path.isdir("/dev/shm")):
        sys.exit("bench_step_cpu.py reads /proc and calls futex(2) directly: it runs on x86_64 Linux only.")
    x, target = runtime_bench.bench_inputs()
    job = pc.Job(model=pc.ModelFactory(BenchMLP), args=(x,), split_spec=SPEC, loss_fn=runtime_bench._loss, target=target,
                 n_microbatches=MICROBATCHES, schedule="1f1b")
    pipe = job.split()
    plan = step_spec(job, plan_schedule(job, pipe), pipe)
    engines = ("pipecheck", "torch", "shared memory")
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
    folder = tempfile.mkdtemp(prefix="pipecheck-bench-", dir="/dev/shm")
    try:
        with pc.World(STAGES, timeout=600) as world:
            same = all(world.run(same_gradients, plan, f"{folder}/check"))
            for round_ in range(opts.rounds):
                for name in engines:
                    if name == "pipecheck":
                        ranks = world.run(pipecheck_steps, plan, opts.steps)
                    elif name == "torch":
                        ranks = world.run(torch_engine_steps, opts.steps)
                    else:
                        ranks = world.run(shared_memory_steps, plan, opts.steps, f"{folder}/{round_}")
                    runs[name].append({"wall": max(r["wall"] for r in ranks),
                                       **{k: sum(r[k] for r in ranks) for k in ("user", "system", "gloo")}})
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    eager = eager_step_cpu(opts.steps)
    row = {name: {k: median([r[k] for r in rounds]) for k in ("wall", "user", "system", "gloo")}
           for name, rounds in runs.items()}
    ratios = {name: [a["wall"] / b["wall"] for a, b in zip(runs[name], runs["torch"])] for name in engines}
    cores = os.cpu_count()
    lines = [
        f"Command: `python benchmarks/bench_step_cpu.py --steps {opts.steps} --rounds {opts.rounds}`  ",
        f"Machine: {machine()}",
        "",
        f"The step of \"Runtime\" (b): 4-stage MLP, {MICROBATCHES} micro-batches, {STAGES} gloo ranks (one "
        f"intra-op thread each) on {cores} cores. Per step, medians over {opts.rounds} alternating rounds of "
        f"{opts.steps} steps: wall time (the median step, slowest rank), CPU time of all ranks together (each "
        "round's mean per step), and the part of it in gloo's socket threads (`gloo_tcp_loop`), ms. "
        "\"Shared memory\" is an experiment, not pipecheck's runtime: pipecheck's 1F1B with its tensors written to a shared-memory slot per message (a futex wakes "
        "the receiver) where it sends them through gloo; it gives pipecheck's gradients bit for bit "
        f"({'checked' if same else 'NOT the same: the numbers below do not compare'}).",
        "",
        "| engine | wall | CPU user | CPU system | of which gloo threads | wall / torch's (per round) |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
        *[f"| {name} | {row[name]['wall'] * 1e3:.1f} | {row[name]['user'] * 1e3:.1f} | "
          f"{row[name]['system'] * 1e3:.1f} | {row[name]['gloo'] * 1e3:.1f} | "
          f"{median(ratios[name]):.2f} ({', '.join(f'{r:.2f}' for r in ratios[name])}) |" for name in engines],
        "",
        f"The compute every engine does (the eager micro-batched step of the whole model, one thread, one "
        f"process): {eager * 1e3:.1f} ms of CPU per step, {eager / cores * 1e3:.1f} ms of wall time on {cores} "
        "cores at best. What gloo's transport costs pipecheck's step (pipecheck against the experiment): "
        f"{(row['pipecheck']['wall'] - row['shared memory']['wall']) * 1e3:.1f} ms of "
        f"{row['pipecheck']['wall'] * 1e3:.1f} ms.",
    ]
    write_section("Runtime step on CPU: where the time goes", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
