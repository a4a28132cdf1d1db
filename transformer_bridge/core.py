"""`BridgeCore`: wrap/load an unmodified HF causal LM, tokens, forward, hooks and caches.

The core imports neither generation nor relevance: those are functions over a `BridgeCore`, and
`TransformerBridge` (``bridge.py``) is the public class that ties them together.
"""

import contextlib
import copy
import dataclasses
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn
from transformers import AutoModelForCausalLM, AutoTokenizer, Cache, DynamicCache, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from . import attention, versions
from .adapters import Adapter, UnsupportedArchitectureError, adapter_for
from .cache import ActivationCache, check_pos_slice
from .caching import CacheWriter, next_token_loss, next_token_losses
from .checks import ArgumentIndexError, check_device, describe, suggest_keywords
from .config import BridgeConfig, bridge_config
from .distributed import attach_shard_specs, full_param, input_device, tp_mesh
from .hook_points import HookContext, HookPoint, HookRegistry, NameOrFilter
from .inputs import PaddingSide, check_attention_mask, left_padding_mask
from .layers import StopForward, check_layer, start_at, stop_before
from .names import NameFilter
from .sites import arm_sites, build_sites, check_sites, disarm_sites, get_module
from .ssm import build_ssm_sites
from .tokens import Tokens

Input = str | Sequence[str] | Tensor
NamesFilter = NameFilter


class BridgeCore(nn.Module, HookRegistry, Tokens):
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
        HookRegistry.__init__(self)
        self.hf_model = hf_model
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
        self.cfg: BridgeConfig = bridge_config(hf_model, self.adapter, tokenizer)
        # Only checks that the implementation is one the bridge can route; the HF model's config is
        # switched to the bridge's implementation during the bridge's own calls only (`run_model`).
        attention.bridge_implementation(hf_model.config._attn_implementation)
        if self.adapter.ssm is not None:  # state-space blocks: a mixer instead of attention and MLP
            sites = build_ssm_sites(self, hf_model, self.adapter)
        else:
            sites = build_sites(
                self,
                hf_model,
                self.adapter,
                self.cfg.n_heads,
                self.cfg.n_kv_heads,
                self.cfg.d_head,
                self.cfg.parallel_attn_mlp,
            )
        self._set_points(sites.points, self.cfg.n_layers)
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
        **hf_kwargs: Any,
    ) -> "BridgeCore":
        """Load a local HF folder (or a cached hub name) and wrap it; ``gguf_file=`` passes through, and so
        do ``device_map=`` (``"auto"`` or a dict; with ``max_memory=``, ``offload_folder=``) and
        ``tp_plan="auto"`` (tensor parallelism under ``torchrun``): see docs/scaling.md.

        Example:
            >>> model = TransformerBridge.from_pretrained("path/to/SmolLM2", dtype=torch.float32)
        """
        device = check_device(device)
        if device is not None and hf_kwargs.get("device_map") is not None:
            raise ValueError(
                f"Give `device`={device!s} or `device_map`={hf_kwargs['device_map']!r}, not both: a device map "
                "already places every layer."
            )
        hf_model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, **hf_kwargs)
        if tokenizer is None:
            tok_kwargs = {k: v for k, v in hf_kwargs.items() if k in ("gguf_file", "revision", "trust_remote_code")}
            try:
                tokenizer = AutoTokenizer.from_pretrained(name_or_path, **tok_kwargs)
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
    def _sync(self, point: HookPoint) -> None:
        for site in self._sites_for[point.name]:
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
        return 1.0 + w.float() if self.adapter.norm == "rms_one_plus" else w

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

        Text is tokenized and padded (left, or ``padding_side``). Token ids may come with a mask
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
        if isinstance(input, str) or (isinstance(input, (list, tuple)) and input and isinstance(input[0], str)):
            if attention_mask is not None:
                raise ValueError("`attention_mask` is only accepted with token inputs; text is padded for you.")
            return self.to_tokens_and_mask(input, prepend_bos=prepend_bos, padding_side=padding_side or "left")
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
        elif (padding_side or self.cfg.default_padding_side) == "left":  # the caller says: left-padded ids
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
        **hf_kwargs: Any,
    ) -> Any:
        """Logits for prepared tokens (see `prepare_input`); what `forward` and every caching run call.

        Padding positions (``cumsum(mask) - 1``) and the mask are passed only when ``mask`` has zeros,
        so an unpadded batch takes HF's own path. ``ctx`` defaults to a plain-forward context.
        ``stop_at_layer=L`` returns the residual stream entering block ``L`` (``n_layers``: before
        the final norm) without computing the rest; ``start_at_layer=K`` feeds ``residual`` into
        block ``K``. With ``hf_kwargs`` (``output_hidden_states``) HF's output object is returned.
        ``explicit_positions``: ``ctx.positions`` are the caller's ``position_ids``, passed to HF even unpadded.
        """
        ctx = ctx or HookContext.from_mask(mask)
        padded = not bool(mask.all())
        positions = ctx.positions if padded or explicit_positions else None
        n = self.cfg.n_layers
        blocks = get_module(self.hf_model, self.adapter.blocks)
        with contextlib.ExitStack() as stack:
            if stop_at_layer is not None:
                stop = check_layer(stop_at_layer, n, "stop_at_layer")
                where = blocks[stop] if stop < n else get_module(self.hf_model, self.adapter.ln_final)
                stack.enter_context(stop_before(where))
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
                    tokens, mask if padded else None, ctx, position_ids=positions, logits_to_keep=logits_to_keep,
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
    ) -> tuple[Float[Tensor, "batch pos d_vocab"], dict[str, Tensor]]:
        """The caching forward shared by `run_with_cache` and `generate(return_cache=True)`.

        Runs under the active hooks plus caching hooks on ``names`` (canonical), without autograd.
        Returns the logits and the cached tensors; `run_with_cache` is the user-facing form.
        """
        store = CacheWriter(device, pos_slice)
        # no_grad, not inference_mode: inference tensors cannot meet parameters in autograd later.
        with self.hooks(fwd_hooks=[(n, store.hook) for n in names], read_only=True), torch.no_grad():
            logits = self.forward_tokens(tokens, mask, ctx, logits_to_keep, stop_at_layer=stop_at_layer)
        return logits, store.tensors

    @suggest_keywords
    def forward(
        self,
        input: Input | None = None,
        return_type: Literal["logits", "loss", "both", "logits_and_cache"] | None = "logits",
        loss_per_token: bool = False,
        prepend_bos: bool | None = None,
        padding_side: PaddingSide | None = None,
        start_at_layer: int | None = None,
        tokens: Int[Tensor, "batch pos"] | None = None,
        attention_mask: Int[Tensor, "batch pos"] | None = None,
        stop_at_layer: int | None = None,
        *,
        input_ids: Int[Tensor, "batch pos"] | None = None,
        token_type_ids: Tensor | None = None,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
        position_ids: Int[Tensor, "batch pos"] | None = None,
        past_key_values: Cache | None = None,
        past_kv_cache: Any = None,
    ) -> Any:
        """Logits ``[batch, pos, d_vocab]``, TransformerLens' ``forward`` with HF's keywords too.

        ``input``: text (BOS per ``prepend_bos``, default ``cfg.default_prepend_bos``), a list of texts
        (left-padded, or ``padding_side``), token ids (``input_ids=`` too, HF style, with
        ``attention_mask``; ``**tokenizer(texts, return_tensors="pt", padding=True)`` works), or,
        with ``start_at_layer=K``, the residual stream ``[batch, pos, d_model]`` entering block ``K``
        (``tokens`` / ``attention_mask`` then give padding and the loss). ``return_type``: ``"logits"``,
        ``"loss"`` (mean next-token loss over real tokens, ``[batch, pos - 1]`` with
        ``loss_per_token``), ``"both"`` or ``None``. ``stop_at_layer=L`` returns the residual stream
        entering block ``L`` without computing the rest (negative counts from the end;
        ``n_layers``: before the final norm). ``output_hidden_states`` / ``output_attentions`` return
        HF's output object (``.logits``, ``.hidden_states``, ``.attentions``, the latter read from
        ``hook_pattern``). ``position_ids`` ``[batch, pos]`` (the tokens' shape) replace the positions
        derived from the mask, as in HF; ``hook.ctx.positions`` shows them. ``past_kv_cache``: TransformerLens'
        `TransformerLensKeyValueCache` (`transformer_bridge.compat.kv_cache`): ``input`` holds the new tokens only
        (``attention_mask`` too), and the cache grows unless frozen. ``return_type="logits_and_cache"``
        returns ``(logits, kv_cache)``, an HF ``DynamicCache``; giving it back as ``past_key_values=`` with the
        next token ids and an ``attention_mask`` over past and new tokens runs one cached step (the cache grows
        in place, as HF's does), positions counted from the mask: the logits of the whole sequence's last rows.

        Example:
            >>> logits = model("The capital of France is")
            >>> resid = model("The capital of France is", stop_at_layer=3)     # [1, pos, d_model]
            >>> logits = model(resid, start_at_layer=3)
        """
        if past_kv_cache is not None:  # TransformerLens' cache object runs the cached step (compat.kv_cache)
            if not callable(getattr(past_kv_cache, "bridge_forward", None)) or past_key_values is not None:
                raise TypeError(f"`past_kv_cache` takes a TransformerLensKeyValueCache, not {describe(past_kv_cache)}")
            tl_args = (prepend_bos, padding_side, return_type, loss_per_token, start_at_layer, stop_at_layer)
            return past_kv_cache.bridge_forward(self, input_ids if input is None else input, attention_mask, *tl_args)
        if return_type == "logits_and_cache" or past_key_values is not None:
            if stop_at_layer is not None or start_at_layer is not None or output_hidden_states or output_attentions:
                raise ValueError(
                    "A KV-cached forward (`past_key_values` / return_type='logits_and_cache') runs the whole model: "
                    "it takes no `stop_at_layer`, `start_at_layer`, `output_hidden_states` or `output_attentions`."
                )
            return self._kv_forward(input_ids if input is None else input, attention_mask, prepend_bos,
                                    past_key_values, return_type)  # fmt: skip
        if return_type not in ("logits", "loss", "both", None):
            raise ValueError(
                f"`return_type` must be 'logits', 'loss', 'both', 'logits_and_cache' or None, got {return_type!r}."
            )
        if input_ids is not None:
            if input is not None:
                raise ValueError("Give the tokens once: `input` or `input_ids`, not both.")
            input = input_ids
        if token_type_ids is not None and bool(token_type_ids.any()):
            raise ValueError("`token_type_ids` must be all zeros (or None): decoder-only models take no segments.")
        residual = None
        if start_at_layer is not None:
            residual, input = input, tokens
            if not isinstance(residual, Tensor) or residual.dim() != 3 or residual.shape[-1] != self.cfg.d_model:
                raise ValueError(
                    f"With `start_at_layer`, `input` is a residual-stream tensor [batch, pos, {self.cfg.d_model}], got "
                    f"{describe(residual)}."
                )
            if input is None:
                input = torch.zeros(residual.shape[:2], dtype=torch.long, device=residual.device)
        if input is None:
            raise TypeError("forward() needs `input` (text or token ids) or `input_ids`.")
        tokens, mask = self.prepare_input(input, attention_mask, prepend_bos, padding_side=padding_side)
        ctx = None
        if position_ids is not None:
            if (
                not isinstance(position_ids, Tensor)
                or position_ids.shape != tokens.shape
                or position_ids.is_floating_point()
            ):
                raise ValueError(
                    f"`position_ids` must be an integer tensor of the tokens' shape {tuple(tokens.shape)}, got "
                    f"{describe(position_ids)}."
                )
            position_ids = position_ids.to(tokens.device)
            ctx = dataclasses.replace(HookContext.from_mask(mask), positions=position_ids)
        hf_kwargs = {"output_hidden_states": True} if output_hidden_states else {}
        patterns: dict[str, Tensor] = {}
        with contextlib.ExitStack() as stack:
            if output_attentions:
                keep = CacheWriter(None)
                stack.enter_context(self.hooks(fwd_hooks=[("pattern", keep.hook)], read_only=True))
                patterns = keep.tensors
            out = self.forward_tokens(
                tokens, mask, ctx, stop_at_layer=stop_at_layer, start_at_layer=start_at_layer, residual=residual,
                explicit_positions=position_ids is not None, **hf_kwargs,
            )  # fmt: skip
        if stop_at_layer is not None or return_type is None:
            return None if return_type is None and stop_at_layer is None else out
        if output_hidden_states or output_attentions:
            result = out if hf_kwargs else CausalLMOutputWithPast(logits=out)
            if output_attentions:
                result.attentions = tuple(patterns[f"blocks.{i}.attn.hook_pattern"] for i in range(self.cfg.n_layers))
            return result
        logits = out
        if return_type == "logits":
            return logits
        loss = next_token_losses(logits, tokens, mask) if loss_per_token else next_token_loss(logits, tokens, mask)
        return loss if return_type == "loss" else (logits, loss)

    def _kv_forward(
        self, input: Input, attention_mask: Tensor | None, prepend_bos: bool | None, past: Cache | None,
        return_type: str | None,
    ) -> Any:  # fmt: skip
        """`forward` with HF's KV cache: a prefill (``past`` None) or a step on ``past``; see `forward`."""
        if return_type not in ("logits", "logits_and_cache"):
            raise ValueError(
                f"A KV-cached forward returns 'logits' or 'logits_and_cache', got `return_type`={return_type!r}."
            )
        if self.adapter.ssm is not None:
            raise ValueError("`past_key_values` / 'logits_and_cache' is for attention models; use generate() here.")
        if past is not None and not isinstance(past, Cache):
            raise TypeError(
                f"`past_key_values` must be the HF cache a 'logits_and_cache' forward returned, got {describe(past)}."
            )
        n_past = 0 if past is None else past.get_seq_length()
        if n_past == 0:
            tokens, mask = self.prepare_input(input, attention_mask, prepend_bos)
            past = DynamicCache(config=self.hf_model.config) if past is None else past
        else:
            if not isinstance(input, Tensor) or input.dim() != 2 or input.is_floating_point():
                raise TypeError(f"A cached step takes the new token ids [batch, new], got {describe(input)}.")
            tokens = input.to(input_device(self.hf_model))
            expected = (tokens.shape[0], n_past + tokens.shape[1])
            mask = (
                torch.ones(expected, dtype=torch.long, device=tokens.device)
                if attention_mask is None
                else attention_mask
            )
            if tuple(mask.shape) != expected:
                raise ValueError(
                    f"`attention_mask` of a cached step covers the {n_past} cached and {tokens.shape[1]} new "
                    f"positions: shape {expected}, got {tuple(mask.shape)}."
                )
            mask = check_attention_mask(mask.to(tokens.device), torch.Size(expected))
        full = HookContext.from_mask(mask, phase="prefill" if n_past == 0 else "decode")
        new = slice(n_past, None)
        ctx = HookContext(full.phase, 0, full.positions[:, new], full.pad_mask[:, new], full.is_generated[:, new])
        padded = not bool(mask.all())
        out = self.run_model(tokens, mask if padded else None, ctx, past_key_values=past,
                             position_ids=ctx.positions if padded else None)  # fmt: skip
        return (out.logits, past) if return_type == "logits_and_cache" else out.logits

    def input_to_embed(
        self,
        input: Input,
        prepend_bos: bool | None = None,
        padding_side: PaddingSide | None = None,
        attention_mask: Int[Tensor, "batch pos"] | None = None,
    ) -> tuple[Float[Tensor, "batch pos d_model"], Int[Tensor, "batch pos"], None, Int[Tensor, "batch pos"]]:
        """TransformerLens' ``(residual, tokens, shortformer_pos_embed, attention_mask)``: the residual
        stream entering block 0 (embedding, position embedding and Gemma's scaling included).

        Example:
            >>> residual, tokens, _, mask = model.input_to_embed("Hello")
            >>> logits = model(residual, start_at_layer=0, tokens=tokens)
        """
        tokens, mask = self.prepare_input(input, attention_mask, prepend_bos, padding_side=padding_side)
        residual = self.forward_tokens(tokens, mask, stop_at_layer=0)
        return residual, tokens, None, mask

    def run_with_hooks(
        self,
        input: Input,
        fwd_hooks: Sequence[tuple[NameOrFilter, Callable]] = (),
        bwd_hooks: Sequence[tuple[NameOrFilter, Callable]] = (),
        reset_hooks_end: bool = True,
        clear_contexts: bool = False,
        **forward_kwargs: Any,
    ) -> Any:
        """Run a forward with temporary hooks (removed afterwards, also on error); ``forward_kwargs``
        go to `forward` (``return_type=None``, ``stop_at_layer`` …).

        Example:
            >>> zero = lambda z, hook: z * 0
            >>> logits = model.run_with_hooks("Hi", fwd_hooks=[("blocks.0.attn.hook_z", zero)])
        """
        with self.hooks(fwd_hooks, bwd_hooks, reset_hooks_end=reset_hooks_end, clear_contexts=clear_contexts):
            return self(input, **forward_kwargs)

    def names_matching(self, names_filter: NamesFilter, param: str = "names_filter") -> list[str]:
        """Canonical hook names selected by a filter: None (all), a name, a shorthand such as
        ``"resid_post"`` (every layer) or ``("resid_post", 3)``, a list of those, or a predicate.

        Example:
            >>> model.names_matching("pattern")       # blocks.*.attn.hook_pattern
        """
        return self.names.select(names_filter, param)

    def run_with_cache(
        self,
        input: Input,
        names_filter: NamesFilter = None,
        device: str | torch.device | None = None,
        remove_batch_dim: bool = False,
        incl_bwd: bool = False,
        pos_slice: int | slice | Sequence[int] | None = None,
        attention_mask: Int[Tensor, "batch pos"] | None = None,
        metric: Callable[[Tensor], Tensor] | None = None,
        prepend_bos: bool | None = None,
        stop_at_layer: int | None = None,
    ) -> tuple[Float[Tensor, "batch pos d_vocab"], ActivationCache]:
        """Forward and cache activations: ``(logits, ActivationCache)``.

        ``stop_at_layer=L`` stops before block ``L`` (nothing after it is computed, see `forward`) and
        returns ``(residual stream entering block L, cache of what ran)``.

        Each activation is stored once (aliases such as ``resid_pre[l+1]`` / ``resid_post[l]``
        share storage) on ``device`` as it is produced; the model is never moved. Without
        ``incl_bwd`` no autograd graph is kept. With it, ``metric(logits)`` (default: next-token
        loss) is backpropagated and gradients are stored under ``<name>_grad``.

        Example:
            >>> logits, cache = model.run_with_cache("Hello world", names_filter=lambda n: "resid" in n)
            >>> cache["resid_post", 0].shape
        """
        device = check_device(device)
        if remove_batch_dim and isinstance(input, (list, tuple)) and len(input) != 1:
            raise ValueError("`remove_batch_dim=True` needs a batch of one; got a batch of several inputs.")
        if metric is not None and not incl_bwd:
            raise ValueError("`metric` is backpropagated only with `incl_bwd=True`; add it or drop `metric`.")
        if metric is not None and not callable(metric):
            raise TypeError(f"`metric` must be callable as metric(logits) -> scalar tensor, got {describe(metric)}.")
        names = self.names_matching(names_filter)
        tokens, mask = self.prepare_input(input, attention_mask, prepend_bos)
        if pos_slice is not None:
            pos_slice = check_pos_slice(pos_slice, tokens.shape[1])
        if remove_batch_dim and tokens.shape[0] != 1:
            raise ValueError(f"`remove_batch_dim=True` needs a batch of one, got batch {tokens.shape[0]}.")
        if incl_bwd:
            store = CacheWriter(device, pos_slice)
            fwd = [(n, store.hook) for n in names]
            with self.hooks(fwd_hooks=fwd, bwd_hooks=[(n, store.grad_hook) for n in names], read_only=True):
                logits = self.forward_tokens(tokens, mask, stop_at_layer=stop_at_layer)
                if metric is None and stop_at_layer is not None:
                    raise ValueError(
                        "With `stop_at_layer`, give `metric` (the output is a residual stream, not logits)."
                    )
                target = metric(logits) if metric is not None else next_token_loss(logits, tokens, mask)
                if not isinstance(target, Tensor) or target.numel() != 1:
                    raise ValueError(
                        f"`metric` must return a scalar tensor to backpropagate, got {describe(target)}"
                        + (f" of shape {tuple(target.shape)}" if isinstance(target, Tensor) else "")
                        + "; reduce it, e.g. with .sum() or .mean()."
                    )
                if not target.requires_grad:
                    raise ValueError(
                        "The value to backpropagate has no grad_fn: `metric` does not use the logits, or no "
                        "parameter requires grad (a frozen model); use the logits, or unfreeze the parameters."
                    )
                target.reshape(()).backward()
            logits, tensors = logits.detach(), store.tensors
        else:
            logits, tensors = self.cache_forward(tokens, mask, names, device, pos_slice, stop_at_layer=stop_at_layer)
        cache = ActivationCache(tensors, self, attention_mask=mask.to(device or mask.device))
        return logits, (cache.remove_batch_dim() if remove_batch_dim else cache)
