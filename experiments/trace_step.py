"""Counts the functions one decode step crosses: distinct (file, function) under adaflash_jax/
called while `SpeculativeEngine.generate` runs one request of 2 new tokens (fixed policy, a
2-layer D 32 target, a 1-layer K 4 drafter, 2 slots), in a fresh process so the loop program
traces; those under `decode.programs.run_loop` are the step's (issue 16's measure).

JAX_PLATFORMS=cpu python -m experiments.trace_step
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    from adaflash_jax.cli import one_line_errors

    with one_line_errors():
        trace()


def trace() -> None:
    from flax import nnx

    import adaflash_jax
    from adaflash_jax.decode.slots import SpeculativeEngine
    from adaflash_jax.drafter.config import DrafterConfig
    from adaflash_jax.drafter.model import Drafter
    from adaflash_jax.model.presets import target_preset
    from adaflash_jax.model.target import TargetLM

    root = os.path.dirname(adaflash_jax.__file__)
    cfg = target_preset("test")
    dcfg = DrafterConfig.for_target(cfg, mask_token_id=127, num_layers=1, block_size=4,
                                    num_features=2)  # fmt: skip
    engine = SpeculativeEngine(
        TargetLM(cfg, rngs=nnx.Rngs(0)), Drafter(dcfg, rngs=nnx.Rngs(1)), slots=2, capacity=64
    )
    seen, in_loop, depth = set(), set(), [0]

    def profile(frame, event, arg):
        path = frame.f_code.co_filename
        if not path.startswith(root):
            return
        key = (os.path.relpath(path, root), frame.f_code.co_name)
        loop = key == ("decode/programs.py", "run_loop")
        if event == "call":
            seen.add(key)
            depth[0] += loop
            if depth[0]:
                in_loop.add(key)
        elif event == "return":
            depth[0] -= loop

    sys.setprofile(profile)
    engine.generate([([1, 2, 3], 2)])
    sys.setprofile(None)
    decode = {k for k in in_loop if k[0].startswith("decode")}
    for name, keys in (("generate", seen), ("loop program", in_loop), ("  in decode/", decode)):
        files = sorted({f for f, _ in keys})
        print(f"{name}: {len(keys)} functions in {len(files)} files: {', '.join(files)}")


if __name__ == "__main__":
    main()
