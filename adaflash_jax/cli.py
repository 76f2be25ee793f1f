"""Every error a user can cause ends a command-line main as one line on stderr, never a
traceback, with an exit status that says whose move it is:

    def main(argv=None) -> int:
        args = parse(argv)
        return exit_status(run, args)      # or: with one_line_errors(): run(args)

Exit status:
- 0: done.
- 1, bad data: a file the command reads is malformed; fix the file. CheckpointError,
  SafetensorsError, TokenizerError, PromptError, CostError, JSONDecodeError.
- 2, usage or config: the command line or a config asks for what cannot be; fix the flags
  or the config. ConfigError, PolicyError, EngineError, GenerateError, BenchError,
  CorpusError; a path that names nothing (FileNotFoundError, NotADirectoryError,
  IsADirectoryError), cannot be read (PermissionError) or would be overwritten
  (FileExistsError); argparse's own usage errors (`int_list` for comma lists of integers).
- 3, stopped: the run itself failed, not its input; resume or rerun. NonFiniteError,
  StorageError, a lost peer process (`train.mesh.exit_on_peer_loss`).

The rule: 1 when the fix is to the bytes of a file (a truncated safetensors, a prompt line
that is not JSON, a tokenizer.json that does not parse, a cost table without the rows
asked for); 2 when the fix is to what the user typed, on the command line or in a config: a
setting out of range, a path that is not there, a drafter that does not fit its target.
ConfigError is 2 even where it names a model's config.json: a config is what it is about.
A CLI may add statuses of its own (`plan` and `tpu_compile`: 1 when the plan does not fit;
`distill`: 143 when preempted) and, through `also`, plain errors its library still raises
for a bad flag (`tpu_compile`: ValueError).

`EXIT_CODES` is the one registry, keyed by qualified class name (so no library module is
imported to check an exception: one that exists was imported) and matched along the
exception's MRO, so a subclass inherits its base's status. Anything not in it is a bug and
keeps its traceback. `tests/test_cli_errors.py` fails when a module under adaflash_jax/
defines an exception class that is neither here nor in its list of errors that are not the
user's (Preempted: a signal, handled by distill itself).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
from collections.abc import Callable, Mapping

BAD_DATA, USAGE, STOPPED = 1, 2, 3

EXIT_CODES: dict[str, int] = {
    # 1: a file whose contents are wrong
    "adaflash_jax.model.checkpoint.CheckpointError": BAD_DATA,  # tensor missing / wrong shape
    "adaflash_jax.io.safetensors_io.SafetensorsError": BAD_DATA,  # truncated, malformed
    "adaflash_jax.tokenizer.TokenizerError": BAD_DATA,  # tokenizer files, chat template
    "adaflash_jax.distill.prompts.PromptError": BAD_DATA,  # prompt files and records
    "json.decoder.JSONDecodeError": BAD_DATA,
    "adaflash_jax.bench.cost_model.CostError": BAD_DATA,  # cost / trace files short of costs
    # 2: the command line or a config
    "adaflash_jax.model.hf_fields.ConfigError": USAGE,  # run configs, model config.json
    "adaflash_jax.decode.policy.PolicyError": USAGE,  # --policy and its options
    "adaflash_jax.decode.slots.EngineError": USAGE,  # engine settings, requests
    "adaflash_jax.decode.generate.GenerateError": USAGE,  # generate's requests, sampling
    "adaflash_jax.bench.methods.BenchError": USAGE,  # benchmark settings and inputs
    "adaflash_jax.data.corpus.CorpusError": USAGE,  # a corpus config too small for its use
    "builtins.FileNotFoundError": USAGE,
    "builtins.NotADirectoryError": USAGE,
    "builtins.IsADirectoryError": USAGE,
    "builtins.PermissionError": USAGE,
    "builtins.FileExistsError": USAGE,  # an output that is there already (no --resume)
    # 3: the run stopped
    "adaflash_jax.train.optimizer.NonFiniteError": STOPPED,  # loss or gradients NaN / Inf
    "adaflash_jax.io.fs.StorageError": STOPPED,  # a remote write that kept failing
}


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def exit_code(error: BaseException, also: Mapping[type, int] | None = None) -> int | None:
    """The exit status `error` ends a command with (the registry's, else `also`'s), or None:
    not the user's doing (a bug)."""
    for cls in type(error).__mro__:
        if (code := EXIT_CODES.get(qualified_name(cls))) is not None:
            return code
    for cls in type(error).__mro__:
        if also and (code := also.get(cls)) is not None:
            return code
    return None


def registered_errors() -> dict[type[BaseException], int]:
    """The registry with its names resolved to the classes (imports their modules)."""
    out = {}
    for name, code in EXIT_CODES.items():
        module, _, cls = name.rpartition(".")
        out[getattr(importlib.import_module(module), cls)] = code
    return out


def bad_input_errors() -> tuple[type[BaseException], ...]:
    """The errors bad input may raise (status 1 or 2): what a reader of user files may raise."""
    return tuple(c for c, code in registered_errors().items() if code in (BAD_DATA, USAGE))


class CommandError(SystemExit):
    """What `one_line_errors` raises: `code` is the exit status, str() the line it printed."""

    def __init__(self, line: str, code: int):
        super().__init__(code)
        self.line = line

    def __str__(self) -> str:
        return self.line


@contextlib.contextmanager
def one_line_errors(prefix: str = "error", also: Mapping[type, int] | None = None):
    """A registered error (or one of `also`: class → status) becomes one line, `prefix:
    message` (`stopped: message` for status 3) with the message's whitespace collapsed,
    printed to stderr; then `CommandError` (a SystemExit with that status). Anything else
    propagates untouched."""
    try:
        yield
    except Exception as e:
        code = exit_code(e, also)
        if code is None:
            raise
        message = " ".join(str(e).split()) or type(e).__name__
        line = f"{'stopped' if code == STOPPED else prefix}: {message}"
        sys.stdout.flush()
        print(line, file=sys.stderr, flush=True)
        raise CommandError(line, code) from None


def exit_status(
    fn: Callable[..., int | None], *args, prefix: str = "error", also: Mapping | None = None
) -> int:
    """`fn(*args)` under `one_line_errors`, for mains that return their exit status: its
    result (None: 0), or the status of the error it raised (the line already printed)."""
    try:
        with one_line_errors(prefix, also):
            status = fn(*args)
    except CommandError as e:
        return e.code
    return 0 if status is None else status


def int_list(text: str) -> tuple[int, ...]:
    """argparse `type=` for comma-separated integers ("1,2,3" → (1, 2, 3); empty items are
    skipped): anything else is argparse's usage error (status 2) naming the flag and value."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def tree_shape(text: str):
    """argparse `type=` for a draft tree, TOPKxNODES (`decode.tree.TreeShape.parse`)."""
    from adaflash_jax.decode.tree import TreeShape

    try:
        return TreeShape.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
