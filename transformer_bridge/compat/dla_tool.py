"""`direct_logit_attribution`: TransformerLens 4.3's one-call DLA tool (``transformer_lens.tools.analysis``).

The tool is a thin layer over the cache's TransformerLens methods: the residual stream at the chosen
positions is split by `ActivationCache.decompose_resid` (``unit="component"``), `stack_head_results`
(``"head"``, with the ``"remainder"``) or `accumulated_resid` (``"layer"``, cumulative), and each part is read
along the answer's unembedding direction by `ActivationCache.logit_attrs` (centred for LayerNorm and divided by
the cached final-norm scale, then projected on ``γ ⊙ W_U_raw[:, answer]``, minus the incorrect token's).

Differences from TransformerLens, on purpose:

- No `enable_compatibility_mode()` is needed. TransformerLens refuses an unprocessed bridge because it
  projects on ``W_U`` as the module holds it; here the final norm's ``γ`` is always in the direction and its
  ``β`` in ``model.b_U``, so processed and unprocessed weights give the same logit-difference attributions
  (single-token ones differ by ``center_unembed``'s per-component shift, as the logits do).
- Attributions are float32 (float64 for a float64 model), whatever the cache's dtype.
- When the tool runs the model, it checks that the final residual read out this way reproduces the model's
  logits for the answer tokens (Gemma 2: through its soft-cap); a hook that edits the final norm's output or
  the logits fails that check instead of giving numbers that do not add up. A supplied ``cache`` is not
  checked (it holds no logits).

What the attributions sum to: the components (``"component"``, ``"head"``) add up to
``logit[answer] - model.b_U[answer]`` (minus the same for ``incorrect_tokens``), and so does the last row of
``"layer"``; ``model.b_U`` is the unembedding bias with the final norm's ``β`` folded in. For Gemma 2 that is
the logit before the final soft-cap.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from jaxtyping import Float, Int
from torch import Tensor

from ..cache.activation_cache import ActivationCache
from ..cache.pos_slice import PosSlice, check_pos_slice
from ..checks import ArgumentTypeError, ArgumentValueError, describe, is_int
from ..convertible import Convertible
from ..core import BridgeCore
from .weights import b_U

__all__ = ["UNITS", "AnswerTokens", "DirectLogitAttribution", "Unit", "direct_logit_attribution"]

Unit = Literal["component", "layer", "head"]
UNITS: tuple[str, ...] = ("component", "layer", "head")
AnswerTokens = str | int | Sequence[str | int] | Int[Tensor, "..."]
# The hook points the decompositions read: residual points, embeddings, sublayer outputs and every norm's scale.
_READS = ("hook_resid_pre", "hook_resid_mid", "hook_resid_post", "hook_embed", "hook_pos_embed", "hook_attn_out",
          "hook_mlp_out", "hook_mixer_out", "hook_scale")  # fmt: skip


@dataclass
class DirectLogitAttribution(Convertible):
    """What `direct_logit_attribution` returns.

    ``attribution`` is ``[component, *batch_and_pos]``, aligned with ``labels``: ``[component, batch]`` for one
    position (the default), ``[component, batch, pos]`` with ``pos=None`` or several positions, without the
    batch axis for a cache that has none (``remove_batch_dim``). ``unit`` is the decomposition used.

    Example:
        >>> res = direct_logit_attribution(model, "The capital of France is", answer_tokens=" Paris")
        >>> res.top(3)   # [('L5H1', 1.93), ('5_mlp_out', 1.2), ...]
    """

    attribution: Float[Tensor, "component *batch_and_pos"]
    labels: list[str]
    unit: str

    def as_tensor(self) -> Tensor:
        """``attribution``: what ``torch.as_tensor(res)`` and ``np.asarray(res)`` give."""
        return self.attribution

    def top(self, k: int = 5) -> list[tuple[str, float]]:
        """The ``k`` largest attributions as ``(label, value)``, largest first; a component's value is its mean
        over the batch and positions it holds.

        Example:
            >>> res.top(1)   # [('L9H9', 3.1)]
        """
        if not is_int(k) or k < 1:
            raise ArgumentValueError(f"`k` must be a positive int, got {describe(k)}.")
        flat = self.attribution.flatten(1).mean(-1) if self.attribution.dim() > 1 else self.attribution
        values, indices = torch.topk(flat, min(int(k), flat.shape[0]))
        return [(self.labels[i], v) for i, v in zip(indices.tolist(), values.tolist(), strict=True)]


def direct_logit_attribution(
    model: BridgeCore,
    input: str | list[str] | Int[Tensor, "batch pos"] | None = None,
    answer_tokens: AnswerTokens | None = None,
    incorrect_tokens: AnswerTokens | None = None,
    *,
    unit: Unit = "component",
    pos: PosSlice | None = -1,
    cache: ActivationCache | None = None,
) -> DirectLogitAttribution:
    """Each component's direct contribution to the logit of ``answer_tokens`` (minus ``incorrect_tokens``').

    ``unit``: ``"component"`` (``embed``, ``pos_embed``, ``{L}_attn_out``, ``{L}_mlp_out``; ``{L}_mixer_out`` for
    a state-space layer; ``edit:<hook>`` for what a hook added to the residual stream), ``"head"`` (``L{L}H{h}``
    for every head, then ``remainder``: embeddings, MLPs and biases) or ``"layer"`` (the residual stream so far,
    ``{L}_pre``, ``{L}_mid``, ..., ``final_post``: cumulative, so the last row is the whole logit).
    ``answer_tokens`` / ``incorrect_tokens``: a one-token string or an id (every row), a sequence of them or a
    ``[batch]`` tensor (one per row), or ``[batch, pos]`` ids for the selected positions. ``pos``: the positions
    (default the last; a batch of strings is left-padded here, unlike `to_tokens`, so that is every row's last
    token), None keeps them
    all. ``cache``: a cache of this model to read (``input`` is then not run). Components and heads sum to
    ``logit - model.b_U[token]`` (see the module docstring); no `enable_compatibility_mode()` is needed.

    Example:
        >>> res = direct_logit_attribution(model, "The Eiffel Tower is in", answer_tokens=" Paris",
        ...                                incorrect_tokens=" London", unit="head")
        >>> res.attribution.sum(0)   # == logit diff - (model.b_U[paris] - model.b_U[london])
    """
    if not isinstance(model, BridgeCore):
        raise ArgumentTypeError(f"`model` must be a TransformerBridge, got {type(model).__name__}.")
    if unit not in UNITS:
        raise ArgumentValueError(f"Unknown `unit`={unit!r}: unit must be one of {', '.join(map(repr, UNITS))}.")
    if answer_tokens is None:
        raise ArgumentValueError(
            "answer_tokens is required: give `answer_tokens` as a one-token string, a token id, a sequence of them "
            "(one per row) or an id tensor."
        )
    answer = _ids(model, answer_tokens, "answer_tokens")
    incorrect = None if incorrect_tokens is None else _ids(model, incorrect_tokens, "incorrect_tokens")
    if unit == "head":
        _require_heads(model)
    logits = None
    if cache is None:
        if input is None:
            raise ArgumentValueError("Give either `input` (a prompt to run) or a precomputed `cache`; both are None.")
        if any(m.training for m in model.hf_model.modules()):
            raise ArgumentValueError(
                "direct_logit_attribution() runs the model, which is in training mode (dropout would make the "
                "numbers random); call model.eval() first, or pass a `cache`."
            )
        # Text left-padded, so that the default ``pos=-1`` is every row's last token.
        logits, cache = model.run_with_cache(input, names_filter=lambda name: _read(name, unit), padding_side="left")
    cache = _own_cache(model, cache)
    n_pos = cache["blocks.0.hook_resid_pre"].shape[-2]
    if pos is not None:
        check_pos_slice(pos, n_pos, "pos")
    final = cache._at_pos(cache[f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"], pos)
    lead = tuple(final.shape[:-1])  # [batch, pos] after the selection
    answer = _shaped(answer, lead, cache.has_batch_dim, "answer_tokens")
    if incorrect is not None:
        answer, incorrect = torch.broadcast_tensors(answer, _shaped(incorrect, lead, cache.has_batch_dim,
                                                                    "incorrect_tokens"))  # fmt: skip
    stack, labels = _stack(model, cache, unit, pos)
    dtype = torch.float64 if stack.dtype == torch.float64 else torch.float32
    attribution = cache.logit_attrs(stack.to(dtype), answer, incorrect, pos_slice=pos,
                                    has_batch_dim=cache.has_batch_dim)  # fmt: skip
    if logits is not None:
        _check_readout(model, cache, logits, final.to(dtype), answer, incorrect, pos)
    return DirectLogitAttribution(attribution, labels, unit)


def _read(name: str, unit: str) -> bool:
    """Whether ``unit``'s decomposition reads hook point ``name`` (the filter of the run the tool makes)."""
    return name.endswith(_READS) or (unit == "head" and name.endswith("attn.hook_z"))


def _stack(
    model: BridgeCore, cache: ActivationCache, unit: str, pos: PosSlice | None
) -> tuple[Float[Tensor, "component *batch_and_pos d_model"], list[str]]:
    """The residual stream at ``pos`` split into ``unit``'s parts, final norm not applied (`logit_attrs` does)."""
    if unit == "component":
        return cache.decompose_resid(pos_slice=pos, return_labels=True)
    if unit == "head":
        return cache.stack_head_results(pos_slice=pos, incl_remainder=True, return_labels=True)
    every_mid = all(f"blocks.{i}.hook_resid_mid" in model.hook_dict for i in range(model.cfg.n_layers))
    return cache.accumulated_resid(incl_mid=every_mid, pos_slice=pos, return_labels=True)


def _require_heads(model: BridgeCore) -> None:
    missing = [i for i in range(model.cfg.n_layers) if f"blocks.{i}.attn.hook_z" not in model.hook_dict]
    if missing:
        raise ArgumentValueError(
            f"`unit`='head' needs attention heads in every layer, but layers {missing} of this {model.cfg.model_type} "
            "model have none (state-space or other mixer layers). Use unit='component' or unit='layer'."
        )


def _own_cache(model: BridgeCore, cache: ActivationCache) -> ActivationCache:
    """``cache`` with ``model`` attached; a cache made by another model is refused (its weights would be read)."""
    if not isinstance(cache, ActivationCache):
        raise ArgumentTypeError(f"`cache` must be an ActivationCache, got {describe(cache)}.")
    if cache.model is None:
        return cache._derive(cache.cache_dict, model=model)
    if cache.model is not model:
        raise ArgumentValueError(
            "`cache` belongs to another model; the attributions read the weights of the cache's model. Pass that "
            "model, or a cache from `model.run_with_cache`."
        )
    return cache


def _ids(model: BridgeCore, tokens: AnswerTokens, param: str) -> Int[Tensor, "..."]:
    """``tokens`` as an id tensor: strings through `to_single_token`, every id checked against the vocabulary."""
    if isinstance(tokens, Tensor):
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool or tokens.dim() > 2:
            raise ArgumentTypeError(
                f"`{param}` as a tensor must hold integer ids (at most 2-d), got {describe(tokens)}."
            )
        ids = tokens.long()
    else:
        items = list(tokens) if isinstance(tokens, (list, tuple)) else [tokens]
        if not items:
            raise ArgumentValueError(f"`{param}` is empty; give at least one token.")
        ids = torch.tensor([_one_id(model, t, param) for t in items])
        ids = ids if isinstance(tokens, (list, tuple)) else ids[0]
    outside = ids[(ids < 0) | (ids >= model.cfg.d_vocab)]
    if outside.numel():
        raise ArgumentValueError(
            f"`{param}` holds token id {outside[0].item()}, outside this model's vocabulary 0..{model.cfg.d_vocab - 1}."
        )
    return ids


def _one_id(model: BridgeCore, token: str | int, param: str) -> int:
    if isinstance(token, str):
        try:
            return model.to_single_token(token)
        except ValueError as e:
            raise ArgumentValueError(f"`{param}`: {token!r} must be exactly one token ({e})") from e
    if not is_int(token):
        raise ArgumentTypeError(f"`{param}` must hold one-token strings or token ids, got {describe(token)}.")
    return int(token)


def _shaped(ids: Tensor, lead: tuple[int, ...], has_batch: bool, param: str) -> Tensor:
    """``ids`` shaped to broadcast over ``lead`` (the attribution's batch and position axes): one id, one per
    batch row, or one per row and selected position."""
    if ids.shape == lead or ids.dim() == 0:
        return ids
    if has_batch and ids.dim() == 1 and lead and ids.shape[0] == lead[0]:
        return ids.reshape(ids.shape + (1,) * (len(lead) - 1))
    shapes = ["()", *([f"({lead[0]},) (one per row)"] if has_batch and lead else []), f"{lead} (per position)"]
    raise ArgumentValueError(
        f"`{param}` has shape {tuple(ids.shape)}, which does not match the selected batch and positions {lead}; "
        f"give one of the shapes {', '.join(dict.fromkeys(shapes))}."
    )


def _check_readout(
    model: BridgeCore,
    cache: ActivationCache,
    logits: Float[Tensor, "batch pos vocab"],
    final: Float[Tensor, "*batch_and_pos d_model"],
    answer: Tensor,
    incorrect: Tensor | None,
    pos: PosSlice | None,
) -> None:
    """Raise when the final residual, read along each token's direction plus ``model.b_U``, does not give the
    model's own logits for it (a hook edited the final norm's output or the logits)."""
    selected = cache._at_pos(logits, pos).float()  # [batch, pos, vocab] at the selected positions
    bias = b_U(model, warn=False).detach().float().to(selected.device)
    cap = getattr(model.hf_model.config, "final_logit_softcapping", None)
    spread = (selected - selected.mean(-1, keepdim=True)).abs().amax(-1)
    tol = 3e-2 if logits.dtype in (torch.float16, torch.bfloat16) else 1e-3  # half precision: its rounding
    for ids in (answer, incorrect) if incorrect is not None else (answer,):
        ids = ids.expand(selected.shape[:-1]).to(selected.device)
        ours = cache.logit_attrs(final[None], ids, pos_slice=pos, has_batch_dim=cache.has_batch_dim)[0]
        ours = ours.to(selected.device, torch.float32) + bias[ids]
        if cap:
            ours = cap * torch.tanh(ours / cap)
        theirs = selected.gather(-1, ids[..., None])[..., 0]
        error = (ours - theirs).abs()
        if bool((error > tol * spread.clamp_min(1e-6)).any()):
            raise ArgumentValueError(
                f"direct_logit_attribution() reads the last block's hook_resid_post through the final norm and "
                f"`model.W_U`, but that differs from the model's own logits by up to {error.max().item():.3g} "
                f"(logit spread {spread.max().item():.3g}): a hook edits the final norm's output or the logits "
                "while the model runs. Run without that hook, or pass a `cache` to attribute the stream as cached."
            )
