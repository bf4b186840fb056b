"""The command line's options: the user's code loaded by ``package.module:function``, and each
option's value checked and converted (every problem a :class:`UsageError` naming the fix).

    factory = UserFactory(load_object("my_models:make_model", "the model factory"), "my_models:make_model")
    name, runner = runner_option("distributed")      # or a user's Runner: ("my_runner", <function>)
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipecheck._runners import registry
from pipecheck.errors import InputError, PipecheckError, UsageError, first_line

# Every built-in runner whose engine is installed (found without importing it): pipecheck._runners.registry
RUNNERS = tuple(registry.available())


def runners_help() -> str:
    """Every built-in runner of the registry, for ``--help``; those whose engine is not installed here
    say how to install it."""
    missing = [name for name in registry.RUNNERS if name not in RUNNERS]
    names = ", ".join(registry.RUNNERS)
    return names + (f" ({', '.join(missing)}: not installed here; {registry.install_command('NAME')})"
                    if missing else "")
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16", "float64": "float64"}


def load_object(spec: str, what: str) -> Callable[..., Any]:
    """The callable named by ``pkg.module:function``, imported the way ``python -m`` would, or by
    ``path/to/file.py:function`` (:func:`module_of_file`)."""
    module_name, colon, attr = spec.rpartition(":")
    if not colon or not module_name or not attr:
        raise UsageError(f"{what} {spec!r} is not a module:function path. Fix: write it as "
                         "package.module:function or path/to/file.py:function, e.g. my_models:make_model.")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # the `pipecheck` script imports from here, as `python -m` does
    file = None
    if module_name.endswith(".py") or "/" in module_name or os.sep in module_name:
        file, module_name = module_of_file(module_name, attr, what)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is None or not module_name.startswith(err.name):
            raise UsageError(f"importing {module_name!r} for {what} failed: {err}. Fix: install what "
                             f"{module_name!r} imports.") from err
        top = module_name.split(".")[0]
        raise UsageError(f"cannot import {module_name!r} for {what}: {err}. Fix: run pipecheck in the "
                         f"directory that holds {top}.py (or the {top} package), give the file's path "
                         f"(path/to/{module_name.replace('.', '/')}.py:{attr}), or install it.") from None
    except Exception as err:
        first = first_line(err)
        raise UsageError(f"importing {module_name!r} for {what} raised {type(err).__name__}: {first}. Fix: "
                         f"make `python -c \"import {module_name}\"` work.") from err
    if file is not None and Path(module.__file__ or "").resolve() != file:
        raise UsageError(f"{what}: importing {file} as {module_name!r} gave {module.__file__}, another module of "
                         f"that name, already imported or earlier on sys.path. Fix: rename {file.name}.")
    value = getattr(module, attr, None)
    if value is None:
        close = difflib.get_close_matches(attr, [n for n in vars(module) if not n.startswith("_")], n=3)
        hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
        raise UsageError(f"module {module_name!r} has no attribute {attr!r} for {what}{hint}. Fix: name a "
                         f"function defined in {module_name!r}.")
    if not callable(value):
        raise UsageError(f"{what} {spec!r} is a {type(value).__name__}, not a function. Fix: name a function.")
    return value  # type: ignore[no-any-return]


def module_of_file(path_text: str, attr: str, what: str) -> tuple[Path, str]:
    """``(file, module name)`` of ``my_model.py`` or ``src/pkg/models.py``: the folder that holds it (or
    the top of its package: the highest folder with an ``__init__.py``) goes first on ``sys.path``, as
    ``python -m`` run from there would have it, and the ranks inherit that path."""
    path = Path(path_text).expanduser()
    if path.suffix != ".py":
        raise UsageError(f"{what} {path_text}:{attr} is neither a module (dots, no '/') nor a .py file. Fix: write "
                         f"package.module:{attr}, or the file's path ending in .py.")
    if not path.is_file():
        raise UsageError(f"{what} names the file {path_text}, which does not exist (looked from {os.getcwd()}). "
                         f"Fix: give the path of the .py file that defines {attr}, e.g. "
                         f"path/to/my_model.py:{attr}, or its module as package.module:{attr}.")
    file = path.resolve()
    parts, folder = [file.stem], file.parent
    while (folder / "__init__.py").is_file() and folder.parent != folder:
        parts.insert(0, folder.name)
        folder = folder.parent
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    return file, ".".join(parts)


@dataclasses.dataclass(frozen=True)
class UserFactory:
    """The user's model factory; what it raises is an InputError naming it (it travels to ranks)."""

    fn: Callable[[], Any]
    spec: str

    def __call__(self) -> Any:
        try:
            return self.fn()
        except PipecheckError:
            raise
        except Exception as err:
            first = first_line(err)
            raise InputError(f"the model factory {self.spec} raised {type(err).__name__}: {first}. Fix: make "
                             f"{self.spec.split(':')[-1]}() build the model with no arguments.") from err


def call_inputs(args: argparse.Namespace) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if args.input_shape:
        try:
            shape = [int(d) for d in args.input_shape.split(",")]
        except ValueError:
            shape = []
        if not shape or min(shape) < 1:
            raise UsageError(f"--input-shape {args.input_shape!r} is not a shape. Fix: give positive sizes "
                             "separated by commas, e.g. --input-shape 8,16.")
        import torch

        return (torch.randn(*shape, generator=torch.Generator().manual_seed(args.seed)),), {}
    make = load_object(args.inputs, "--inputs")
    try:
        made = make()
    except PipecheckError:
        raise
    except Exception as err:
        raise InputError(f"--inputs {args.inputs} raised {type(err).__name__}: {err}. Fix: make it "
                         "return the model's inputs with no arguments.") from err
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[1], dict):
        return tuple(made[0]) if isinstance(made[0], (tuple, list)) else (made[0],), dict(made[1])
    return (made if isinstance(made, tuple) else (made,)), {}


def loss_options(args: argparse.Namespace) -> dict[str, Any]:
    """``loss_fn=`` and ``target=`` of ``check`` from ``--loss`` and ``--target``."""
    if args.target and not args.loss:
        raise UsageError("--target was given without --loss. Fix: add --loss package.module:function "
                         "(loss_fn(outputs, target) -> scalar), or drop --target for the default loss.")
    if not args.loss:
        return {}
    options: dict[str, Any] = {"loss_fn": load_object(args.loss, "--loss")}
    if args.target:
        make = load_object(args.target, "--target")
        try:
            options["target"] = make()
        except PipecheckError:
            raise
        except Exception as err:
            raise InputError(f"--target {args.target} raised {type(err).__name__}: {first_line(err)}. Fix: make it "
                             "return the target with no arguments.") from err
    return options


def runner_option(spec: str) -> tuple[str, Any]:
    """``(column name, runner)``: a built-in runner's name, or a user's Runner as pkg.module:function."""
    if ":" in spec:
        return spec.split(":")[-1], load_object(spec, "--runner")
    entry = registry.runner_named(spec)
    if entry is not None and entry.name not in RUNNERS:  # a known engine, not installed here
        entry.load()  # raises the InputError that names the pip command
    if entry is None:
        close = difflib.get_close_matches(spec, list(registry.RUNNERS), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise UsageError(f"runner {spec!r} is not one of {', '.join(registry.RUNNERS)}.{hint} Fix: name a built-in "
                         "runner, or your own Runner as package.module:function.")
    return spec, spec


def device_option(name: str) -> str:
    if name == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError(f"--device cuda needs CUDA, but torch.cuda.is_available() is False (torch "
                             f"{torch.__version__}, CUDA build {torch.version.cuda}). Fix: use --device cpu, "
                             "or run on a machine with a GPU and a CUDA build of torch.")
    return name


def schedule_option(name: str) -> str:
    """A schedule pipecheck's runtime or runner='torch' knows (names only: torch is not imported)."""
    from pipecheck._schedule.names import schedule_named
    from pipecheck.schedules import SCHEDULE_NAMES

    if schedule_named(name) is None:
        raise argparse.ArgumentTypeError(f"invalid choice: {name!r} (choose from {', '.join(SCHEDULE_NAMES)}; "
                                         "runner torch also interleaved_zb, dualpipev and torch's class names)")
    return name


def dtype_option(name: str) -> Any:
    import torch

    return getattr(torch, DTYPES[name])


def at_least(minimum: int, why: str = "") -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}{why}, got {value}")
        return value

    return parse


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {text}")
    return value


def split_point(text: str) -> tuple[str, str]:
    fqn, equals, point = text.partition("=")
    if not equals or not fqn or point.upper() not in ("BEGINNING", "END"):
        raise argparse.ArgumentTypeError(f"{text!r} is not FQN=BEGINNING or FQN=END (e.g. layers.2=BEGINNING)")
    return fqn, point.upper()
