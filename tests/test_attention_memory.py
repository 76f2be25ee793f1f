"""The attention-memory programs (aot/attention_memory.py) compile on the CPU backend and the
CLI refuses bad input in one line."""

import pytest

from adaflash_jax.aot.attention_memory import AttentionShapes, devices, measure, program
from adaflash_jax.train.mesh import make_mesh
from experiments import attention_memory


def test_context_variants_compile_and_drafter_variants_lower():
    shapes = dict(shape="test", layers=1, features=2, batch=1, seq=32, anchors=4, block=4)
    mesh = make_mesh(1, 1, 1, devices=devices("cpu", "")[:1])
    context = AttentionShapes(program="context", **shapes)
    rows = list(measure(context, mesh, ("recompute", "remat"), chunks=(8, 16)))
    assert [(v, c) for v, c, _ in rows] == [(v, c) for v in ("recompute", "remat") for c in (8, 16)]
    for _, _, figures in rows:
        assert figures["peak_gib"] > 0 and figures["args_gib"] > 0 and figures["tflop"] > 0
    drafter = AttentionShapes(program="drafter", **shapes)
    for variant in ("dense", "sparse"):  # lowered only: a drafter compile costs seconds
        fn, inputs = program(drafter, mesh, variant, 8)
        assert "dot_general" in fn.lower(*inputs).as_text()
    with pytest.raises(ValueError, match="variants"):
        program(drafter, mesh, "remat", 8)


def test_cli_refuses_a_bad_variant_and_slice(capsys):
    for argv in (["--program", "context", "--variants", "dense"], ["--topology", "v9:1x1"]):
        with pytest.raises(SystemExit) as e:
            attention_memory.main(argv)
        assert e.value.code == 2
    assert "unknown TPU slice" in capsys.readouterr().err
