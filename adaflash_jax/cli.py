"""Bad input ends a command-line main with one line naming the problem, never a traceback.

    with one_line_errors():
        run(args)

Bad input is: a config that fails validation, a checkpoint or export that does not match
its config (missing tensor, wrong shape), a truncated or malformed safetensors file, a
missing file, or JSON that does not parse. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import contextlib
import json


def bad_input_errors() -> tuple[type[BaseException], ...]:
    from adaflash_jax.io.safetensors_io import SafetensorsError
    from adaflash_jax.model.checkpoint import CheckpointError
    from adaflash_jax.model.config import ConfigError

    return (
        ConfigError,
        CheckpointError,
        SafetensorsError,
        FileNotFoundError,
        NotADirectoryError,
        json.JSONDecodeError,
    )


@contextlib.contextmanager
def one_line_errors(prefix: str = "error", *extra: type[BaseException]):
    """Turns bad input (and the `extra` error types) into `SystemExit("prefix: message")`:
    Python prints that one line to stderr and exits with status 1."""
    caught = bad_input_errors() + extra
    try:
        yield
    except caught as e:
        message = " ".join(str(e).split()) or type(e).__name__
        raise SystemExit(f"{prefix}: {message}") from None
