"""HuggingFace checkpoint I/O for the target: config.json + safetensors (one file or shards).

Weights go straight from a memory map onto their devices: with a mesh, each device reads
only its own slice, so a large target never sits whole in one host buffer or one device.
A MoE layer's experts are stored one tensor per expert
(`mlp.experts.{e}.{gate,up,down}_proj.weight`) or, as transformers 5 writes Qwen3.5-MoE, fused
(`mlp.experts.gate_up_proj` [E, 2F, D], `mlp.experts.down_proj` [E, D, F]); both become our
stacked [E, ...] arrays. Qwen3.5 checkpoints as users have them (docs/design.md §2.1): the
multimodal `Qwen3_5ForConditionalGeneration` keeps the decoder under `model.language_model.`
beside a vision tower (`model.visual.`), and may carry multi-token-prediction weights (`mtp.`);
the decoder is read, those are skipped, and the skip is logged once. gpt-oss (docs/design.md
§2.3) stores its experts fused with the gate and up columns interleaved
(`mlp.experts.gate_up_proj` [E, D, 2F]: [..., 0::2] gate, [..., 1::2] up; its bias likewise;
`down_proj` [E, F, D]), as float tensors or as MXFP4 `*_blocks` + `*_scales` (`model/mxfp4.py`,
dequantized at load); the router is `mlp.router`, each head's sink `self_attn.sinks`. A save
writes the float form.
"""

from __future__ import annotations

import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from adaflash_jax.io.safetensors_io import SafetensorsFile, save_file
from adaflash_jax.model.config import TargetConfig
from adaflash_jax.model.delta_rule import DEFAULT_CHUNK
from adaflash_jax.model.moe import MoEBlock
from adaflash_jax.model.mxfp4 import Mxfp4Weight
from adaflash_jax.model.target import DecoderLayer, TargetLM
from adaflash_jax.sharding.rules import DECODE_RULES, Rules, variable_sharding

_FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(jnp.bfloat16))
TEXT_PREFIX, MULTIMODAL_PREFIX = "model.", "model.language_model."
SKIPPED_PREFIXES = ("model.visual.", "mtp.")  # vision tower, multi-token prediction
log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint that does not match the model its config describes."""


def hf_param_table(
    model: TargetLM, prefix: str = TEXT_PREFIX
) -> dict[str, tuple[nnx.Variable, bool]]:
    """HF tensor name → (our Variable, whether HF stores it transposed as [out, in]); the
    decoder's names under `prefix` (`MULTIMODAL_PREFIX` in a multimodal checkpoint)."""
    table: dict[str, tuple[nnx.Variable, bool]] = {
        f"{prefix}embed_tokens.weight": (model.embed_tokens, False),
        f"{prefix}norm.weight": (model.norm.weight, False),
    }
    if model.lm_head is not None:
        table["lm_head.weight"] = (model.lm_head.kernel, True)
    for i, layer in enumerate(model.layers):
        table.update(layer_param_table(layer, f"{prefix}layers.{i}."))
    return table


def _linear_attention_table(layer: DecoderLayer, prefix: str):
    """A Gated DeltaNet's tensors (transformers' names); the conv weight keeps HF's shape."""
    net, p = layer.linear_attn, f"{prefix}linear_attn."
    table = {f"{p}{n}.weight": (getattr(net, n).kernel, True) for n in _DELTANET_DENSE}
    table.update(
        {
            f"{p}conv1d.weight": (net.conv1d, False),
            f"{p}A_log": (net.A_log, False),
            f"{p}dt_bias": (net.dt_bias, False),
            f"{p}norm.weight": (net.norm.weight, False),
        }
    )
    return table


_DELTANET_DENSE = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")


def layer_param_table(layer, prefix: str) -> dict[str, tuple[nnx.Variable, bool]]:
    """One Llama/Qwen3 decoder layer's HF tensor names under `prefix` → (Variable, stored
    transposed as [out, in]): the target's layers and the DFlash drafter's share them."""
    table = {
        f"{prefix}input_layernorm.weight": (layer.input_layernorm.weight, False),
        f"{prefix}post_attention_layernorm.weight": (layer.post_attention_layernorm.weight, False),
    }
    if isinstance(layer, DecoderLayer) and layer.linear_attn is not None:
        table.update(_linear_attention_table(layer, prefix))
    else:
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            table[f"{prefix}self_attn.{name}.weight"] = (getattr(attn, name).kernel, True)
            if getattr(attn, name).bias is not None:
                table[f"{prefix}self_attn.{name}.bias"] = (getattr(attn, name).bias, False)
        if isinstance(layer, DecoderLayer) and attn.sinks is not None:
            table[f"{prefix}self_attn.sinks"] = (attn.sinks, False)
        if attn.q_norm is not None:
            table[f"{prefix}self_attn.q_norm.weight"] = (attn.q_norm.weight, False)
            table[f"{prefix}self_attn.k_norm.weight"] = (attn.k_norm.weight, False)
    if isinstance(layer.mlp, MoEBlock) and layer.family == "gpt_oss":
        table[f"{prefix}mlp.router.weight"] = (layer.mlp.gate.kernel, True)
        table[f"{prefix}mlp.router.bias"] = (layer.mlp.gate.bias, False)
        return table
    if isinstance(layer.mlp, MoEBlock):
        table[f"{prefix}mlp.gate.weight"] = (layer.mlp.gate.kernel, True)
        if layer.mlp.shared_expert is not None:
            shared = layer.mlp.shared_expert
            for name in ("gate_proj", "up_proj", "down_proj"):
                table[f"{prefix}mlp.shared_expert.{name}.weight"] = (
                    getattr(shared, name).kernel,
                    True,
                )
            table[f"{prefix}mlp.shared_expert_gate.weight"] = (
                layer.mlp.shared_expert_gate.kernel,
                True,
            )
        return table
    for name in ("gate_proj", "up_proj", "down_proj"):
        table[f"{prefix}mlp.{name}.weight"] = (getattr(layer.mlp, name).kernel, True)
    return table


def expert_param_table(
    model: TargetLM, prefix: str = TEXT_PREFIX
) -> list[tuple[nnx.Variable, list[str]]]:
    """Each stacked [E, in, out] expert weight with its E HF tensor names (expert order),
    every one stored transposed as [out, in]."""
    out = []
    for i, layer in enumerate(model.layers):
        if not isinstance(layer.mlp, MoEBlock) or layer.family == "gpt_oss":
            continue
        for name in ("gate_proj", "up_proj", "down_proj"):
            var = getattr(layer.mlp, name)
            names = [
                f"{prefix}layers.{i}.mlp.experts.{e}.{name}.weight"
                for e in range(var.get_value().shape[0])
            ]
            out.append((var, names))
    return out


# gpt-oss: our MoEBlock parameter → (its tensor under `mlp.experts.`, which interleaved half
# of the last axis it is: 0 the gate's, 1 the up projection's, None the whole tensor)
GPT_OSS_EXPERTS = {
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", None),
    "gate_proj_bias": ("gate_up_proj_bias", 0),
    "up_proj_bias": ("gate_up_proj_bias", 1),
    "down_proj_bias": ("down_proj_bias", None),
}
MXFP4_PARTS = ("_blocks", "_scales")  # an MXFP4 tensor X is stored as X_blocks + X_scales


def gpt_oss_expert_table(
    model: TargetLM, prefix: str = TEXT_PREFIX
) -> list[tuple[nnx.Variable, str, int | None]]:
    """Each gpt-oss expert parameter (stacked [E, ...], in HF's orientation already) with its
    fused HF tensor and interleaved half (`GPT_OSS_EXPERTS`)."""
    out = []
    for i, layer in enumerate(model.layers):
        if isinstance(layer.mlp, MoEBlock) and layer.family == "gpt_oss":
            for ours, (hf, half) in GPT_OSS_EXPERTS.items():
                var = getattr(layer.mlp, ours)
                out.append((var, f"{prefix}layers.{i}.mlp.experts.{hf}", half))
    return out


class _Interleaved:
    """One half of a tensor's interleaved last axis ([..., half::2]), read lazily."""

    def __init__(self, view, half: int):
        self._view, self._half = view, half
        self.shape = (*view.shape[:-1], view.shape[-1] // 2)
        self.ndim = len(self.shape)

    def __getitem__(self, index) -> np.ndarray:
        *lead, last = index
        lo, hi, step = last.indices(self.shape[-1])
        full = np.asarray(self._view[(*lead, slice(2 * lo, 2 * max(hi, lo)))])
        return full[..., self._half :: 2][..., ::step]


def _gpt_oss_expert_view(files, name: str, half: int | None, want: tuple[int, ...]):
    """Our [E, ...] view of gpt-oss expert tensor `name`: float, or MXFP4 dequantized."""
    hf_want = (*want[:-1], want[-1] * 2) if half is not None else want
    if name in files:
        view = _checked_view(files, name, False, hf_want)
    else:
        blocks, scales = (f"{name}{part}" for part in MXFP4_PARTS)
        e, d_in, d_out = hf_want
        shapes = {blocks: (e, d_out, d_in // 32, 16), scales: (e, d_out, d_in // 32)}
        for part, shape in shapes.items():
            if d_in % 32 or files[part].shape(part) != shape:
                raise CheckpointError(
                    f"tensor {part!r} has shape {list(files[part].shape(part))} but config.json "
                    f"implies {list(shape)} (MXFP4 of [{e}, {d_in}, {d_out}])"
                )
            if files[part].dtype(part) != np.dtype(np.uint8):
                raise CheckpointError(
                    f"tensor {part!r} has dtype {files[part].dtype(part)}; "
                    "MXFP4 blocks and scales are uint8"
                )
        view = Mxfp4Weight(files[blocks].get(blocks), files[scales].get(scales))
    return view if half is None else _Interleaved(view, half)


def fused_expert_names(names: list[str]) -> tuple[str, str]:
    """(the fused tensor holding these per-expert names, its part: gate, up or down)."""
    head, _, tail = names[0].rpartition(".experts.0.")
    part = tail.split("_proj")[0]
    return f"{head}.experts.{'down_proj' if part == 'down' else 'gate_up_proj'}", part


class _FusedExperts:
    """Our stacked [E, in, out] expert weight read lazily from rows [start, stop) of a fused
    HF tensor [E, out·parts, in]: a device reads only its slice, as for any other tensor."""

    def __init__(self, view, start: int, stop: int):
        self._view, self._start = view, start
        self.shape = (view.shape[0], view.shape[2], stop - start)
        self.ndim = 3

    def __getitem__(self, index) -> np.ndarray:
        experts, inner, outer = index
        lo, hi, step = outer.indices(self.shape[2])
        rows = slice(self._start + lo, self._start + hi, step)
        return np.asarray(self._view[experts, rows, inner]).transpose(0, 2, 1)


def _fused_expert_view(files, names: list[str], want: tuple[int, ...]) -> _FusedExperts:
    """Our stacked [E, in, out] expert weight as a lazy view of its fused tensor."""
    fused, part = fused_expert_names(names)
    f = files[fused]
    e, d_in, d_out = want
    hf_want = (e, d_out, d_in) if part == "down" else (e, 2 * d_out, d_in)
    if f.shape(fused) != hf_want:
        raise CheckpointError(
            f"tensor {fused!r} has shape {list(f.shape(fused))} but config.json implies "
            f"{list(hf_want)}"
        )
    if f.dtype(fused) not in _FLOAT_DTYPES:
        raise CheckpointError(f"tensor {fused!r} has dtype {f.dtype(fused)}; expected a float")
    start = d_out if part == "up" else 0
    return _FusedExperts(f.get(fused), start, start + d_out)


def open_weight_files(path: str) -> dict[str, SafetensorsFile]:
    """Tensor name → the (lazily opened) file holding it, for a single or sharded checkpoint."""
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no weight_map")
        files: dict[str, SafetensorsFile] = {}
        out = {}
        for name, fname in weight_map.items():
            fpath = os.path.join(path, fname)
            if fname not in files:
                if not os.path.isfile(fpath):
                    raise FileNotFoundError(f"shard {fname} listed in {index} does not exist")
                files[fname] = SafetensorsFile(fpath)
            if name not in files[fname]:
                raise CheckpointError(f"tensor {name!r} is listed in the index but not in {fname}")
            out[name] = files[fname]
        return out
    if os.path.isfile(single):
        f = SafetensorsFile(single)
        return {name: f for name in f.keys()}
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")


def load_target(
    path: str | os.PathLike,
    *,
    dtype=jnp.float32,
    param_dtype=None,
    mesh: Mesh | None = None,
    rules: Rules = DECODE_RULES,
    chunk: int = DEFAULT_CHUNK,
    verify_attention: str = "xla",
) -> TargetLM:
    """Builds the model abstractly, then materialises each weight (sharded when `mesh`).
    `chunk`: a hybrid's Gated DeltaNet chunk length; `verify_attention`: its verify pass's
    attention (`TargetLM`)."""
    path = os.fspath(path)
    config = TargetConfig.from_pretrained(path)
    param_dtype = param_dtype or dtype
    files = open_weight_files(path)
    model = nnx.eval_shape(
        lambda: TargetLM(
            config,
            rngs=nnx.Rngs(0),
            dtype=dtype,
            param_dtype=param_dtype,
            chunk=chunk,
            verify_attention=verify_attention,
        )  # fmt: skip
    )
    prefix = (
        MULTIMODAL_PREFIX if f"{MULTIMODAL_PREFIX}embed_tokens.weight" in files else TEXT_PREFIX
    )
    table, experts = hf_param_table(model, prefix), expert_param_table(model, prefix)
    gpt_oss = gpt_oss_expert_table(model, prefix)
    fused = {n: fused_expert_names(names)[0] for _, names in experts for n in names}
    fused = {n: f for n, f in fused.items() if f in files and n not in files}
    expected, present = set(table), set(files)
    expected.update(fused.get(n, n) for _, names in experts for n in names)
    for _, name, _ in gpt_oss:  # float, or MXFP4 blocks + scales where those are stored
        mxfp4 = name not in files and f"{name}{MXFP4_PARTS[0]}" in files
        expected.update(f"{name}{part}" for part in MXFP4_PARTS) if mxfp4 else expected.add(name)
    if config.tie_word_embeddings:
        present.discard("lm_head.weight")  # some exporters write the tied copy anyway
    present = {n for n in present if not n.endswith("rotary_emb.inv_freq")}
    if skipped := sorted(n for n in present if n.startswith(SKIPPED_PREFIXES)):
        log.info(
            "%s: skipping %d tensors outside the text decoder (vision tower, multi-token "
            "prediction), e.g. %s",
            path,
            len(skipped),
            skipped[0],
        )
        present -= set(skipped)
    if missing := sorted(expected - present):
        raise CheckpointError(
            f"checkpoint {path} is missing tensors: {missing[:8]}"
            + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else "")
        )
    if unexpected := sorted(present - expected):
        raise CheckpointError(
            f"checkpoint {path} has unexpected tensors: {unexpected[:8]}"
            + (f" (+{len(unexpected) - 8} more)" if len(unexpected) > 8 else "")
        )
    for name, (var, transpose) in table.items():
        view = _checked_view(files, name, transpose, tuple(var.get_value().shape))
        var.set_value(_materialise([view], False, var, param_dtype, mesh, rules))
    for var, names in experts:
        if names[0] in fused:
            view = _fused_expert_view(files, names, tuple(var.get_value().shape))
            var.set_value(_materialise([view], False, var, param_dtype, mesh, rules))
            continue
        want = tuple(var.get_value().shape[1:])
        views = [_checked_view(files, name, True, want) for name in names]
        var.set_value(_materialise(views, True, var, param_dtype, mesh, rules))
    for var, name, half in gpt_oss:
        view = _gpt_oss_expert_view(files, name, half, tuple(var.get_value().shape))
        var.set_value(_materialise([view], False, var, param_dtype, mesh, rules))
    return model


def _checked_view(files, name: str, transpose: bool, want: tuple[int, ...]) -> np.ndarray:
    """Tensor `name` (memory-mapped) in our layout, after checking its shape and dtype."""
    f = files[name]
    got = f.shape(name)
    if (got[::-1] if transpose else got) != want:
        hf_want = want[::-1] if transpose else want
        raise CheckpointError(
            f"tensor {name!r} has shape {list(got)} but config.json implies {list(hf_want)}"
        )
    if f.dtype(name) not in _FLOAT_DTYPES:
        raise CheckpointError(
            f"tensor {name!r} has dtype {f.dtype(name)}; expected a floating dtype"
        )
    return f.get(name).T if transpose else f.get(name)


def _materialise(views: list, stacked: bool, var, param_dtype, mesh, rules) -> jax.Array:
    """One array from one view, or (`stacked`) from one view per expert stacked on axis 0;
    with a mesh, each device reads only its slice of the views."""
    np_dtype = np.dtype(param_dtype)

    def read(idx) -> np.ndarray:
        if not stacked:
            return np.asarray(views[0][idx], dtype=np_dtype)
        return np.stack([np.asarray(v[idx[1:]], dtype=np_dtype) for v in views[idx[0]]])

    shape = (len(views), *views[0].shape) if stacked else views[0].shape
    if mesh is None:
        return jnp.asarray(read(tuple(slice(None) for _ in shape)))
    return jax.make_array_from_callback(shape, variable_sharding(var, mesh, rules), read)


def save_target(model: TargetLM, path: str | os.PathLike, *, dtype=None) -> None:
    """Writes config.json + model.safetensors that `transformers` and `load_target` read (a
    text-only CausalLM; experts one tensor each, as transformers 5 writes them; gpt-oss's
    fused and interleaved, in float)."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tensors = {}

    def host(var):
        arr = np.asarray(jax.device_get(var.get_value()))
        return arr if dtype is None else arr.astype(np.dtype(dtype))

    for name, (var, transpose) in hf_param_table(model).items():
        arr = host(var)
        tensors[name] = np.ascontiguousarray(arr.T if transpose else arr)
    for var, names in expert_param_table(model):
        arr = host(var)
        tensors.update({n: np.ascontiguousarray(arr[e].T) for e, n in enumerate(names)})
    for var, name, half in gpt_oss_expert_table(model):  # gate and up interleaved again
        arr = host(var)
        if half is None:
            tensors[name] = np.ascontiguousarray(arr)
            continue
        fused = tensors.setdefault(name, np.empty((*arr.shape[:-1], 2 * arr.shape[-1]), arr.dtype))
        fused[..., half::2] = arr
    save_file(tensors, os.path.join(path, "model.safetensors"))
    cfg = model.config.to_hf_dict()
    saved_dtype = np.dtype(dtype) if dtype is not None else next(iter(tensors.values())).dtype
    cfg["torch_dtype"] = {"bfloat16": "bfloat16", "float16": "float16"}.get(
        saved_dtype.name, "float32"
    )
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
