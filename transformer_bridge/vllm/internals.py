"""Everything the bridge knows about vLLM's internals, in one place.

vLLM moves its internal classes every few releases. The bridge reads only what is listed here: the declared
range of releases, the model classes it maps onto TransformerLens names (`FAMILIES`), where a worker keeps its
model runner and the requests of the batch being run (`batch_rows`), the forward context that carries the
batch's query offsets, the tensor-parallel collectives, and the compilation switch. Each read goes through a
function that raises `VLLMInternalsError` naming what moved and the installed release, never an
`AttributeError` from deep inside a hook.
"""

import contextlib
import dataclasses
import importlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

TESTED_RANGE = ("0.32.0", "0.33")  # [lowest tested, first untested minor)
EXTRA_KEY = "transformer_bridge"  # the key of a request's `SamplingParams.extra_args` the bridge owns


class VLLMInternalsError(RuntimeError):
    """vLLM's internals differ from what the bridge was written against (a release outside `TESTED_RANGE`)."""


def version() -> str:
    """The installed vLLM release."""
    return importlib.import_module("vllm").__version__


def _moved(what: str) -> VLLMInternalsError:
    lo, hi = TESTED_RANGE
    return VLLMInternalsError(
        f"vLLM {version()}: {what}. transformer_bridge.vllm is tested with vLLM >={lo},<{hi}; install a release "
        f"in that range (pip install 'vllm>={lo},<{hi}'), or update transformer_bridge/vllm/internals.py."
    )


def _parts(v: str) -> tuple[int, ...]:
    out = []
    for piece in v.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def check_version() -> None:
    """Raise `VLLMInternalsError` when the installed vLLM lies outside `TESTED_RANGE`."""
    lo, hi = TESTED_RANGE
    if not (_parts(lo) <= _parts(version()) < _parts(hi)):
        raise _moved("this release is outside the tested range")


def _need(obj: Any, path: str, what: str) -> Any:
    for attr in path.split("."):
        if not hasattr(obj, attr):
            raise _moved(f"{what}: `{type(obj).__name__}` has no attribute `{attr}` (reading `{path}`)")
        obj = getattr(obj, attr)
    return obj


# -- the engine, from the driver --------------------------------------------------------------------------------


def engine_config(llm: Any) -> Any:
    """The engine's `VllmConfig`."""
    return _need(llm, "llm_engine.vllm_config", "the engine's config")


def is_compiled(llm: Any) -> bool:
    """Whether the engine compiles the model (vLLM's default; ``enforce_eager=True`` turns it off)."""
    mode = _need(engine_config(llm), "compilation_config.mode", "the compilation mode")
    return int(mode) != 0  # CompilationMode.NONE


MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"  # "0": the engine core runs in the process that builds it


def core_in_process(llm: Any) -> bool:
    """Whether the engine core runs in this process (vLLM's `InprocClient`), not behind its multiprocess client:
    only then do the bridge's calls to the workers (`collective_rpc` of functions) and per-request tags reach them."""
    return type(_need(llm, "llm_engine.engine_core", "the engine-core client")).__name__ == "InprocClient"


@contextlib.contextmanager
def core_in_this_process() -> Iterator[None]:
    """Engines built in the block run their engine core in this process, unless the caller set
    `MULTIPROCESSING_ENV` (vLLM reads it when an engine is built)."""
    if MULTIPROCESSING_ENV in os.environ:
        yield
        return
    os.environ[MULTIPROCESSING_ENV] = "0"
    try:
        yield
    finally:
        os.environ.pop(MULTIPROCESSING_ENV, None)


def in_process(llm: Any) -> bool:
    """Whether the engine's one worker runs in this process (then hooks are plain calls, closures included)."""
    executor = _need(engine_config(llm), "parallel_config.distributed_executor_backend", "the executor backend")
    return executor in (None, "uni") and core_in_process(llm)


def tokenizer_of(llm: Any) -> Any:
    """The engine's HF tokenizer, or None when it was started with ``skip_tokenizer_init=True``."""
    try:
        return llm.get_tokenizer()
    except (ValueError, RuntimeError, AttributeError):
        return None


def prompt(token_ids: list[int], salt: str | None) -> dict[str, Any]:
    """One request's prompt as vLLM takes token ids; ``salt`` keeps its KV blocks out of others' prefix cache."""
    out: dict[str, Any] = {"prompt_token_ids": list(token_ids)}
    if salt is not None:
        out["cache_salt"] = salt
    return out


def sampling_params(**fields: Any) -> Any:
    """vLLM's `SamplingParams` (the fields are vLLM's names)."""
    from vllm import SamplingParams  # optional dependency: imported where vLLM is used

    return SamplingParams(**fields)


# -- inside a worker ----------------------------------------------------------------------------------------------


def worker_model(worker: Any) -> nn.Module:
    """The model a worker runs (``collective_rpc`` hands functions the worker)."""
    runner = worker_runner(worker)
    model = _need(runner, "model", "the model runner's model")
    return getattr(model, "module", model)  # unwrapped when a runner wraps it


def worker_runner(worker: Any) -> Any:
    return _need(worker, "model_runner", "the worker's model runner")


def tp_rank_size() -> tuple[int, int]:
    """This worker's tensor-parallel rank and the group's size."""
    from vllm.distributed import parallel_state

    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def all_gather(t: Tensor) -> Tensor:
    """Concatenate every tensor-parallel rank's shard of ``t`` along its last axis."""
    from vllm.distributed import communication_op

    return communication_op.tensor_model_parallel_all_gather(t.contiguous(), dim=-1)


@dataclasses.dataclass
class Row:
    """One request's slice of the flattened batch a forward runs: rows ``start:stop`` of every activation."""

    req_id: str
    tag: dict[str, Any] | None  # the request's ``extra_args[EXTRA_KEY]``; None for requests the bridge did not send
    start: int
    stop: int
    n_prompt: int


def batch_rows(runner: Any, n_tokens: int) -> list[Row]:
    """The requests of the forward being run and their rows, from the step's own metadata: the query offsets of
    the attention metadata in the forward context, and the order of the runner's input batch."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        raise _moved("no forward context is set while the model runs")
    meta = get_forward_context().attn_metadata
    if isinstance(meta, list):  # micro-batching: one dict per micro-batch
        raise _moved("micro-batched forward contexts (a list of metadata dicts) are not supported")
    offsets = None
    for m in (meta or {}).values():
        offsets = getattr(m, "query_start_loc_cpu", None)
        if offsets is None:
            offsets = getattr(m, "query_start_loc", None)
        if offsets is not None:
            break
    req_ids = _need(runner, "input_batch.req_ids", "the runner's batch order")
    if offsets is None:
        if meta:
            raise _moved("the attention metadata carries no `query_start_loc`")
        return []  # a dummy run (profiling) before any request
    offsets = offsets.tolist()
    requests = _need(runner, "requests", "the runner's request states")
    rows = []
    for i, req_id in enumerate(req_ids[: len(offsets) - 1]):
        if req_id is None:
            continue
        start, stop = int(offsets[i]), int(offsets[i + 1])
        if stop > n_tokens:
            raise _moved(f"query offsets ({stop}) beyond the forward's {n_tokens} tokens")
        state = requests.get(req_id)
        params = getattr(state, "sampling_params", None)
        extra = getattr(params, "extra_args", None) or {}
        n_prompt = len(getattr(state, "prompt_token_ids", None) or ())
        rows.append(Row(req_id, extra.get(EXTRA_KEY), start, stop, n_prompt))
    return rows


# Worker processes (tensor or pipeline parallelism) are spawned: on CPU always, on GPU once CUDA is
# initialised. A patch made in the driver does not reach them; vLLM resolves ``worker_extension_cls`` (an engine
# argument, a class's qualified name) in each worker before the worker loads its model, so importing that class's
# module is where a worker installs what the driver asked for, read from this environment variable (inherited).
WORKER_EXTENSION_ARG = "worker_extension_cls"
WORKER_SETUP_ENV = "TRANSFORMER_BRIDGE_VLLM_WORKER_SETUP"


def _load_model_patches(callback: Callable[[Any, nn.Module], None]) -> dict[type, Callable]:
    """``{runner class: load_model that calls callback(runner, model) after loading}`` for the runners defining it."""
    from vllm.v1.worker import cpu_model_runner, gpu_model_runner

    classes = [cpu_model_runner.CPUModelRunner, gpu_model_runner.GPUModelRunner]
    originals = {cls: vars(cls).get("load_model") for cls in classes}
    if not any(originals.values()):
        raise _moved("no model runner defines `load_model`")

    def wrap(original: Callable) -> Callable:
        def load_model(runner: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(runner, *args, **kwargs)
            callback(runner, _need(runner, "model", "the model runner's model"))
            return out

        return load_model

    return {cls: wrap(original) for cls, original in originals.items() if original is not None}


def patch_load_model(callback: Callable[[Any, nn.Module], None]) -> None:
    """For the rest of this process (a worker's), every model runner calls ``callback(runner, model)`` right after
    loading its model, before vLLM compiles it."""
    for cls, load_model in _load_model_patches(callback).items():
        cls.load_model = load_model


@contextlib.contextmanager
def on_model_load(
    callback: Callable[[Any, nn.Module], None], engine_kwargs: dict[str, Any], worker_setup: tuple[str, str]
) -> Iterator[None]:
    """While the block runs, every model runner calls ``callback(runner, model)`` right after loading its model, before
    vLLM compiles it (so hooks registered there are traced into the compiled code): in this process by a patch; in
    worker processes (spawned) through ``worker_setup = (qualified class name, payload)``: the name goes into
    ``engine_kwargs`` as vLLM's `WORKER_EXTENSION_ARG`, the payload into `WORKER_SETUP_ENV`, and the class's module,
    imported in a worker, installs the same callback from the payload (`patch_load_model`). vLLM's compile cache is
    off meanwhile: a graph cached without the bridge's taps must not be loaded for an engine that has them, nor one
    with taps for an engine without."""
    if engine_kwargs.get(WORKER_EXTENSION_ARG) is not None:
        raise ValueError(
            f"`{WORKER_EXTENSION_ARG}`={engine_kwargs[WORKER_EXTENSION_ARG]!r}: a compiled engine with declared points "
            "uses vLLM's worker extension to install its taps in worker processes; drop it, or build the engine "
            "without `compiled_points` (`enforce_eager=True` for Python hooks)."
        )
    patches = _load_model_patches(callback)
    originals = {cls: vars(cls)["load_model"] for cls in patches}
    saved = {k: os.environ.get(k) for k in ("VLLM_DISABLE_COMPILE_CACHE", WORKER_SETUP_ENV)}
    os.environ["VLLM_DISABLE_COMPILE_CACHE"] = "1"
    engine_kwargs[WORKER_EXTENSION_ARG], os.environ[WORKER_SETUP_ENV] = worker_setup
    for cls, load_model in patches.items():
        cls.load_model = load_model
    try:
        yield
    finally:
        for cls, original in originals.items():
            cls.load_model = original
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def model_is_compiled(model: nn.Module) -> bool:
    """Whether the worker's model runs compiled code (then torch hooks registered now never fire)."""
    inner = getattr(model, "model", None)
    return inner is not None and hasattr(inner, "do_not_compile") and not inner.do_not_compile


# -- model classes: where each family keeps the modules the points come from --------------------------------------


@dataclasses.dataclass(frozen=True)
class Family:
    """Where one of vLLM's model classes keeps its modules (paths relative to the model, then to a layer)."""

    classes: tuple[str, ...]
    layers: str = "model.layers"
    embed: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    lm_head: str = "lm_head"
    ln1: str = "input_layernorm"
    ln2: str = "post_attention_layernorm"
    attn: str = "self_attn"
    qkv: str = "self_attn.qkv_proj"
    core: str = "self_attn.attn"
    o_proj: str = "self_attn.o_proj"
    mlp: str = "mlp"
    gate_up: str | None = "mlp.gate_up_proj"
    down: str | None = "mlp.down_proj"
    qk_norm: tuple[str, str] | None = None  # Qwen3's and Gemma 3's per-head q/k norms (before RoPE)
    # Gemma 2 / 3's sandwich norms: the attention and MLP outputs are normed before they join the residual
    # (``ln1_post`` / ``ln2_post``; ``hook_attn_out`` / ``hook_mlp_out`` are their outputs, as in the HF bridge)
    ln1_post: str | None = None
    ln2_post: str | None = None
    embed_scaled: bool = False  # Gemma: the embedding is multiplied by sqrt(d_model) in the model's forward
    # A mixture of experts: the router's module (its output: the router logits) and the HF bridge's routing rule
    # (`sites.moe.route`), from which the expert weights are recomputed; the experts themselves run fused.
    router: str | None = None
    routing: str = "softmax_topk"
    # Points the HF bridge has for the family that this class computes inside one fused kernel ("{layer}" per block)
    fused: tuple[str, ...] = ()


LLAMA_LIKE = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Phi3ForCausalLM")
QK_NORM = ("self_attn.q_norm", "self_attn.k_norm")
GEMMA2 = Family(
    classes=("Gemma2ForCausalLM",),
    ln2="pre_feedforward_layernorm",
    ln1_post="post_attention_layernorm",
    ln2_post="post_feedforward_layernorm",
    embed_scaled=True,
)
# The experts run inside one fused kernel: no tensor holds one expert's activations.
FUSED_EXPERTS = tuple(f"blocks.{{layer}}.mlp.hook_expert_{p}" for p in ("pre", "post", "result"))
QWEN3_MOE = Family(
    classes=("Qwen3MoeForCausalLM",),
    qk_norm=QK_NORM,
    gate_up=None,
    down=None,
    router="mlp.gate",
    fused=FUSED_EXPERTS,
)
MIXTRAL = dataclasses.replace(
    QWEN3_MOE, classes=("MixtralForCausalLM",), qk_norm=None, mlp="block_sparse_moe", router="block_sparse_moe.gate"
)
FAMILIES: tuple[Family, ...] = (
    Family(classes=LLAMA_LIKE),
    QWEN3_MOE,
    MIXTRAL,
    Family(classes=("Qwen3ForCausalLM",), qk_norm=QK_NORM),
    GEMMA2,
    dataclasses.replace(GEMMA2, classes=("Gemma3ForCausalLM",), qk_norm=QK_NORM),
)


# vLLM's Transformers backend (``model_impl="transformers"``, and vLLM's choice for families it has no class for, such
# as OLMo 2): HF's own decoder layers, with vLLM's fused projections and attention swapped in. `hf_sites` reads them.
TRANSFORMERS_BACKEND = "TransformersForCausalLM"
HF_ATTENTION = "vllm"  # the name vLLM registers its attention under in HF's attention registry


def backend_family(model: nn.Module) -> Family:
    """The `Family` of a Transformers-backend model, read off its first decoder layer: pre-norm (Llama, Qwen 2,
    Mistral: ``input_layernorm`` / ``post_attention_layernorm``) or post-norm (OLMo 2: ``post_attention_layernorm`` /
    ``post_feedforward_layernorm`` after each sublayer), whole-projection q/k norms where HF has them."""
    layer = submodule(model, "model.layers.0", "the first decoder layer")
    names = {n for n, _ in layer.named_modules()}
    fused = {"self_attn.qkv_proj", "mlp.gate_up_proj", "mlp.down_proj", "self_attn.o_proj", "self_attn.attn"}
    if not fused <= names or "pre_feedforward_layernorm" in names:
        raise _moved(
            f"the Transformers backend runs `{type(layer).__name__}` with modules the bridge does not map (it needs "
            f"{sorted(fused)} and no pre-feed-forward norm; found {sorted(n for n in names if n.count('.') < 2)})"
        )
    post_norm = "input_layernorm" not in names
    qk = ("self_attn.q_norm", "self_attn.k_norm") if "self_attn.q_norm" in names else None
    return Family(
        classes=(TRANSFORMERS_BACKEND,),
        ln1="" if post_norm else "input_layernorm",
        ln2="" if post_norm else "post_attention_layernorm",
        ln1_post="post_attention_layernorm" if post_norm else None,
        ln2_post="post_feedforward_layernorm" if post_norm else None,
        qk_norm=qk,
    )


_ATTENTION_TAPS: dict[int, Callable[[Tensor, Tensor], tuple[Tensor, Tensor] | None]] = {}


class _AttentionTap:
    def __init__(self, module: nn.Module) -> None:
        self.key = id(module)

    def remove(self) -> None:
        _ATTENTION_TAPS.pop(self.key, None)


def tap_attention(module: nn.Module, fn: Callable[[Tensor, Tensor], tuple[Tensor, Tensor] | None]) -> _AttentionTap:
    """Under the Transformers backend, call ``fn(query, key)`` (HF's ``[1, head, tokens, d]``, after RoPE) before
    vLLM's attention for HF attention module ``module``; it returns None or the (edited) pair. vLLM calls its
    `Attention` layer's ``forward`` directly there, so a torch hook on it never fires: the bridge wraps the function
    vLLM registers in HF's attention registry instead (once per process)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    original = ALL_ATTENTION_FUNCTIONS.get(HF_ATTENTION)
    if original is None:
        raise _moved(f"HF's attention registry has no `{HF_ATTENTION}` function (the Transformers backend's)")
    if not getattr(original, "_bridge_tapped", False):

        def attention(attn_module: nn.Module, query: Tensor, key: Tensor, *args: Any, **kwargs: Any) -> Any:
            tap = _ATTENTION_TAPS.get(id(attn_module))
            new = None if tap is None else tap(query, key)
            if new is not None:
                query, key = new
            return original(attn_module, query, key, *args, **kwargs)

        attention._bridge_tapped = True  # type: ignore[attr-defined]
        ALL_ATTENTION_FUNCTIONS[HF_ATTENTION] = attention
    _ATTENTION_TAPS[id(module)] = fn
    return _AttentionTap(module)


def family_of(model: nn.Module) -> Family:
    """The `Family` of a worker's model, or `VLLMInternalsError` naming the class and those supported."""
    name = type(model).__name__
    if name == TRANSFORMERS_BACKEND:
        return backend_family(model)
    for fam in FAMILIES:
        if name in fam.classes:
            return fam
    known = sorted({TRANSFORMERS_BACKEND, *(c for f in FAMILIES for c in f.classes)})
    raise VLLMInternalsError(
        f"vLLM {version()} runs this model as `{name}`, which transformer_bridge.vllm does not map onto hook names "
        f"yet; supported classes: {known}."
    )


def submodule(root: nn.Module, path: str, what: str) -> nn.Module:
    """``root``'s submodule at a dotted ``path``, or `VLLMInternalsError` naming it."""
    try:
        return root.get_submodule(path)
    except AttributeError:
        raise _moved(f"`{type(root).__name__}` has no `{path}` ({what})") from None


def head_sizes(core: nn.Module) -> tuple[int, int, int, float]:
    """``(local q heads, local kv heads, head dim, softmax scale)`` of one of vLLM's `Attention` layers (the one a
    native model class and the Transformers backend both call)."""
    n_q = _need(core, "num_heads", "the attention layer's head count")
    n_kv = _need(core, "num_kv_heads", "the attention layer's kv-head count")
    d = _need(core, "head_size", "the attention layer's head size")
    return int(n_q), int(n_kv), int(d), float(_need(core, "impl.scale", "the attention kernel's softmax scale"))


def attention_params(core: nn.Module) -> dict[str, Any]:
    """One layer's softmax scale, sliding window (None: every earlier key) and logit soft-cap (None: none), read
    from vLLM's `Attention` module and its kernel (Gemma 2 soft-caps, and alternates windowed and global layers)."""
    impl = _need(core, "impl", "the attention layer's kernel")
    window = getattr(core, "sliding_window", None)
    cap = getattr(impl, "logits_soft_cap", None)
    return {
        "scale": float(_need(impl, "scale", "the attention kernel's softmax scale")),
        "sliding_window": int(window) if window is not None and int(window) > 0 else None,
        "softcap": float(cap) if cap else None,
    }


def final_softcap(model: nn.Module) -> float | None:
    """The soft-cap vLLM's logits processor applies to the head's output (Gemma 2), or None."""
    cap = getattr(getattr(model, "logits_processor", None), "soft_cap", None)
    return float(cap) if cap else None


def unembed_logits(model: nn.Module) -> Callable[[Tensor], Tensor]:
    """A function from final-normed hidden states to the logits vLLM's model computes from them."""
    compute = _need(model, "compute_logits", "the model's `compute_logits`")
    processor = getattr(model, "logits_processor", None)

    def logits(hidden: Tensor) -> Tensor:
        cap = getattr(processor, "soft_cap", None)
        with torch.no_grad():
            if cap is None:
                return compute(hidden)
            # Gemma 2 soft-caps its logits; the HF bridge's `unembed.hook_out` is the head's output before that (the
            # engine's own call comes after this forward, so switching the cap off for this one call is safe).
            processor.soft_cap = None
            try:
                return compute(hidden)
            finally:
                processor.soft_cap = cap

    return logits


def fused_points(info: dict[str, Any]) -> list[str]:
    """Names the HF bridge serves for this family that vLLM's engine computes inside a fused kernel."""
    fam = next((f for f in FAMILIES if info["class"] in f.classes), Family(classes=()))
    return [p.format(layer=i) for p in fam.fused for i in range(info["n_layers"])]
