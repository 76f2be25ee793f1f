"""Distil an AdaFlash drafter: regenerate → stage 1 → head init → stage 2 → τ → export.

    python -m experiments.distill                                  # embedded tiny default
    python -m experiments.distill --config experiments/configs/small.py --set stage2.rounds=3
    python -m experiments.distill --target DIR --init-drafter DFLASH_DIR --run-dir runs/x

`--set a.b=v` overrides any config field (repeatable); the explicit flags are shorthands.
Re-running with the same --run-dir resumes, with the config it started with: another one is
refused, naming the fields, unless every change is declared safe (adaflash_jax/distill/
resume.py: eval.*, logging, checkpoint cadence, more stage-2 rounds where nothing follows
them) or --allow-config-change is given (recorded in <run-dir>/config_changes.jsonl).
SIGTERM saves a checkpoint and exits (code 143).
Every error ends as one line: status 2 for a bad flag or config, 1 for bad data (a prompt file
with more broken lines than data.max_bad_lines, a malformed checkpoint), 3 for a non-finite
stop, a storage fault or a lost peer process (multi-process runs); adaflash_jax/cli.py.
"""

from __future__ import annotations

import argparse
import os
import sys

DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "configs", "tiny.py")
FLAGS = {  # flag → config field
    "stage1_steps": "stage1.steps",
    "head_steps": "head_init.steps",
    "rounds": "stage2.rounds",
    "steps_per_round": "stage2.steps_per_round",
    "init_drafter": "draft.init_from",
    "target": "target_path",
    "mesh": "mesh",
    "seed": "seed",
}


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default=DEFAULT_CONFIG, help="a file defining get_config()")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    p.add_argument("--run-dir", default=None)
    p.add_argument("--stage1-steps", type=int)
    p.add_argument("--head-steps", type=int)
    p.add_argument("--rounds", type=int)
    p.add_argument("--steps-per-round", type=int)
    p.add_argument("--init-drafter", metavar="DIR")
    p.add_argument("--target", metavar="DIR", help="HF target directory (default: embedded)")
    p.add_argument("--mesh", help="data,fsdp,tensor (one may be -1)")
    p.add_argument("--seed", type=int)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--allow-config-change",
        action="store_true",
        help="resume a --run-dir with a config that differs from its config.json "
        "(recorded in config_changes.jsonl)",
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    from adaflash_jax.cli import exit_status
    from adaflash_jax.distill.pipeline import Preempted
    from adaflash_jax.train.mesh import exit_on_peer_loss

    try:
        return exit_status(run, args)
    except Preempted as e:
        print(f"preempted: {e}; rerun with the same --run-dir to resume", file=sys.stderr)
        return 143
    except Exception as e:
        exit_on_peer_loss(e)  # a lost peer process: one line, exit 3 (multi-process runs)
        raise


def run(args) -> None:
    from adaflash_jax.distill import pipeline
    from adaflash_jax.distill.config_file import load_config
    from adaflash_jax.distill.overrides import override
    from adaflash_jax.model.config import ConfigError

    cfg = load_config(args.config)
    sets = dict(kv.split("=", 1) for kv in args.set if "=" in kv)
    if bad := [kv for kv in args.set if "=" not in kv]:
        raise ConfigError(f"--set needs FIELD=VALUE, got {bad}")
    for flag, field in FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            sets[field] = f"({value})" if flag == "mesh" else value
    pipeline.run(
        override(cfg, sets),
        run_dir=args.run_dir,
        progress=not args.no_progress,
        allow_config_change=args.allow_config_change,
    )


if __name__ == "__main__":
    sys.exit(main())
