"""The attention-memory programs (aot/attention_memory.py) compile on the CPU backend and the
CLI refuses bad input in one line."""

import pytest

from adaflash_jax.aot.attention_memory import AttentionShapes, devices, measure
from adaflash_jax.train.mesh import make_mesh
from experiments import attention_memory


@pytest.mark.parametrize(
    ("program", "variants", "chunks"),
    [("context", ("recompute", "remat"), (8, 16)), ("drafter", ("dense", "sparse"), (8,))],
)
def test_every_variant_compiles_with_its_figures(program, variants, chunks):
    shapes = AttentionShapes(
        program=program, shape="test", layers=1, features=2, batch=1, seq=32, anchors=4, block=4
    )
    mesh = make_mesh(1, 1, 1, devices=devices("cpu", "")[:1])
    rows = list(measure(shapes, mesh, variants, chunks))
    # dense compiles once (no chunk), the others once per chunk
    assert [(v, c) for v, c, _ in rows] == [
        (v, c) for v in variants for c in (chunks[:1] if v == "dense" else chunks)
    ]
    for _, _, figures in rows:
        assert figures["peak_gib"] > 0 and figures["args_gib"] > 0 and figures["tflop"] > 0


def test_cli_refuses_a_bad_variant_and_slice(capsys):
    for argv in (["--program", "context", "--variants", "dense"], ["--topology", "v9:1x1"]):
        with pytest.raises(SystemExit) as e:
            attention_memory.main(argv)
        assert e.value.code == 2
    assert "unknown TPU slice" in capsys.readouterr().err
