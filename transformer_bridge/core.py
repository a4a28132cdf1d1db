"""`BridgeCore`: wrap/load an unmodified HF causal LM, tokens, forward, hooks and caches.

The core imports neither generation nor relevance: those are functions over a `BridgeCore`, and
`TransformerBridge` (``bridge.py``) is the public class that ties them together.
"""

import copy
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from . import attention
from .adapters import Adapter, adapter_for
from .cache import ActivationCache, check_pos_slice
from .checks import check_device, describe
from .hook_points import HookContext, HookPoint, HookRegistry, NameOrFilter
from .names import NameFilter
from .sites import build_sites, get_module

Input = str | Sequence[str] | Tensor
NamesFilter = NameFilter


@dataclass(frozen=True)
class BridgeConfig:
    """Sizes of the wrapped model, in the project's dimension vocabulary."""

    model_type: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_mlp: int
    d_vocab: int
    n_ctx: int | None
    parallel_attn_mlp: bool
    gated_mlp: bool
    normalization: str


class BridgeCore(nn.Module, HookRegistry):
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
        self.cfg = _bridge_config(hf_model, self.adapter)
        # Only checks that the implementation is one the bridge can route; the HF model's config is
        # switched to the bridge's implementation during the bridge's own calls only (`run_model`).
        attention.bridge_implementation(hf_model.config._attn_implementation)
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
        self._sites_for = sites.sites_for
        self._stash = sites.stash

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
        """Load a local HF folder (or a cached hub name) and wrap it; ``gguf_file=`` passes through.

        Example:
            >>> model = TransformerBridge.from_pretrained("path/to/SmolLM2", dtype=torch.float32)
        """
        device = check_device(device)
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

    def __repr__(self) -> str:
        c = self.cfg
        return (
            f"TransformerBridge({type(self.hf_model).__name__}, n_layers={c.n_layers}, d_model={c.d_model}, "
            f"n_heads={c.n_heads}, n_kv_heads={c.n_kv_heads}, hook points={len(self.hook_dict)})"
        )

    # -- tokens -------------------------------------------------------------------------------
    def _require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError(
                "This bridge has no tokenizer, so it cannot take text. Pass token ids, or build it with "
                "`TransformerBridge(hf_model, tokenizer)`."
            )
        return self.tokenizer

    @property
    def pad_token_id(self) -> int:
        tok = self.tokenizer
        for value in (
            getattr(tok, "pad_token_id", None),
            getattr(tok, "eos_token_id", None),
            getattr(self.hf_model.config, "pad_token_id", None),
        ):
            if isinstance(value, int):
                return value
        return 0

    def to_tokens(
        self, input: str | Sequence[str], prepend_bos: bool | None = None
    ) -> tuple[Int[Tensor, "batch pos"], Int[Tensor, "batch pos"]]:
        """Tokenize text into a left-padded batch; returns ``(tokens, attention_mask)``.

        ``prepend_bos=None`` follows the tokenizer's own convention (``add_special_tokens``);
        ``True`` makes sure every row starts with BOS; ``False`` adds no special tokens.

        Example:
            >>> tokens, mask = model.to_tokens(["Hello", "The capital of France is"])
        """
        tok = self._require_tokenizer()
        texts = [input] if isinstance(input, str) else list(input)
        if not texts or not all(isinstance(t, str) for t in texts):
            raise TypeError(f"`input` must be a str or a non-empty list of str, got {describe(input)}.")
        rows = [tok(t, add_special_tokens=prepend_bos is not False)["input_ids"] for t in texts]
        bos = getattr(tok, "bos_token_id", None)
        if prepend_bos and bos is not None:
            rows = [r if r[:1] == [bos] else [bos, *r] for r in rows]
        if any(len(r) == 0 for r in rows):
            raise ValueError("`input` contains a string that tokenizes to no tokens; give it some text or BOS.")
        width = max(len(r) for r in rows)
        tokens = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            tokens[i, width - len(r) :] = torch.tensor(r)
            mask[i, width - len(r) :] = 1
        return tokens.to(self.device), mask.to(self.device)

    def to_string(self, tokens: Int[Tensor, "... pos"] | Sequence[int]) -> str | list[str]:
        """Decode tokens: one sequence → str, a batch → list of str (special tokens kept)."""
        tok = self._require_tokenizer()
        t = torch.as_tensor(tokens)
        if t.dim() <= 1:
            return tok.decode(t.reshape(-1).tolist())
        return [tok.decode(row.tolist()) for row in t]

    def to_str_tokens(
        self, input: str | Int[Tensor, "pos"] | Sequence[int], prepend_bos: bool | None = None
    ) -> list[str]:
        """The string of each token: ``model.to_str_tokens("Hi there") == ["Hi", " there"]``."""
        tok = self._require_tokenizer()
        if isinstance(input, str):
            tokens, _ = self.to_tokens(input, prepend_bos=prepend_bos)
            ids = tokens[0].tolist()
        else:
            t = torch.as_tensor(input)
            if t.dim() > 1:
                if t.shape[0] != 1:
                    raise ValueError(f"`input` must be one sequence, got a batch of shape {tuple(t.shape)}.")
                t = t[0]
            ids = t.tolist()
        return [tok.decode([i]) for i in ids]

    def to_single_token(self, string: str) -> int:
        """The id of a string that is exactly one token (no special tokens added)."""
        tok = self._require_tokenizer()
        ids = tok(string, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise ValueError(f"`string`={string!r} is {len(ids)} tokens ({ids}), not exactly one.")
        return ids[0]

    # -- unembedding ---------------------------------------------------------------------------
    @property
    def W_U(self) -> Float[Tensor, "d_model d_vocab"]:  # noqa: N802 (TransformerLens name)
        """Unembedding matrix."""
        return self.hf_model.get_output_embeddings().weight.T

    @property
    def b_U(self) -> Float[Tensor, "d_vocab"] | None:  # noqa: N802
        """Unembedding bias, or None."""
        return getattr(self.hf_model.get_output_embeddings(), "bias", None)

    @property
    def ln_final_weight(self) -> Float[Tensor, "d_model"]:
        """The final norm's effective weight γ (Gemma's stored ``w`` is used as ``1 + w``)."""
        w = get_module(self.hf_model, self.adapter.ln_final).weight
        return 1.0 + w.float() if self.adapter.norm == "rms_one_plus" else w

    def unembed_directions(self, tokens: Int[Tensor, "..."] | int) -> Float[Tensor, "... d_model"]:
        """``γ ⊙ W_U[:, token]`` for each token: the direction a normalized residual is read along."""
        index = torch.as_tensor(tokens, device=self.device)
        w = self.hf_model.get_output_embeddings().weight[index]  # [..., d_model]
        return (w * self.ln_final_weight.to(w.dtype)).detach()

    @property
    def device(self) -> torch.device:
        return next(self.hf_model.parameters()).device

    def prepare_input(
        self,
        input: Input,
        attention_mask: Tensor | None = None,
        prepend_bos: bool | None = None,
        left_padded: bool = False,
    ) -> tuple[Int[Tensor, "batch pos"], Int[Tensor, "batch pos"]]:
        """Normalise any accepted input to ``(tokens [batch, pos], attention_mask [batch, pos])``.

        A given ``attention_mask`` must be 0/1 (bool or integer, or float 0.0/1.0) with at least
        one real token per row; ``left_padded=True`` (generation) also requires each row's padding
        to come first.

        Example:
            >>> tokens, mask = model.prepare_input(["Hi", "Hello there"])
        """
        if isinstance(input, str) or (isinstance(input, (list, tuple)) and input and isinstance(input[0], str)):
            if attention_mask is not None:
                raise ValueError("`attention_mask` is only accepted with token inputs; text is padded for you.")
            return self.to_tokens(input, prepend_bos=prepend_bos)
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
        if attention_mask is None:
            attention_mask = torch.ones_like(tokens)
        else:
            attention_mask = check_attention_mask(attention_mask, tokens.shape, left_padded)
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
    ) -> Any:
        """One HF forward with ``ctx`` visible to hooks. The building block of forward and generate.

        ``attention_mask`` covers cached plus new positions; pass ``None`` when there is no padding
        so HF takes its own fastest path (and its default positions). ``logits_to_keep=1``
        unembeds only the last position, as HF's generate does (0 keeps all).
        """
        config = self.hf_model.config
        users = config._attn_implementation
        # Checked at every call: the user may have switched the HF model's implementation since.
        bridged = attention.bridge_implementation(users)
        outer_stash = dict(self._stash)  # a forward run from inside a hook must not clear the outer one's
        self._stash.clear()
        config._attn_implementation = bridged
        try:
            with self._context(ctx):
                return self.hf_model(
                    input_ids=tokens,
                    attention_mask=attention_mask,
                    position_ids=position_ids,
                    past_key_values=past_key_values,
                    use_cache=past_key_values is not None,
                    logits_to_keep=logits_to_keep,
                )
        finally:
            config._attn_implementation = users
            self._stash.clear()
            self._stash.update(outer_stash)

    def forward_tokens(
        self,
        tokens: Int[Tensor, "batch pos"],
        mask: Int[Tensor, "batch pos"],
        ctx: HookContext | None = None,
        logits_to_keep: int = 0,
    ) -> Float[Tensor, "batch pos d_vocab"]:
        """Logits for prepared tokens (see `prepare_input`); what `forward` and every caching run call.

        Padding positions (``cumsum(mask) - 1``) and the mask are passed only when ``mask`` has zeros,
        so an unpadded batch takes HF's own path. ``ctx`` defaults to a plain-forward context.
        """
        ctx = ctx or HookContext.from_mask(mask)
        padded = not bool(mask.all())
        positions = ctx.positions if padded else None
        out = self.run_model(
            tokens, mask if padded else None, ctx, position_ids=positions, logits_to_keep=logits_to_keep
        )
        return out.logits

    def cache_forward(
        self,
        tokens: Int[Tensor, "batch pos"],
        mask: Int[Tensor, "batch pos"],
        names: Sequence[str],
        device: torch.device | None = None,
        pos_slice: int | slice | Sequence[int] | None = None,
        ctx: HookContext | None = None,
        logits_to_keep: int = 0,
    ) -> tuple[Float[Tensor, "batch pos d_vocab"], dict[str, Tensor]]:
        """The caching forward shared by `run_with_cache` and `generate(return_cache=True)`.

        Runs under the active hooks plus caching hooks on ``names`` (canonical), without autograd.
        Returns the logits and the cached tensors; `run_with_cache` is the user-facing form.
        """
        store = CacheWriter(device, pos_slice)
        # no_grad, not inference_mode: inference tensors cannot meet parameters in autograd later.
        with self.hooks(fwd_hooks=[(n, store.hook) for n in names], read_only=True), torch.no_grad():
            logits = self.forward_tokens(tokens, mask, ctx, logits_to_keep)
        return logits, store.tensors

    def forward(
        self,
        input: Input,
        attention_mask: Int[Tensor, "batch pos"] | None = None,
        return_type: Literal["logits", "loss", "both"] = "logits",
        prepend_bos: bool | None = None,
    ) -> Any:
        """Logits ``[batch, pos, d_vocab]`` (or the mean next-token loss over real tokens).

        Example:
            >>> logits = model("The capital of France is")
        """
        if return_type not in ("logits", "loss", "both"):
            raise ValueError(f"`return_type` must be 'logits', 'loss' or 'both', got {return_type!r}.")
        tokens, mask = self.prepare_input(input, attention_mask, prepend_bos)
        logits = self.forward_tokens(tokens, mask)
        if return_type == "logits":
            return logits
        loss = next_token_loss(logits, tokens, mask)
        return loss if return_type == "loss" else (logits, loss)

    def run_with_hooks(
        self,
        input: Input,
        fwd_hooks: Sequence[tuple[NameOrFilter, Callable]] = (),
        bwd_hooks: Sequence[tuple[NameOrFilter, Callable]] = (),
        reset_hooks_end: bool = True,
        **forward_kwargs: Any,
    ) -> Any:
        """Run a forward with temporary hooks (removed afterwards, also on error).

        Example:
            >>> zero = lambda z, hook: z * 0
            >>> logits = model.run_with_hooks("Hi", fwd_hooks=[("blocks.0.attn.hook_z", zero)])
        """
        with self.hooks(fwd_hooks=fwd_hooks, bwd_hooks=bwd_hooks, reset_hooks_end=reset_hooks_end):
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
    ) -> tuple[Float[Tensor, "batch pos d_vocab"], ActivationCache]:
        """Forward and cache activations: ``(logits, ActivationCache)``.

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
                logits = self.forward_tokens(tokens, mask)
                target = metric(logits) if metric is not None else next_token_loss(logits, tokens, mask)
                if not isinstance(target, Tensor) or target.numel() != 1:
                    raise ValueError(
                        f"`metric` must return a scalar tensor to backpropagate, got {describe(target)}"
                        + (f" of shape {tuple(target.shape)}" if isinstance(target, Tensor) else "")
                        + "; reduce it, e.g. with .sum() or .mean()."
                    )
                if not target.requires_grad:
                    raise ValueError("`metric`'s result does not depend on the logits (no gradient); use the logits.")
                target.reshape(()).backward()
            logits, tensors = logits.detach(), store.tensors
        else:
            logits, tensors = self.cache_forward(tokens, mask, names, device, pos_slice)
        cache = ActivationCache(tensors, self, attention_mask=mask.to(device or mask.device))
        return logits, (cache.remove_batch_dim() if remove_batch_dim else cache)


class CacheWriter:
    """Caching hook: stores each tensor once on ``device``; aliases of one tensor share storage."""

    def __init__(self, device: torch.device | None, pos_slice: int | slice | Sequence[int] | None = None) -> None:
        self.device = device
        self.pos_slice = pos_slice
        self.tensors: dict[str, Tensor] = {}
        self._seen: dict[int, tuple[Any, Tensor]] = {}

    def _store(self, key: str, tensor: Tensor) -> None:
        hit = self._seen.get(id(tensor))
        if hit is not None and hit[0]() is tensor:
            self.tensors[key] = hit[1]
            return
        stored = tensor.detach()
        if self.pos_slice is not None:
            stored = _slice_positions(key, stored, self.pos_slice)
        if self.device is not None:
            stored = stored.to(self.device)
        self._seen[id(tensor)] = (weakref.ref(tensor), stored)
        self.tensors[key] = stored

    def hook(self, tensor: Tensor, hook: HookPoint) -> None:
        self._store(hook.name, tensor)

    def grad_hook(self, grad: Tensor, hook: HookPoint) -> None:
        self._store(hook.name + "_grad", grad)


def _slice_positions(name: str, t: Tensor, pos_slice: int | slice | Sequence[int]) -> Tensor:
    dim = 2 if name.endswith(("hook_pattern", "hook_attn_scores")) else 1
    if isinstance(pos_slice, int):
        return t.narrow(dim, pos_slice % t.shape[dim], 1)
    if isinstance(pos_slice, slice):
        index = [slice(None)] * t.dim()
        index[dim] = pos_slice
        return t[tuple(index)]
    return t.index_select(dim, torch.as_tensor(list(pos_slice), device=t.device))


def check_attention_mask(mask: Any, shape: torch.Size, left_padded: bool = False) -> Int[Tensor, "batch pos"]:
    """A 0/1 mask of ``shape`` with a real token in every row (and only left padding if asked)."""
    if not isinstance(mask, Tensor):
        raise TypeError(f"`attention_mask` must be a tensor [batch, pos] of 0/1, got {describe(mask)}.")
    mask = mask[None] if mask.dim() == 1 else mask
    if mask.shape != shape:
        raise ValueError(f"`attention_mask` shape {tuple(mask.shape)} must equal the tokens' shape {tuple(shape)}.")
    if mask.dtype.is_complex or mask.device.type == "meta":
        raise TypeError(f"`attention_mask` must be a real 0/1 tensor, got dtype {mask.dtype} on {mask.device}.")
    binary = (mask == 0) | (mask == 1)
    checks = [binary.all(), (mask != 0).any(-1).all()]
    if left_padded:
        real = mask != 0
        checks.append((real[:, 1:] >= real[:, :-1]).all())
    ok = torch.stack(checks).tolist()  # one device sync
    if not ok[0]:
        bad = mask[~binary].flatten()[0].item()
        raise ValueError(
            f"`attention_mask` must hold only 0 (padding) and 1 (real token); it holds {bad!r}. Build it with "
            "`(tokens != pad).long()` or take the tokenizer's."
        )
    if not ok[1]:
        row = int((mask != 0).any(-1).logical_not().nonzero()[0])
        raise ValueError(f"`attention_mask` row {row} is all padding; every row needs at least one real token.")
    if left_padded and not ok[2]:
        row = int((~(real[:, 1:] >= real[:, :-1]).all(-1)).nonzero()[0])
        raise ValueError(
            f"`attention_mask` row {row} is not left-padded ({mask[row].tolist()}); generation needs padding "
            "before the tokens: tokenize with `padding_side='left'` (model.to_tokens does)."
        )
    return mask.long()


def next_token_loss(
    logits: Float[Tensor, "batch pos d_vocab"], tokens: Int[Tensor, "batch pos"], mask: Int[Tensor, "batch pos"]
) -> Float[Tensor, ""]:
    """Mean cross-entropy of predicting each real token from the one before it."""
    logprobs = logits[:, :-1].float().log_softmax(-1)
    nll = -logprobs.gather(-1, tokens[:, 1:, None])[..., 0]
    keep = (mask[:, 1:] * mask[:, :-1]).to(nll.dtype)
    return (nll * keep).sum() / keep.sum().clamp_min(1)


def _bridge_config(model: PreTrainedModel, adapter: Adapter) -> BridgeConfig:
    c = model.config
    n_heads = c.num_attention_heads
    d_model = c.hidden_size
    d_head = getattr(c, "head_dim", None) or d_model // n_heads
    down = get_module(get_module(model, adapter.blocks)[0], adapter.mlp_down)
    d_mlp = down.weight.shape[0] if adapter.conv1d else down.weight.shape[1]
    parallel = bool(adapter.parallel_attn_mlp and getattr(c, adapter.parallel_attn_mlp, False))
    return BridgeConfig(
        model_type=c.model_type,
        n_layers=c.num_hidden_layers,
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=getattr(c, "num_key_value_heads", None) or n_heads,
        d_head=d_head,
        d_mlp=d_mlp,
        d_vocab=model.get_output_embeddings().weight.shape[0],
        n_ctx=getattr(c, "max_position_embeddings", None),
        parallel_attn_mlp=parallel,
        gated_mlp=adapter.gated,
        normalization=adapter.norm,
    )
