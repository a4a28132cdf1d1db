"""`BridgeCore`: wrap/load an unmodified HF causal LM, tokens, forward, hooks and caches. The core imports neither
generation nor relevance: those are functions over a `BridgeCore`, tied together by `TransformerBridge` (bridge.py).
"""

import contextlib
import copy
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from . import versions
from .adapters import Adapter, UnsupportedArchitectureError, adapter_for
from .adapters.base import one_plus
from .cache.caching import CacheWriter
from .checks import ArgumentIndexError, check_device, describe
from .config import BridgeConfig, bridge_config
from .distributed import attach_shard_specs, check_tensor_parallel, full_param, input_device, tp_mesh
from .hooks.points import HookContext, HookPoint, HookRegistry
from .inputs import PaddingSide, check_attention_mask, is_text, left_padding_mask, mask_for_implementation
from .layers import StopForward, check_layer, start_at, stop_before
from .loading import check_local_folder, loader_config
from .running import Input, NamesFilter, Running
from .sites import attention
from .sites.build import build_sites
from .sites.checks import arm_sites, check_sites, disarm_sites
from .sites.module_paths import get_module
from .sites.ssm import build_ssm_sites
from .tokens import Tokens


class BridgeCore(Running, nn.Module, HookRegistry, Tokens):
    """Wrap a HF causal LM and expose TransformerLens-named hook points (the core of `TransformerBridge`).

    With no hook registered the model runs its own code: logits are bitwise those of the HF model.
    Generation and relevance are functions over a core (``generation.generate(core, ...)``); the
    public `TransformerBridge` adds them as methods.

    Example:
        >>> from transformers import LlamaConfig
        >>> core = BridgeCore.from_config(LlamaConfig(vocab_size=99, hidden_size=32,
        ...     intermediate_size=37, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
        >>> logits, cache = core.run_with_cache(torch.tensor([[1, 2, 3]]))
    """

    def __init__(self, hf_model: PreTrainedModel, tokenizer: Any = None) -> None:
        if not isinstance(hf_model, nn.Module) or not hasattr(hf_model, "config"):
            raise TypeError(
                f"`hf_model` must be a HuggingFace causal LM (PreTrainedModel), got {type(hf_model).__name__}."
            )
        nn.Module.__init__(self)
        HookRegistry.__init__(self, sync=self._sync_sites)
        self.hf_model = hf_model
        self.training = hf_model.training  # the bridge reports its model's mode (eval after from_pretrained)
        self.tokenizer = tokenizer
        self.adapter: Adapter = adapter_for(hf_model.config.model_type)
        try:
            self._wrap(hf_model, tokenizer)
        except AttributeError as e:  # a module path, attribute or keyword this transformers release lacks
            raise UnsupportedArchitectureError(
                f"Cannot wrap {type(hf_model).__name__} (config.model_type={hf_model.config.model_type!r}): the "
                f"bridge's adapter for it expects something this model lacks ({e}). Installed: {versions.installed()}."
            ) from e

    def _wrap(self, hf_model: PreTrainedModel, tokenizer: Any) -> None:
        check_tensor_parallel(hf_model)
        self.cfg: BridgeConfig = bridge_config(hf_model, self.adapter, tokenizer)
        # Only checks that the implementation is one the bridge can route; the HF model's config is
        # switched to the bridge's implementation during the bridge's own calls only (`run_model`).
        attention.bridge_implementation(hf_model.config._attn_implementation)
        if self.adapter.ssm is not None:  # state-space blocks: a mixer instead of attention and MLP
            sites = build_ssm_sites(self, hf_model, self.adapter)
        else:
            cfg = self.cfg
            sites = build_sites(
                self, hf_model, self.adapter, cfg.n_heads, cfg.n_kv_heads, cfg.d_head, cfg.parallel_attn_mlp
            )
        self._set_points(sites.points, self.cfg.n_layers)
        self.names.off = self._points_off
        self.names.lazy = lambda: self.cfg.switches.lazy  # `hook_result` under use_attn_result=False: on demand
        self.cfg.switches.attach(self, sites.points)  # hook_dict: the points the switches leave on
        mesh = tp_mesh(hf_model)
        if mesh is not None:  # tensor parallel: hooks on head / neuron points see gathered tensors
            attach_shard_specs(sites.points, mesh, self.cfg)
        self._sites_for = sites.sites_for
        self._stash = sites.stash
        self._live: dict[Any, None] = {}  # sites whose torch hook is attached, checked after each forward
        # `cache` from transformers 5.24 on (`past_key_values` / Mamba's `cache_params` before): see versions.py.
        self._cache_keyword = versions.cache_keyword(type(hf_model))

    def __deepcopy__(self, memo: dict) -> "BridgeCore":
        """A bridge over a deep copy of the HF model, with the same hooks registered on the copy.

        The copy shares the tokenizer and the hook functions (functions are not copied).
        """
        sites = list(dict.fromkeys(s for group in self._sites_for.values() for s in group))
        try:
            for site in sites:  # the copy must not carry this bridge's torch hooks
                site.detach()
            hf_model = copy.deepcopy(self.hf_model, memo)
        finally:
            for site in sites:
                site.sync()
        new = type(self)(hf_model, self.tokenizer)
        new.cfg.assign(self.cfg.assigned())  # the user's cfg settings (default_prepend_bos …) carry over
        for point in self.hook_dict.values():
            for entry in [*point.fwd_hooks, *point.bwd_hooks]:
                new.add_hook(point.name, entry.fn, entry.dir, entry.permanent, entry.read_only)
        return new

    def unwrap(self) -> PreTrainedModel:
        """Remove every hook (permanent ones too) and return the HF model, exactly as it was wrapped.

        Wrapping never changes the HF model: its config (``attn_implementation`` included) and code
        stay the user's; the bridge's torch hooks exist only while hook points have functions.

        Example:
            >>> hf_model = model.unwrap()
        """
        self.reset_hooks(including_permanent=True)
        return self.hf_model

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
        tokenizer: Any = None,
        n_ctx: int | None = None,
        hf_config_overrides: dict[str, Any] | None = None,
        load_weights: bool = True,
        **hf_kwargs: Any,
    ) -> "BridgeCore":
        """Load a local HF folder (or a cached hub name) and wrap it; ``gguf_file=`` passes through, and so
        do ``device_map=`` (``"auto"`` or a dict; with ``max_memory=``, ``offload_folder=``) and
        ``tp_plan="auto"`` (tensor parallelism under ``torchrun``): see docs/scaling.md. TransformerLens'
        loader options (`loading.loader_config`): ``n_ctx`` sets the context length, ``hf_config_overrides``
        HF config fields, ``load_weights=False`` builds the checkpoint's architecture randomly initialised.
        A tokenizer loaded here without a pad token gets its EOS as one (as TransformerLens does); a tokenizer
        you pass is left as it is.

        Example:
            >>> model = TransformerBridge.from_pretrained("path/to/SmolLM2", dtype=torch.float32)
            >>> longer = TransformerBridge.from_pretrained("path/to/SmolLM2", n_ctx=16384)
        """
        device = check_device(device)
        check_local_folder(name_or_path)
        if device is not None and hf_kwargs.get("device_map") is not None:
            raise ValueError(
                f"Give `device`={device!s} or `device_map`={hf_kwargs['device_map']!r}, not both: a device map "
                "already places every layer."
            )
        config = loader_config(name_or_path, n_ctx, hf_config_overrides, load_weights, hf_kwargs)
        if not load_weights:
            hf_model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        else:
            configured = {} if config is None else {"config": config}
            hf_model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, **configured, **hf_kwargs)
        if tokenizer is None:
            tok_kwargs = {k: v for k, v in hf_kwargs.items() if k in ("gguf_file", "revision", "trust_remote_code")}
            try:
                tokenizer = AutoTokenizer.from_pretrained(name_or_path, **tok_kwargs)
                if getattr(tokenizer, "pad_token", None) is None and getattr(tokenizer, "eos_token", None) is not None:
                    tokenizer.pad_token = tokenizer.eos_token  # the id batches are padded with (TransformerLens' load)
            except (OSError, ValueError) as e:
                warnings.warn(
                    f"No tokenizer could be loaded from {name_or_path!r} ({e}); the bridge takes token ids only. "
                    "Pass `tokenizer=` to use text.",
                    stacklevel=2,
                )
        if device is not None:
            hf_model.to(device)
        return cls(hf_model.eval(), tokenizer)

    @classmethod
    def from_config(cls, config: Any, tokenizer: Any = None, dtype: torch.dtype | None = None) -> "BridgeCore":
        """Build a randomly initialised model from a HF config (seed with `torch.manual_seed`).

        Example:
            >>> from transformers import GPT2Config
            >>> model = TransformerBridge.from_config(GPT2Config(n_layer=2, n_embd=32, n_head=4))
        """
        hf_model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        return cls(hf_model.eval(), tokenizer)

    # -- hooks --------------------------------------------------------------------------------
    def _points_off(self) -> dict[str, str]:
        """The points the config switches off (TransformerLens' switches, `split_inputs.SWITCHES`): ``attn.hook_result``
        under ``cfg.use_attn_result=False``, the split-input points while their flag is False. They are not in
        ``hook_dict``, caches leave them out, and naming one raises."""
        return self.cfg.switches.current  # read at every name lookup: kept up to date by each switch, not recomputed

    def _sync_sites(self, *points: HookPoint) -> None:
        """Attach exactly the sites the hooked ``points`` need (the registry's ``sync``): each site once."""
        for site in dict.fromkeys(s for point in points for s in self._sites_for[point.name]):
            site.sync()
            if site.attached:
                self._live[site] = None
            else:
                self._live.pop(site, None)

    def __repr__(self) -> str:
        c = self.cfg
        return (
            f"TransformerBridge({type(self.hf_model).__name__}, n_layers={c.n_layers}, d_model={c.d_model}, "
            f"n_heads={c.n_heads}, n_kv_heads={c.n_kv_heads}, hook points={len(self.hook_dict)})"
        )

    # -- unembedding ---------------------------------------------------------------------------
    @property
    def ln_final_weight(self) -> Float[Tensor, "d_model"]:
        """The final norm's effective weight γ (Gemma's stored ``w`` is used as ``1 + w``)."""
        w = full_param(get_module(self.hf_model, self.adapter.ln_final), "weight")
        if w is None:  # OLMo's LayerNorm has no weight
            return torch.ones(self.cfg.d_model, dtype=self.cfg.dtype, device=self.cfg.device)
        return 1.0 + w.float() if one_plus(self.adapter.norm) else w

    def unembed_directions(self, tokens: Int[Tensor, "..."] | int) -> Float[Tensor, "... d_model"]:
        """``γ ⊙ W_U[:, token]`` for each token: the direction a normalized residual is read along."""
        index = torch.as_tensor(tokens, device=self.device)
        w = full_param(self.hf_model.get_output_embeddings())[index]  # [..., d_model]
        return (w * self.ln_final_weight.to(w.dtype)).detach()

    @property
    def device(self) -> torch.device:
        """Where inputs go: the model's device, or its embedding's under an accelerate device map."""
        return input_device(self.hf_model)

    def prepare_input(
        self,
        input: Input,
        attention_mask: Tensor | None = None,
        prepend_bos: bool | None = None,
        left_padded: bool = False,
        padding_side: PaddingSide | None = None,
    ) -> tuple[Int[Tensor, "batch pos"], Int[Tensor, "batch pos"]]:
        """Normalise any accepted input to ``(tokens [batch, pos], attention_mask [batch, pos])``.

        Text is tokenized and padded as `to_tokens` pads it (``padding_side``, default
        ``cfg.default_padding_side``: right, as in TransformerLens). Token ids may come with a mask
        (``attention_mask=`` or a ``(tokens, mask)`` pair); a given mask must be 0/1 (bool, integer, or float
        0.0/1.0) with at least one real token per row, and ``left_padded=True`` (generation) also requires
        each row's padding to come first. Without a mask every token is real, whatever its id, exactly as
        HF's forward reads ids; only when the caller says the ids are left-padded (``padding_side="left"``,
        or ``cfg.default_padding_side = "left"``, TransformerLens' switch) are leading pad tokens padding
        (`inputs.left_padding_mask`).

        Example:
            >>> tokens, mask = model.prepare_input(["Hi", "Hello there"])
        """
        if padding_side not in (None, "left", "right"):
            raise ValueError(f"`padding_side` must be None, 'left' or 'right', got {describe(padding_side)}.")
        if is_text(input):
            if attention_mask is not None:
                raise ValueError("`attention_mask` is only accepted with token inputs; text is padded for you.")
            return self.to_tokens_and_mask(input, prepend_bos=prepend_bos, padding_side=padding_side)
        if isinstance(input, tuple) and len(input) == 2 and all(isinstance(t, Tensor) for t in input):
            if attention_mask is not None:
                raise ValueError("Give the mask once: a `(tokens, mask)` pair or `attention_mask=`, not both.")
            input, attention_mask = input
        if not isinstance(input, Tensor):
            raise TypeError(
                f"`input` must be a str, a list of str, or a tensor of token ids [batch, pos]; got {describe(input)}."
            )
        tokens = input[None] if input.dim() == 1 else input
        if tokens.dim() != 2 or 0 in tokens.shape:
            raise ValueError(
                f"`input` tokens must have shape [batch, pos] with batch ≥ 1 and pos ≥ 1, got {tuple(input.shape)}."
            )
        if tokens.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
            raise TypeError(f"`input` tokens must be an integer tensor, got dtype {tokens.dtype}.")
        if tokens.device.type == "meta":
            raise ValueError("`input` tokens are on the meta device (no values); give real token ids.")
        low, high = torch.stack(torch.aminmax(tokens)).tolist()  # one device sync on the good path
        if low < 0 or high >= self.cfg.d_vocab:
            bad = low if low < 0 else high
            raise ValueError(f"`input` contains token id {bad}, outside the vocabulary [0, {self.cfg.d_vocab - 1}].")
        if attention_mask is not None:
            attention_mask = check_attention_mask(attention_mask, tokens.shape, left_padded)
        elif (padding_side or self._default_padding_side()) == "left":  # the caller says: left-padded ids
            bos = self.cfg.default_prepend_bos if prepend_bos is None else prepend_bos
            attention_mask = left_padding_mask(tokens, self._known_pad_id(), self.cfg.bos_token_id, bos)
        else:
            attention_mask = torch.ones_like(tokens)
        n_ctx = self.cfg.n_ctx
        if n_ctx is not None and tokens.shape[1] > n_ctx:
            raise ValueError(f"`input` has {tokens.shape[1]} tokens; the model's context limit is {n_ctx}.")
        device = self.device
        return tokens.to(device).long(), attention_mask.to(device).long()

    # -- forward ------------------------------------------------------------------------------
    def run_model(
        self,
        tokens: Int[Tensor, "batch pos"],
        attention_mask: Int[Tensor, "batch key_pos"] | None,
        ctx: HookContext,
        past_key_values: Any = None,
        position_ids: Int[Tensor, "batch pos"] | None = None,
        logits_to_keep: int = 0,
        checked: bool = True,
        use_cache: bool | None = None,
        **hf_kwargs: Any,
    ) -> Any:
        """One HF forward with ``ctx`` visible to hooks. The building block of forward and generate.

        ``attention_mask`` covers cached plus new positions; pass ``None`` when there is no padding
        so HF takes its own fastest path (and its default positions). ``logits_to_keep=1``
        unembeds only the last position, as HF's generate does (0 keeps all). ``checked=False``: the
        caller checks that every hooked site ran (`sites_checked`, around a compiled call of this).
        ``use_cache``: without ``past_key_values``, None leaves it to HF's default exactly as
        ``hf_model(ids)`` does (its config's ``use_cache``: HF then builds a cache it does not return, and
        some kernels see the keys as that cache holds them, so passing False would change the last bits of
        GPT-Neo's logits for some shapes); False is HF generate's ``use_cache=False`` forward.
        """
        if self.adapter.ssm is not None and attention_mask is not None:
            attention_mask = attention_mask[:, -tokens.shape[1] :]  # Mamba masks only its input positions
        # Under torch.compile, reading `_live` is also a guard: compiled code is retraced when hooks come or go.
        armed = arm_sites(self._live) if self._live and checked else None
        try:
            with self.bridged(ctx):
                out = self.hf_model(
                    input_ids=None if "inputs_embeds" in hf_kwargs else tokens,  # embeddings: ``tokens`` give the shape
                    attention_mask=attention_mask,
                    position_ids=position_ids,
                    **self._cache_kwargs(past_key_values, use_cache),
                    logits_to_keep=logits_to_keep,
                    **hf_kwargs,
                )
            if armed:
                check_sites(self.hook_dict, self._sites_for, armed)
        finally:
            if armed:
                disarm_sites(armed)
        return out

    @contextlib.contextmanager
    def bridged(self, ctx: HookContext | None) -> Iterator[None]:
        """Around calls of the HF model: its attention runs through the bridge's registered implementation (so
        attention points can fire), hooks see ``ctx`` as ``hook.ctx``, and the per-forward stash is the call's own.
        `run_model` runs each forward inside it; `hf_generate` runs HF's whole ``generate`` inside it.

        Example:
            >>> with model.bridged(None):
            ...     out = model.hf_model.generate(tokens, max_new_tokens=4)
        """
        config = self.hf_model.config
        users = config._attn_implementation
        # Checked at every call: the user may have switched the HF model's implementation since.
        bridged = attention.bridge_implementation(users)
        outer_stash = dict(self._stash)  # a forward run from inside a hook must not clear the outer one's
        self._stash.clear()
        if self.adapter.attn_registry:  # GPT-J before 5.24, GPT-Neo, Falcon branch on the name: no registry
            config._attn_implementation = bridged
        try:
            with self._context(ctx):
                yield
        finally:
            config._attn_implementation = users
            self._stash.clear()
            self._stash.update(outer_stash)

    def _cache_kwargs(self, past_key_values: Any, use_cache: bool | None) -> dict[str, Any]:
        if past_key_values is not None:
            return {self._cache_keyword: past_key_values, "use_cache": True}
        return {} if use_cache is None else {"use_cache": use_cache}

    @contextlib.contextmanager
    def sites_checked(self) -> Iterator[None]:
        """Around a compiled function that runs `run_model` with ``checked=False``: raise
        `StaleCompiledHooksError` when a hooked site did not run. The check stays outside the compiled
        code, which then has no graph break (each costs a CUDA graph split and a guard check per step).

        Example:
            >>> with model.sites_checked():
            ...     out = model.run_model(tokens, None, HookContext.from_mask(mask), checked=False)
        """
        armed = arm_sites(self._live) if self._live else None
        try:
            yield
            if armed:
                check_sites(self.hook_dict, self._sites_for, armed)
        finally:
            if armed:
                disarm_sites(armed)

    def forward_tokens(
        self,
        tokens: Int[Tensor, "batch pos"],
        mask: Int[Tensor, "batch pos"],
        ctx: HookContext | None = None,
        logits_to_keep: int = 0,
        stop_at_layer: int | None = None,
        start_at_layer: int | None = None,
        residual: Float[Tensor, "batch pos d_model"] | None = None,
        explicit_positions: bool = False,
        mask_4d: Tensor | None = None,
        **hf_kwargs: Any,
    ) -> Any:
        """Logits for prepared tokens (see `prepare_input`); what `forward` and every caching run call.

        The mask is passed only when it has zeros, and positions (``ctx.positions``: ``cumsum(mask) - 1`` in
        rows with padding before a real token) only when some row has such padding, so an unpadded or
        right-padded batch takes HF's own path. ``ctx`` defaults to a plain-forward context. ``mask_4d``: a
        4-D mask (`inputs.split_4d_mask`, ``mask`` its token mask) handed to HF in place of ``mask``, with
        HF's default positions unless ``explicit_positions``.
        ``stop_at_layer=L`` returns the residual stream entering block ``L`` (``n_layers``: before
        the final norm) without computing the rest; ``start_at_layer=K`` feeds ``residual`` into
        block ``K``. With ``hf_kwargs`` (``output_hidden_states``) HF's output object is returned.
        ``explicit_positions``: ``ctx.positions`` are the caller's ``position_ids``, passed to HF even unpadded.
        """
        ctx = ctx or HookContext.from_mask(mask, hf_positions=mask_4d is not None)
        padded = not bool(mask.all())
        derives = self.adapter.positions_from_mask  # OPT reads positions off a 2-D mask (not off a 4-D one)
        if explicit_positions or (mask_4d is not None and derives):
            positions = ctx.positions
        elif mask_4d is None and padded and not derives:  # rows without padding before a real token: HF's own
            default = torch.arange(mask.shape[-1], device=ctx.positions.device)
            positions = ctx.positions if bool((ctx.positions != default).any()) else None
        else:
            positions = None
        if mask_4d is not None:
            hf_mask = mask_for_implementation(mask_4d, self.hf_model.config._attn_implementation, self.cfg.dtype)
        else:
            hf_mask = mask if padded else None
        n = self.cfg.n_layers
        blocks = get_module(self.hf_model, self.adapter.blocks)
        with contextlib.ExitStack() as stack:
            if stop_at_layer is not None:
                stop = check_layer(stop_at_layer, n, "stop_at_layer")
                where = blocks[stop] if stop < n else get_module(self.hf_model, self.adapter.ln_final)
                stack.enter_context(stop_before(where, skip=int(stop == n and self.adapter.embed_norm)))
            if start_at_layer is not None:
                start = check_layer(start_at_layer, n, "start_at_layer")
                if start == n:
                    raise ArgumentIndexError(
                        f"`start_at_layer`={start_at_layer} is out of range: start at a block, 0..{n - 1}."
                    )
                stack.enter_context(start_at(blocks[start], residual))
                stack.enter_context(self._starting_at(start))
            try:
                out = self.run_model(
                    tokens, hf_mask, ctx, position_ids=positions, logits_to_keep=logits_to_keep,
                    **hf_kwargs,
                )  # fmt: skip
            except StopForward as stopped:
                return stopped.residual
        return out if hf_kwargs else out.logits

    @contextlib.contextmanager
    def _starting_at(self, layer: int) -> Iterator[None]:
        previous, self.start_layer = self.start_layer, layer
        try:
            yield
        finally:
            self.start_layer = previous

    def cache_forward(
        self,
        tokens: Int[Tensor, "batch pos"],
        mask: Int[Tensor, "batch pos"],
        names: Sequence[str],
        device: torch.device | None = None,
        pos_slice: int | slice | Sequence[int] | None = None,
        ctx: HookContext | None = None,
        logits_to_keep: int = 0,
        stop_at_layer: int | None = None,
        reset_hooks_end: bool = True,
        mask_4d: Tensor | None = None,
        grad: bool = False,
    ) -> tuple[Float[Tensor, "batch pos d_vocab"], dict[str, Tensor]]:
        """The caching forward shared by `run_with_cache` and `generate(return_cache=True)`.

        Active hooks plus caching hooks on ``names`` (canonical), under ``no_grad`` (not ``inference_mode``, whose
        tensors cannot meet parameters in autograd later) or, with ``grad``, the caller's grad mode. With
        ``reset_hooks_end=False`` the caching hooks stay (until `reset_hooks`) and later forwards refill the dict.
        """
        store = CacheWriter(device, pos_slice)
        if logits_to_keep and any(n.startswith("unembed.") for n in names):  # lm_head's points show every position
            logits_to_keep = 0
        caching = [(n, store.hook) for n in names]
        autograd = torch.enable_grad() if grad and torch.is_grad_enabled() else torch.no_grad()
        with self.hooks(fwd_hooks=caching, read_only=True, reset_hooks_end=reset_hooks_end), autograd:
            logits = self.forward_tokens(tokens, mask, ctx, logits_to_keep, stop_at_layer, mask_4d=mask_4d)
        return logits, store.tensors

    def names_matching(self, names_filter: NamesFilter, param: str = "names_filter") -> list[str]:
        """Canonical hook names selected by a filter: None (all), a name, a shorthand such as
        ``"resid_post"`` (every layer) or ``("resid_post", 3)``, a list of those, or a predicate.

        Example:
            >>> model.names_matching("pattern")       # blocks.*.attn.hook_pattern
        """
        return self.names.select(names_filter, param)
