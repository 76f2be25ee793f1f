"""How each serving stack is launched on an export, what was checked, and what its layout
leaves out: the one copy of these facts. The export's README.md (`export_readme`) renders
them, and docs/serving.md quotes the same launch commands (tests/test_run_records.py
checks each command here appears there verbatim at K = 16).

A launch command names the target as TARGET (its HF directory or hub id) and the export as
DRAFTER; `{K}` is the export's block size and `{K-1}` one less (vLLM's
`num_speculative_tokens`).
"""

from __future__ import annotations

import dataclasses

from adaflash_jax.drafter.config import DrafterConfig
from adaflash_jax.drafter.stacks import SGLANG, TPU_INFERENCE, VLLM, stack

SGLANG_HEAD_PR = 34171  # the SGLang pull request that serves the length head


@dataclasses.dataclass(frozen=True, kw_only=True)
class Serving:
    stack: str  # drafter.stacks name (`--for`)
    title: str
    checked: str  # the version checked, and how
    section: str  # where docs/serving.md covers it
    launch: str  # the launch command (placeholders: the module docstring)
    # the head is read only by another build: (what it is, its launch command)
    head_launch: tuple[str, str] | None = None


_SGLANG = """python -m sglang.launch_server \\
    --model-path TARGET \\
    --speculative-algorithm DFLASH \\
    --speculative-draft-model-path DRAFTER \\
    --speculative-num-draft-tokens {K} \\
    --tp-size 1 \\
    --trust-remote-code"""
_SGLANG_HEAD = """python -m sglang.launch_server \\
    --model-path TARGET \\
    --speculative-algorithm DFLASH \\
    --speculative-draft-model-path DRAFTER \\
    --speculative-num-draft-tokens {K} \\
    --max-running-requests 64 \\
    --thresh-head-threshold-rate 1.3 \\
    --dflash-dynamic-verify-len \\
    --dflash-dynamic-verify-ema-alpha 0.3 \\
    --dflash-hard-clip-scale 1.0 \\
    --prob-head-candidate-len-min 1 \\
    --trust-remote-code"""
_VLLM_CONFIG = """'{"method": "dflash", "model": "DRAFTER", "num_speculative_tokens": {K-1}}'"""

SERVING = {
    s.stack: s
    for s in (
        Serving(
            stack="adaflash",
            title="our engine (adaflash_jax)",
            checked="this repository (tests/test_speculative.py: greedy output equals the "
            "target's)",
            section="docs/serving.md §6",
            launch="python -m experiments.generate --target TARGET_DIR --drafter DRAFTER "
            '--policy adaflash \\\n    --prompt "def fib(n):" --max-new-tokens 64 --json',
        ),
        Serving(
            stack="sglang",
            title="SGLang (GPU)",
            checked=f"run: the PyPI wheel sglang=={SGLANG}, its DFLASH server arguments, draft "
            "model config, loader and drafter forward on this layout "
            "(tests/test_sglang_export.py); the length head: "
            f"pull request #{SGLANG_HEAD_PR} (not in a release, source read)",
            section="docs/serving.md §1",
            launch=_SGLANG,
            head_launch=(
                f"the SGLang build of pull request #{SGLANG_HEAD_PR}, "
                'pip install "sglang[all] @ git+https://github.com/sgl-project/sglang.git'
                f'@refs/pull/{SGLANG_HEAD_PR}/head#subdirectory=python"; the head is used '
                "only with --dflash-dynamic-verify-len and max_running_requests above 48",
                _SGLANG_HEAD,
            ),
        ),
        Serving(
            stack="vllm",
            title="vLLM (GPU)",
            checked=f"run: the PyPI wheel vllm=={VLLM}, its speculative config, loader and "
            "DFlash drafter forward on this layout (tests/test_vllm_export.py)",
            section="docs/serving.md §2",
            launch=f"vllm serve TARGET \\\n    --speculative-config {_VLLM_CONFIG}",
        ),
        Serving(
            stack="tpu-inference",
            title="tpu-inference (vLLM on TPU)",
            checked=f"run: the PyPI wheel tpu-inference=={TPU_INFERENCE}, its DFlash model, "
            "weight loader and proposer on this layout (tests/test_tpu_inference_export.py)",
            section="docs/serving.md §4",
            launch="MODEL_IMPL_TYPE=flax_nnx vllm serve TARGET \\\n"
            f"    --speculative-config {_VLLM_CONFIG} \\\n"
            "    --tensor-parallel-size 4",
        ),
        Serving(
            stack="sglang-jax",
            title="sglang-jax (TPU)",
            checked="source read: sgl-project/sglang-jax at commit cddbf6f1 (server_args.py, "
            "models/dflash.py, speculative/dflash_worker.py)",
            section="docs/serving.md §3",
            launch="""JAX_COMPILATION_CACHE_DIR=/tmp/jit_cache python -m sgl_jax.launch_server \\
    --model-path TARGET \\
    --speculative-algorithm DFLASH \\
    --speculative-draft-model-path DRAFTER \\
    --speculative-num-steps 1 \\
    --speculative-eagle-topk 1 \\
    --speculative-num-draft-tokens {K} \\
    --tp-size 4""",
        ),
    )
}


def render(command: str, block_size: int) -> str:
    """A launch command at block size K."""
    return command.replace("{K-1}", str(block_size - 1)).replace("{K}", str(block_size))


def left_out(cfg: DrafterConfig, name: str) -> list[str]:
    """What serving this drafter (of config `cfg`) on stack `name` leaves out that our
    engine uses; [] when nothing is. The first items name what the layout itself drops."""
    head = cfg.length_head
    if head is None:
        return []
    accept = head.accept_dim > 0
    if not stack(name).length_head:
        what = "the length head" + (" and its acceptance part" if accept else "")
        return [
            f"{what}: the {name} layout is plain DFlash (no head tensors or keys), so {name} "
            "verifies the whole block every step (our `fixed` policy)"
        ]
    out = []
    if name == "sglang":
        out.append(
            "the length head, in released SGLang: its tensors are in model.safetensors but "
            f"only the build of pull request #{SGLANG_HEAD_PR} reads them; stock SGLang "
            "serves the whole block every step"
        )
    if accept and name != "adaflash":
        out.append("the acceptance part (adaflash_extra/): read by our engine only")
    return out


def dropped_warning(cfg: DrafterConfig, name: str) -> str | None:
    """The `warning:` line for a layout that drops part of the drafter; None if it drops
    nothing."""
    if stack(name).length_head or cfg.length_head is None:
        return None
    return f"--for {name} leaves out " + left_out(cfg, name)[0]


def export_readme(cfg: DrafterConfig, name: str, *, source: str, tau: str, notes: list[str]) -> str:
    """README.md of an export for stack `name` (`source`: "by … from …"): the stack, the
    version checked, the launch command, what it leaves out, the τ the run measured (`tau`,
    a sentence) and the stack's other differences from our engine (`notes`, the export's
    warnings)."""
    s = SERVING[stack(name).name]
    layout = "AdaFlash (length head in model.safetensors)"
    if not stack(name).length_head:
        layout = "plain DFlash (no length head)"
    k = cfg.block_size
    lines = [
        f"# DFlash drafter for {s.title}",
        "",
        f"Written {source}.",
        "",
        f"- Stack: {s.title} (`--for {s.stack}`); layout: {layout}.",
        f"- Version checked: {s.checked}.",
        f"- Block size K = {k}; target layers {list(cfg.target_layer_ids)} of "
        f"{cfg.num_target_layers}. Serve it next to the unchanged target it was distilled for.",
        f"- Details: {s.section}.",
        "",
        "## Launch",
        "",
        "TARGET (TARGET_DIR): the target's HF directory or hub id; DRAFTER: this directory.",
        "",
        "```bash",
        render(s.launch, k),
        "```",
    ]
    if s.head_launch is not None and cfg.length_head is not None:
        what, command = s.head_launch
        lines += ["", f"With the length head ({what}):", "", "```bash"]
        lines += [render(command, k), "```"]
    lines += ["", "## Left out", ""]
    lines += [f"- {x}" for x in left_out(cfg, name)] or ["- nothing: our engine reads it all"]
    lines += ["", "## τ measured", "", tau]
    if notes:
        lines += ["", "## Served differently from our engine", ""]
        lines += [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"
