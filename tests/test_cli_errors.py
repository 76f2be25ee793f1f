"""Every error a user can cause ends a CLI as one line (adaflash_jax/cli.py): each exception
class the package defines is registered with an exit status or listed here as not the
user's; every CLI runs under the wrapper; the CLIs, run as a user runs them, end a broken
prompt file, a record without a prompt and a malformed --prompt-ids with one line and the
registry's status. Also: `experiments.generate` renders prompts in the thinking mode a
drafter export records when --thinking is not given."""

from __future__ import annotations

import glob
import importlib
import inspect
import json
import os
import pkgutil
import subprocess
import sys

import pytest
from doubles import THINKING_TEMPLATE
from flax import nnx

import adaflash_jax
import experiments
from adaflash_jax import cli
from adaflash_jax.drafter.checkpoint import PROMPT_FORMAT_KEY, thinking_mode
from adaflash_jax.io.fs import StorageError
from adaflash_jax.model.checkpoint import save_target
from adaflash_jax.model.config import ConfigError
from adaflash_jax.model.presets import target_preset
from adaflash_jax.model.target import TargetLM
from adaflash_jax.tokenizer import Tokenizer, write_byte_tokenizer
from experiments import generate as generate_cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Exceptions the package defines that are not bad input, each with why and what handles it.
NOT_BAD_INPUT = {
    # SIGTERM during distillation: distill saves a checkpoint and exits 143 itself
    "adaflash_jax.distill.loop.Preempted",
}


def _defined_exceptions() -> set[str]:
    found = set()
    for package in (adaflash_jax, experiments):
        prefix = package.__name__ + "."
        for info in pkgutil.walk_packages(package.__path__, prefix):
            module = importlib.import_module(info.name)
            for obj in vars(module).values():
                if (
                    inspect.isclass(obj)
                    and issubclass(obj, Exception)
                    and obj.__module__ == module.__name__
                ):
                    found.add(cli.qualified_name(obj))
    return found


def test_every_exception_class_is_registered_or_declared_not_bad_input():
    defined = _defined_exceptions()
    assert "adaflash_jax.distill.prompts.PromptError" in defined  # the walk reaches them
    unhandled = defined - set(cli.EXIT_CODES) - NOT_BAD_INPUT
    assert not unhandled, f"give these an exit status in adaflash_jax/cli.py: {unhandled}"
    assert NOT_BAD_INPUT <= defined  # the list names real classes
    # every registry name resolves to an exception class (a typo would never match)
    resolved = cli.registered_errors()
    assert len(resolved) == len(cli.EXIT_CODES)
    assert all(issubclass(c, Exception) and code in (1, 2, 3) for c, code in resolved.items())


def test_every_cli_runs_under_the_wrapper_and_stays_short():
    paths = sorted(glob.glob(os.path.join(ROOT, "experiments", "*.py")))
    for path in paths:
        with open(path) as f:
            text = f.read()
        if "def main(" not in text:
            continue
        name = os.path.basename(path)
        assert "one_line_errors(" in text or "exit_status(" in text, name
        assert text.count("\n") <= 150, f"{name}: move logic into adaflash_jax/"


def test_status_follows_the_mro_and_unregistered_errors_keep_their_traceback(capsys):
    class Narrower(ConfigError):
        pass

    with pytest.raises(SystemExit) as e:
        with cli.one_line_errors():
            raise Narrower("bad\n   setting")
    assert e.value.code == 2 and str(e.value) == "error: bad setting"
    assert capsys.readouterr().err == "error: bad setting\n"
    assert cli.exit_status(lambda: (_ for _ in ()).throw(StorageError("gs:// down"))) == 3
    assert capsys.readouterr().err == "stopped: gs:// down\n"
    with pytest.raises(ValueError, match="a bug"):  # not registered: untouched
        with cli.one_line_errors():
            raise ValueError("a bug")
    assert cli.exit_status(lambda: 7) == 7 and cli.exit_status(lambda: None) == 0
    assert cli.exit_status(int, "x", also={ValueError: 2}) == 2  # a CLI's own addition
    assert cli.exit_code(json.JSONDecodeError("x", "", 0)) == 1
    assert cli.exit_code(FileNotFoundError("x")) == 2 and cli.exit_code(KeyError("x")) is None


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """Runs the three CLI commands at once (each stops before any model is built): distill
    on a prompt file with a line that is not JSON, on one with a record without a prompt
    key, and generate with --prompt-ids 1,a."""
    root = tmp_path_factory.mktemp("cli_errors")
    target = str(root / "target")
    vocab = write_byte_tokenizer(target)
    save_target(TargetLM(target_preset("test", vocab_size=vocab), rngs=nnx.Rngs(0)), target)
    files = {
        "good": '{"prompt": "a"}\n{"prompt": "b"}\n',
        "broken": '{"prompt": "a"}\n{"prompt": "b\n{"prompt": "c"}\n',
        "nokey": '{"prompt": "a"}\n{"text": "b"}\n',
    }
    for name, text in files.items():
        (root / f"{name}.jsonl").write_text(text)
    distill = [sys.executable, "-m", "experiments.distill", "--target", target, "--no-progress"]
    distill += ["--set", f"data.eval_prompts={root / 'good.jsonl'}"]
    distill += ["--set", "draft.target_layer_ids=(0, 1)"]  # the 2-layer target's
    commands = {
        name: [*distill, "--run-dir", str(root / name)]
        + ["--set", f"data.train_prompts={root / name}.jsonl"]
        for name in ("broken", "nokey")
    }
    commands["ids"] = [sys.executable, "-m", "experiments.generate", "--prompt-ids", "1,a"]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    procs = {
        name: subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for name, cmd in commands.items()
    }
    out = {}
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=300)
        out[name] = (proc.returncode, err)
    return root, out


def _last_line(err: str) -> str:
    assert "Traceback" not in err, err
    return err.strip().splitlines()[-1]


def test_distill_on_a_broken_jsonl_line_names_it_and_the_fix(cli_runs):
    root, out = cli_runs
    code, err = out["broken"]
    line = _last_line(err)
    assert code == 1, err
    assert line.startswith(f"error: {root / 'broken.jsonl'}: 1 broken lines (2; line 2: not JSON")
    assert line.endswith("--set data.max_bad_lines=1)")
    assert not (root / "broken").exists()  # refused before anything was written


def test_distill_on_a_record_without_a_prompt_names_the_keys(cli_runs):
    root, out = cli_runs
    code, err = out["nokey"]
    line = _last_line(err)
    assert code == 1, err
    assert "line 2: needs `prompt`, `messages` or `conversations`" in line
    assert "--set data.max_bad_lines=1" in line


def test_generate_with_malformed_prompt_ids_is_a_usage_error(cli_runs):
    _, out = cli_runs
    code, err = out["ids"]
    assert code == 2, err
    assert _last_line(err).endswith(
        "error: argument --prompt-ids: expected comma-separated integers, got '1,a'"
    )


def test_generate_renders_the_thinking_mode_the_export_records(tmp_path):
    """An export whose config.json records enable_thinking renders --chat prompts so when
    --thinking is not given; --thinking / --no-thinking still decide; an export without the
    key (a published drafter) or no drafter: off."""
    target = str(tmp_path / "target")
    write_byte_tokenizer(target, chat_template=THINKING_TEMPLATE)
    tok = Tokenizer(target)
    export, plain = tmp_path / "export", tmp_path / "published"
    for path, meta in ((export, {PROMPT_FORMAT_KEY: {"enable_thinking": True}}), (plain, {})):
        path.mkdir()
        (path / "config.json").write_text(json.dumps({"model_type": "qwen3", **meta}))
    assert thinking_mode(None, export) and not thinking_mode(None, plain)
    assert not thinking_mode(False, export) and thinking_mode(True, None)
    assert not thinking_mode(None, None) and not thinking_mode(None, tmp_path / "nowhere")

    def rendered(*flags):
        argv = ["--target", target, "--chat", "--prompt", "hi", *flags]
        return generate_cli.build_requests(generate_cli.parse_args(argv), tok)[0]

    on = tok.encode_chat([{"role": "user", "content": "hi"}], enable_thinking=True)
    off = tok.encode_chat([{"role": "user", "content": "hi"}], enable_thinking=False)
    assert on != off
    assert rendered("--drafter", str(export)) == on
    assert rendered("--drafter", str(export), "--no-thinking") == off
    assert rendered("--drafter", str(plain)) == off and rendered() == off
    assert rendered("--thinking") == on
