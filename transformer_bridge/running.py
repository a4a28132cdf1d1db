"""How a bridge is run: `Running`, the mixin of `BridgeCore` with the user-facing forward calls.

`forward` (TransformerLens' and HF's keywords, a KV-cached step, ``past_kv_cache``), `run_with_hooks`,
`run_with_cache` (TransformerLens' keywords included: ``return_type``, ``return_cache_object``, ``start_at_layer``
…) and `input_to_embed`. All of them go through the core's `prepare_input`, `forward_tokens` and `cache_forward`;
the core (``core.py``) holds wrapping, hooks and the one HF call (`run_model`).
"""

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from jaxtyping import Float, Int
from torch import Tensor
from transformers import Cache, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .cache.activation_cache import ActivationCache, check_pos_slice
from .cache.caching import CacheWriter, backpropagate, next_token_loss, next_token_losses
from .checks import ArgumentValueError, check_bool, check_device, describe, suggest_keywords
from .distributed import input_device
from .hooks.entries import batch_free
from .hooks.names import NameFilter
from .hooks.points import HookContext, NameOrFilter
from .inputs import (
    PaddingSide,
    check_attention_mask,
    embedding_points,
    embeds_stand_in,
    is_embeds,
    is_text,
    split_4d_mask,
    warn_masked_text_padding,
)
from .utils.lm import lm_cross_entropy_loss

Input = str | Sequence[str] | Tensor
NamesFilter = NameFilter
ReturnType = Literal["logits", "loss", "both"] | None


class Running:
    """Mixin of `BridgeCore`: `forward`, `run_with_hooks`, `run_with_cache`, `input_to_embed`.

    Example:
        >>> logits = model("The capital of France is")
        >>> logits, cache = model.run_with_cache("Hello", names_filter="resid_post")
    """

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
        use_cache: bool | None = None,
        labels: Int[Tensor, "batch pos"] | None = None,
        inputs_embeds: Float[Tensor, "batch pos d_model"] | None = None,
    ) -> Any:
        """Logits ``[batch, pos, d_vocab]``, TransformerLens' ``forward`` with HF's keywords too.

        ``input``: text (BOS per ``prepend_bos``, default ``cfg.default_prepend_bos``), a list of texts
        (padded as `to_tokens` pads it: ``padding_side``, default ``cfg.default_padding_side``, right as in
        TransformerLens, with the attention mask; each row's real positions as if run alone), token ids
        (``input_ids=`` too, HF style, with
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
        ``use_cache`` (HF's keyword) is accepted: a cached step is one with ``past_key_values``; without it the
        logits are the same either way. ``attention_mask`` may also be 4-D ``[batch, 1, pos, pos]``, HF's custom
        mask (the whole attention pattern, no causal mask added; bool: True attends, float: added to the scores;
        `inputs.split_4d_mask`), run with HF's default positions. ``labels`` (HF's keyword, the tokens' shape)
        are the loss targets in place of the tokens: ``labels[:, p]`` is predicted at ``p - 1``; -100 is ignored.
        ``inputs_embeds`` (HF's keyword; or a float ``[batch, pos, d_model]`` tensor as ``input``, TransformerLens 4)
        are the token embeddings the blocks read in place of the embedding's output: ``hf_model(inputs_embeds=...)``'s
        logits (positional embeddings and Gemma's scaling still apply; ``hook_tokens`` / ``hook_embed`` do not
        fire). A loss then needs targets: ``labels=`` or ``tokens=``.

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
        if use_cache is not None:
            check_bool("use_cache", use_cache)
            if use_cache is False and past_key_values is not None:
                raise ValueError("`use_cache=False` with `past_key_values`: a cached step uses the cache; drop one.")
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
        if is_embeds(input) and start_at_layer is None:
            if inputs_embeds is not None:
                raise ValueError("Give the embeddings once: a float `input` or `inputs_embeds`, not both.")
            inputs_embeds, input = input, None
        if inputs_embeds is not None:
            if hooked := [n for n in embedding_points(self) if self.hook_dict[n].active]:
                raise ValueError(
                    f"Hooks on {hooked} never run on `inputs_embeds`: HF skips the embedding; remove them."
                )
            input, attention_mask = embeds_stand_in(self, inputs_embeds, input, tokens, attention_mask, position_ids)
            if return_type in ("loss", "both") and labels is None and tokens is None:
                raise ValueError(
                    "A loss from `inputs_embeds` needs the targets: give `labels=` (or `tokens=`) of shape "
                    f"{tuple(inputs_embeds.shape[:2])}."
                )
            labels = labels if labels is not None else tokens
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
        tokens, mask, mask_4d = self._tokens_and_masks(input, attention_mask, prepend_bos, padding_side)
        ctx = None
        if labels is not None and (not isinstance(labels, Tensor) or labels.shape != tokens.shape
                                   or labels.is_floating_point()):  # fmt: skip
            raise ValueError(
                f"`labels` must be an integer tensor of the tokens' shape {tuple(tokens.shape)} (-100: ignored), "
                f"got {describe(labels)}."
            )
        if position_ids is not None:
            if (not isinstance(position_ids, Tensor) or position_ids.shape != tokens.shape
                    or position_ids.is_floating_point()):  # fmt: skip
                raise ValueError(
                    f"`position_ids` must be an integer tensor of the tokens' shape {tuple(tokens.shape)}, got "
                    f"{describe(position_ids)}."
                )
            position_ids = position_ids.to(tokens.device)
            ctx = dataclasses.replace(HookContext.from_mask(mask), positions=position_ids)
        hf_kwargs: dict[str, Any] = {"output_hidden_states": True} if output_hidden_states else {}
        if inputs_embeds is not None:
            hf_kwargs["inputs_embeds"] = inputs_embeds.to(tokens.device)
        patterns: dict[str, Tensor] = {}
        with contextlib.ExitStack() as stack:
            if output_attentions:
                keep = CacheWriter(None)
                stack.enter_context(self.hooks(fwd_hooks=[("pattern", keep.hook)], read_only=True))
                patterns = keep.tensors
            out = self.forward_tokens(
                tokens, mask, ctx, stop_at_layer=stop_at_layer, start_at_layer=start_at_layer, residual=residual,
                explicit_positions=position_ids is not None, mask_4d=mask_4d, **hf_kwargs,
            )  # fmt: skip
        if stop_at_layer is not None or return_type is None:
            return None if return_type is None and stop_at_layer is None else out
        if output_hidden_states or output_attentions:
            result = out if output_hidden_states else CausalLMOutputWithPast(logits=getattr(out, "logits", out))
            if output_attentions:
                result.attentions = tuple(patterns[f"blocks.{i}.attn.hook_pattern"] for i in range(self.cfg.n_layers))
            return result
        logits = out if isinstance(out, Tensor) else out.logits  # HF's output object when given embeddings
        if return_type == "logits":
            return logits
        targets = tokens if labels is None else labels.to(tokens.device)
        loss = (next_token_losses if loss_per_token else next_token_loss)(logits, targets, mask)
        return loss if return_type == "loss" else (logits, loss)

    def loss_fn(
        self,
        logits: Float[Tensor, "batch pos d_vocab"],
        tokens: Int[Tensor, "batch pos"],
        attention_mask: Tensor | None = None,
        per_token: bool = False,
    ) -> Float[Tensor, ""] | Float[Tensor, "batch pos_minus_1"]:
        """TransformerLens' ``loss_fn``: next-token cross-entropy of ``logits`` on ``tokens``, counting only
        predictions between real tokens of ``attention_mask`` (2-D 0/1, or the 4-D mask given to `forward`,
        read by `inputs.split_4d_mask`); ``per_token``: ``[batch, pos - 1]``, 0 where masked.

        Example:
            >>> tokens = model.to_tokens("Hello world")
            >>> loss = model.loss_fn(model(tokens), tokens)
        """
        if isinstance(attention_mask, Tensor) and attention_mask.dim() == 4:
            attention_mask = split_4d_mask(attention_mask.to(tokens.device), tokens.shape)[0]
        return lm_cross_entropy_loss(logits, tokens, attention_mask, per_token)

    def _tokens_and_masks(
        self, input: Input, attention_mask: Tensor | None, prepend_bos: bool | None,
        padding_side: PaddingSide | None = None,
    ) -> tuple[Int[Tensor, "batch pos"], Int[Tensor, "batch pos"], Tensor | None]:  # fmt: skip
        """``(tokens, token mask, 4-D mask or None)``: `prepare_input`, or token ids given with a 4-D mask
        (`inputs.split_4d_mask`)."""
        if not (isinstance(attention_mask, Tensor) and attention_mask.dim() == 4):
            tokens, mask = self.prepare_input(input, attention_mask, prepend_bos, padding_side=padding_side)
            warn_masked_text_padding(self, input, mask)
            return tokens, mask, None
        if self.adapter.has_mixers:
            raise ValueError("A 4-D `attention_mask` shapes attention; state-space layers here take a 2-D mask.")
        if is_text(input):
            raise ValueError("A 4-D `attention_mask` goes with token ids, not text (text is padded for you).")
        tokens, _ = self.prepare_input(input, None, prepend_bos, padding_side="right")  # ids as given
        mask, mask_4d = split_4d_mask(attention_mask.to(tokens.device), tokens.shape)
        return tokens, mask, mask_4d

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
        if n_past == 0:  # text left-padded, as generate pads it: the next step's tokens follow every row's last one
            side = "left" if is_text(input) else None
            tokens, mask = self.prepare_input(input, attention_mask, prepend_bos, padding_side=side)
            past = DynamicCache(config=self.hf_model.config) if past is None else past
        else:
            if not isinstance(input, Tensor) or input.dim() != 2 or input.is_floating_point():
                raise TypeError(f"A cached step takes the new token ids [batch, new], got {describe(input)}.")
            tokens = input.to(input_device(self.hf_model))
            expected = (tokens.shape[0], n_past + tokens.shape[1])
            ones = torch.ones(expected, dtype=torch.long, device=tokens.device)
            mask = ones if attention_mask is None else attention_mask
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
        # A cached step gets its positions as generate gives them: HF's own default is wrong for some families
        # (Bamba's cached step would be off); an unpadded prefill keeps HF's own path.
        explicit = padded or n_past > 0
        out = self.run_model(tokens, mask if padded else None, ctx, past_key_values=past,
                             position_ids=ctx.positions if explicit else None)  # fmt: skip
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
        remove_batch_dim: bool = False,
        **forward_kwargs: Any,
    ) -> Any:
        """Run a forward with temporary hooks (removed afterwards, also on error); ``forward_kwargs``
        go to `forward` (``return_type=None``, ``stop_at_layer`` …). ``remove_batch_dim=True`` (TransformerLens):
        each function sees a batch-1 tensor without its batch axis (a view: in-place edits count, a returned
        tensor gets the axis back, `hook_entries.batch_free`); a larger batch reaches it unchanged.

        Example:
            >>> zero = lambda z, hook: z * 0
            >>> logits = model.run_with_hooks("Hi", fwd_hooks=[("blocks.0.attn.hook_z", zero)])
        """
        if check_bool("remove_batch_dim", remove_batch_dim):
            fwd_hooks = [(name, batch_free(fn)) for name, fn in fwd_hooks]
            bwd_hooks = [(name, batch_free(fn)) for name, fn in bwd_hooks]
        with self.hooks(fwd_hooks, bwd_hooks, reset_hooks_end=reset_hooks_end, clear_contexts=clear_contexts):
            return self(input, **forward_kwargs)

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
        *,
        return_type: ReturnType = "logits",
        loss_per_token: bool = False,
        return_cache_object: bool = True,
        clear_contexts: bool = False,
        start_at_layer: int | None = None,
        tokens: Int[Tensor, "batch pos"] | None = None,
        reset_hooks_end: bool = True,
        padding_side: PaddingSide | None = None,
    ) -> tuple[Any, ActivationCache | dict[str, Tensor]]:
        """Forward and cache activations: ``(logits, ActivationCache)``, TransformerLens' keywords included.

        Each activation is stored once, detached (aliases such as ``resid_pre[l+1]`` / ``resid_post[l]`` share
        storage), on ``device`` as it is produced; the model is never moved. The forward runs under the caller's
        grad mode, as TransformerLens': with grad on the output carries the graph (``metric(output).backward()``
        reaches backward hooks); under ``no_grad`` / ``inference_mode`` none is built. ``incl_bwd``: a scalar is
        backpropagated and gradients stored under ``<name>_grad``: ``metric(logits)``, or, as in TransformerLens,
        the output itself, which must then be the loss (``return_type="loss"``).

        ``stop_at_layer=L`` stops before block ``L`` (nothing after it is computed, see `forward`) and returns
        ``(residual stream entering block L, cache of what ran)``. With ``start_at_layer=K``, ``input`` is the
        residual stream entering block ``K`` (``tokens=`` / ``attention_mask=`` as in `forward`) and only block ``K``
        onwards is cached. TransformerLens' ``return_type``: ``"logits"`` (default), ``"loss"`` (mean next-token
        loss over real tokens; ``loss_per_token=True``: ``[batch, pos - 1]``), ``"both"`` (``(logits, loss)``) or
        ``None``. ``return_cache_object=False`` returns the cache as a plain ``{name: tensor}`` dict;
        ``clear_contexts=True`` empties the ``hook.ctx`` of every point cached, afterwards. ``reset_hooks_end=False``
        (TransformerLens) leaves the caching hooks on until `reset_hooks`: each later forward overwrites the returned
        cache's entries (its ``attention_mask`` stays this call's). Text is padded as `to_tokens` (``padding_side``).

        Example:
            >>> logits, cache = model.run_with_cache("Hello world", names_filter=lambda n: "resid" in n)
            >>> cache["resid_post", 0].shape
            >>> loss, cache = model.run_with_cache("Hello world", return_type="loss")
        """
        if return_type not in ("logits", "loss", "both", None):
            raise ValueError(f"`return_type` must be 'logits', 'loss', 'both' or None, got {return_type!r}.")
        for name, value in (("loss_per_token", loss_per_token), ("return_cache_object", return_cache_object),
                            ("clear_contexts", clear_contexts), ("reset_hooks_end", reset_hooks_end)):  # fmt: skip
            check_bool(name, value)
        if incl_bwd and not torch.is_grad_enabled():
            raise ValueError(
                "`incl_bwd=True` backpropagates, but gradient tracking is off (inside torch.no_grad() or "
                "torch.set_grad_enabled(False)); call run_with_cache outside it."
            )
        if incl_bwd and metric is None and stop_at_layer is None and (return_type != "loss" or loss_per_token):
            shown = "return_type='loss', loss_per_token=True" if loss_per_token else f"return_type={return_type!r}"
            raise ValueError(
                f"`incl_bwd=True` calls backward() on a scalar output, and {shown} is not one: give "
                "`return_type='loss'` (the mean next-token loss), or `metric=` (logits -> scalar tensor)."
            )
        if not reset_hooks_end and remove_batch_dim:  # later forwards would write batched tensors into it
            raise ValueError("`reset_hooks_end=False` keeps filling the cache; it cannot `remove_batch_dim` too.")
        if start_at_layer is not None or is_embeds(input):  # a resumed run, or embeddings
            if incl_bwd or metric is not None:
                raise ValueError(
                    "`incl_bwd` / `metric` run from token ids: with `start_at_layer` or embeddings as `input`, call "
                    "`run_with_hooks` with backward hooks instead."
                )
            out, cache = self._cache_from_layer(input, start_at_layer, return_type, loss_per_token, names_filter,
                                                device, pos_slice, tokens, attention_mask, stop_at_layer,
                                                reset_hooks_end=reset_hooks_end)  # fmt: skip
            if remove_batch_dim:
                cache = cache.remove_batch_dim(batch_size=input.shape[0])
            return out, (cache if return_cache_object else cache.cache_dict)
        out, cache = self._cached_run(input, names_filter, device, remove_batch_dim, incl_bwd, pos_slice,
                                      attention_mask, metric, prepend_bos, stop_at_layer,
                                      reset_hooks_end=reset_hooks_end, padding_side=padding_side)  # fmt: skip
        if clear_contexts:
            for name in self.names_matching(names_filter):
                self.hook_dict[name].clear_context()
        if stop_at_layer is None:
            out = self._shape_output(out, input, return_type, loss_per_token, attention_mask, prepend_bos, padding_side)
        return out, (cache if return_cache_object else cache.cache_dict)

    def _cached_run(
        self, input: Input, names_filter: NamesFilter, device: Any, remove_batch_dim: bool, incl_bwd: bool,
        pos_slice: Any, attention_mask: Tensor | None, metric: Callable | None, prepend_bos: bool | None,
        stop_at_layer: int | None, *, reset_hooks_end: bool = True, padding_side: PaddingSide | None = None,
    ) -> tuple[Tensor, ActivationCache]:  # fmt: skip
        """`run_with_cache`'s logits (or residual stream) and cache, before TransformerLens' output shaping."""
        device = check_device(device)
        if remove_batch_dim and isinstance(input, (list, tuple)) and len(input) != 1:
            raise ArgumentValueError(f"`remove_batch_dim=True` needs a batch of one, got batch size {len(input)}.")
        if metric is not None and not incl_bwd:
            raise ValueError("`metric` is backpropagated only with `incl_bwd=True`; add it or drop `metric`.")
        if metric is not None and not callable(metric):
            raise TypeError(f"`metric` must be callable as metric(logits) -> scalar tensor, got {describe(metric)}.")
        names = self.names_matching(names_filter)
        tokens, mask, mask_4d = self._tokens_and_masks(input, attention_mask, prepend_bos, padding_side)
        if pos_slice is not None:
            pos_slice = check_pos_slice(pos_slice, tokens.shape[1])
        if remove_batch_dim and tokens.shape[0] != 1:
            raise ArgumentValueError(f"`remove_batch_dim=True` needs a batch of one, got batch size {tokens.shape[0]}.")
        if incl_bwd:
            store = CacheWriter(device, pos_slice)
            fwd = [(n, store.hook) for n in names]
            bwd = [(n, store.grad_hook) for n in names]
            with self.hooks(fwd_hooks=fwd, bwd_hooks=bwd, read_only=True, reset_hooks_end=reset_hooks_end):
                logits = self.forward_tokens(tokens, mask, stop_at_layer=stop_at_layer, mask_4d=mask_4d)
                if metric is None and stop_at_layer is not None:
                    raise ValueError(
                        "With `stop_at_layer`, give `metric` (the output is a residual stream, not logits)."
                    )
                backpropagate(metric(logits) if metric is not None else next_token_loss(logits, tokens, mask))
            logits, tensors = logits.detach(), store.tensors
        else:
            logits, tensors = self.cache_forward(tokens, mask, names, device, pos_slice, stop_at_layer=stop_at_layer,
                                                 reset_hooks_end=reset_hooks_end, mask_4d=mask_4d,
                                                 grad=True)  # fmt: skip
        cache = ActivationCache(tensors, self, attention_mask=mask.to(device or mask.device))
        return logits, (cache.remove_batch_dim(batch_size=tokens.shape[0]) if remove_batch_dim else cache)

    def _cache_from_layer(
        self,
        residual: Tensor,
        start_at_layer: int | None,
        return_type: ReturnType,
        loss_per_token: bool,
        names_filter: Any,
        device: Any,
        pos_slice: Any,
        tokens: Tensor | None,
        attention_mask: Tensor | None,
        stop_at_layer: int | None,
        reset_hooks_end: bool = True,
    ) -> tuple[Any, ActivationCache]:
        """``run_with_cache(residual, start_at_layer=K)``: `forward`'s resumed run with caching hooks; the
        blocks before ``K`` (run on a placeholder) and the embeddings fire no hook, so they are not cached.
        ``start_at_layer=None``: ``residual`` holds the token embeddings (`forward`'s ``inputs_embeds``)."""
        device = check_device(device)
        if pos_slice is not None:
            pos_slice = check_pos_slice(pos_slice, residual.shape[1])
        store = CacheWriter(device, pos_slice)
        skipped = set(embedding_points(self)) if start_at_layer is None else set()  # not run on embeddings
        caching = [(n, store.hook) for n in self.names_matching(names_filter) if n not in skipped]
        resume = dict(start_at_layer=start_at_layer, stop_at_layer=stop_at_layer, tokens=tokens)
        with self.hooks(fwd_hooks=caching, read_only=True, reset_hooks_end=reset_hooks_end):  # the caller's grad mode
            out = self(residual, attention_mask=attention_mask, return_type=return_type,
                       loss_per_token=loss_per_token, **resume)  # fmt: skip
        mask = attention_mask if attention_mask is not None else torch.ones(residual.shape[:2], dtype=torch.long)
        return out, ActivationCache(store.tensors, self, attention_mask=mask.to(device or mask.device))

    def _shape_output(
        self, logits: Tensor, input: Any, return_type: ReturnType, loss_per_token: bool,
        attention_mask: Tensor | None, prepend_bos: bool | None, padding_side: PaddingSide | None = None,
    ) -> Any:  # fmt: skip
        if return_type == "logits":
            return logits
        if return_type is None:
            return None
        tokens, mask, _ = self._tokens_and_masks(input, attention_mask, prepend_bos, padding_side)
        loss_fn: Callable[..., Tensor] = next_token_losses if loss_per_token else next_token_loss
        loss = loss_fn(logits, tokens.to(logits.device), mask.to(logits.device))
        return loss if return_type == "loss" else (logits, loss)
