"""Transcoders on disk: circuit-tracer's folder format (read and written) and SAELens transcoders (read).

circuit-tracer's folder: ``config.yaml`` with ``model_kind`` (``transcoder_set`` or ``cross_layer_transcoder``),
``feature_input_hook`` and ``feature_output_hook`` (per-block point names), optionally ``transcoders`` (a list of
per-layer files); per-layer transcoders in ``layer_{i}.safetensors`` (``W_enc [feature, d_model]``, ``W_dec``,
``b_enc``, ``b_dec``, ``activation_function.threshold`` for JumpReLU, ``W_skip`` applied as ``x @ W_skip.T``);
cross-layer ones in ``W_enc_{i}.safetensors`` (``W_enc_i``, ``b_enc_i``, ``b_dec_i``, ``threshold_i``) and
``W_dec_{i}.safetensors`` (``W_dec_i [feature, n_layers - i, d_model]``). TopK's ``k`` is an extra config key
(``top_k``) that circuit-tracer's loader does not read; so is a cross-layer ``W_skip_i``.
"""

import json
import re
from pathlib import Path

import torch
import yaml
from safetensors import safe_open
from safetensors.torch import save_file

# circuit-tracer names its points on a TransformerLens model whose MLP it wraps; the bridge's names for the same.
CT_POINTS = {"mlp.hook_out": "hook_mlp_out", "ln2.hook_out": "mlp.hook_in"}


def _bridge_point(name: str) -> str:
    return CT_POINTS.get(name, name)


def write_folder(tc, directory: str | Path) -> Path:
    """Write ``tc`` (a `TranscoderSet`) in circuit-tracer's folder format; returns the folder."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "model_kind": "transcoder_set" if tc.kind == "plt" else "cross_layer_transcoder",
        "feature_input_hook": tc.input_hook,
        "feature_output_hook": tc.output_hook,
        "activation": tc.activation,
    }
    if tc.scan is not None:
        config["scan"] = tc.scan
    if tc.top_k is not None:
        config["top_k"] = tc.top_k
    cpu = lambda t: t.detach().cpu().contiguous()  # noqa: E731
    for layer in range(tc.n_layers):
        if tc.kind == "plt":
            tensors = {"W_enc": tc.W_enc[layer], "W_dec": tc.W_dec[layer], "b_enc": tc.b_enc[layer],
                       "b_dec": tc.b_dec[layer]}  # fmt: skip
            if tc.threshold is not None:
                tensors["activation_function.threshold"] = tc.threshold[layer]
            if tc.W_skip is not None:
                tensors["W_skip"] = tc.W_skip[layer].T
            save_file({k: cpu(v) for k, v in tensors.items()}, out / f"layer_{layer}.safetensors")
        else:
            enc = {f"W_enc_{layer}": tc.W_enc[layer], f"b_enc_{layer}": tc.b_enc[layer],
                   f"b_dec_{layer}": tc.b_dec[layer]}  # fmt: skip
            if tc.threshold is not None:
                enc[f"threshold_{layer}"] = tc.threshold[layer]
            if tc.W_skip is not None:
                enc[f"W_skip_{layer}"] = tc.W_skip[layer]
            save_file({k: cpu(v) for k, v in enc.items()}, out / f"W_enc_{layer}.safetensors")
            save_file({f"W_dec_{layer}": cpu(tc.W_dec[layer])}, out / f"W_dec_{layer}.safetensors")
    (out / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return out


def _read(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)


def _numbered(directory: Path, prefix: str) -> list[Path]:
    found = {int(m.group(1)): p for p in directory.glob(f"{prefix}*.safetensors")
             if (m := re.fullmatch(rf"{prefix}(\d+)\.safetensors", p.name))}  # fmt: skip
    if not found or sorted(found) != list(range(len(found))):
        raise FileNotFoundError(
            f"{directory} must hold {prefix}0.safetensors ... {prefix}N.safetensors, one per layer; found layers "
            f"{sorted(found)}"
        )
    return [found[i] for i in range(len(found))]


def read_folder(directory: str | Path, dtype: torch.dtype = torch.float32) -> dict:
    """A circuit-tracer transcoder folder (``config.yaml`` + safetensors) as `TranscoderSet`'s constructor arguments.

    Point names in the config are the bridge's; circuit-tracer's TransformerLens-side names ``mlp.hook_out``
    / ``ln2.hook_out`` are read as ``hook_mlp_out`` / ``mlp.hook_in``.
    """
    folder = Path(directory)
    if not (folder / "config.yaml").is_file():
        raise FileNotFoundError(f"`directory` {str(folder)!r} has no config.yaml (circuit-tracer's transcoder format)")
    config = yaml.safe_load((folder / "config.yaml").read_text())
    kind = config.get("model_kind")
    if kind not in ("transcoder_set", "cross_layer_transcoder"):
        raise ValueError(
            f"config.yaml's `model_kind` must be 'transcoder_set' or 'cross_layer_transcoder', got {kind!r}"
        )
    hooks = dict(input_hook=_bridge_point(config["feature_input_hook"]),
                 output_hook=_bridge_point(config["feature_output_hook"]), scan=config.get("scan"))  # fmt: skip
    top_k = config.get("top_k")
    cast = lambda ts: torch.stack(ts).to(dtype)  # noqa: E731
    if kind == "transcoder_set":
        files = [folder / p for p in config["transcoders"]] if "transcoders" in config else _numbered(folder, "layer_")
        layers = [_read(f) for f in files]
        has_threshold = "activation_function.threshold" in layers[0]
        activation = "jumprelu" if has_threshold else ("topk" if top_k else "relu")
        return dict(
            W_enc=cast([t["W_enc"] for t in layers]), b_enc=cast([t["b_enc"] for t in layers]),
            W_dec=cast([t["W_dec"] for t in layers]), b_dec=cast([t["b_dec"] for t in layers]), kind="plt",
            activation=activation, top_k=top_k,
            threshold=cast([t["activation_function.threshold"].reshape(-1) for t in layers]) if has_threshold else None,
            W_skip=cast([t["W_skip"].T for t in layers]) if "W_skip" in layers[0] else None, **hooks,
        )  # fmt: skip
    enc = [_read(f) for f in _numbered(folder, "W_enc_")]
    dec = [_read(folder / f"W_dec_{i}.safetensors")[f"W_dec_{i}"].to(dtype) for i in range(len(enc))]
    has_threshold = "threshold_0" in enc[0]
    return dict(
        W_enc=cast([t[f"W_enc_{i}"] for i, t in enumerate(enc)]),
        b_enc=cast([t[f"b_enc_{i}"] for i, t in enumerate(enc)]),
        W_dec=dec, b_dec=cast([t[f"b_dec_{i}"] for i, t in enumerate(enc)]), kind="clt",
        activation="jumprelu" if has_threshold else ("topk" if top_k else "relu"), top_k=top_k,
        threshold=cast([t[f"threshold_{i}"].reshape(-1) for i, t in enumerate(enc)]) if has_threshold else None,
        W_skip=cast([t[f"W_skip_{i}"] for i, t in enumerate(enc)]) if "W_skip_0" in enc[0] else None, **hooks,
    )  # fmt: skip


def _layer_of(name: str) -> tuple[int, str]:
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)", name)
    if m is None:
        raise ValueError(f"a SAELens transcoder's hook name must be 'blocks.<layer>.<point>', got {name!r}")
    return int(m.group(1)), m.group(2)


def read_saelens(folders: list[str | Path], dtype: torch.dtype = torch.float32) -> dict:
    """Per-layer transcoders saved by SAELens (one folder per layer: ``cfg.json`` + ``sae_weights.safetensors``),
    as `TranscoderSet`'s constructor arguments. Architectures ``transcoder``, ``skip_transcoder``,
    ``jumprelu_transcoder``,
    ``jumprelu_skip_transcoder`` (and ``topk`` ones with ``k``); the hook names are read from the config
    (``hook_name`` / ``hook_name_out``, at the top level or under ``metadata``) and must cover layers 0..n-1."""
    by_layer, hooks = {}, set()
    for folder in map(Path, folders):
        cfg = json.loads((folder / "cfg.json").read_text())
        meta = {**cfg, **cfg.get("metadata", {})}
        if "hook_name_out" not in meta:
            raise ValueError(f"{folder}/cfg.json has no `hook_name_out`: not a SAELens transcoder")
        layer, point_in = _layer_of(meta["hook_name"])
        layer_out, point_out = _layer_of(meta["hook_name_out"])
        if layer_out != layer:
            raise ValueError(f"{folder}: reads layer {layer} and writes layer {layer_out}; only per-layer transcoders")
        arch = str(cfg.get("architecture", "transcoder"))
        weights = _read(folder / "sae_weights.safetensors")
        by_layer[layer] = (weights, arch, cfg.get("k"))
        hooks.add((_bridge_point(point_in), _bridge_point(point_out)))
    if sorted(by_layer) != list(range(len(by_layer))) or len(hooks) != 1:
        raise ValueError(f"SAELens transcoders must cover layers 0..n-1 at one pair of points; got layers "
                         f"{sorted(by_layer)} at {sorted(hooks)}")  # fmt: skip
    layers = [by_layer[i] for i in range(len(by_layer))]
    arch, top_k = layers[0][1], layers[0][2]
    activation = "jumprelu" if "jumprelu" in arch else ("topk" if "topk" in arch or top_k else "relu")
    cast = lambda ts: torch.stack(ts).to(dtype)  # noqa: E731
    ((input_hook, output_hook),) = hooks
    return dict(
        W_enc=cast([w["W_enc"].T for w, _, _ in layers]), b_enc=cast([w["b_enc"] for w, _, _ in layers]),
        W_dec=cast([w["W_dec"] for w, _, _ in layers]), b_dec=cast([w["b_dec"] for w, _, _ in layers]), kind="plt",
        activation=activation, top_k=int(top_k) if activation == "topk" else None,
        threshold=cast([w["threshold"] for w, _, _ in layers]) if activation == "jumprelu" else None,
        W_skip=cast([w["W_skip"].T for w, _, _ in layers]) if "W_skip" in layers[0][0] else None,
        input_hook=input_hook, output_hook=output_hook, scan=None,
    )  # fmt: skip
