"""The one hook-name grammar: canonical names, TransformerLens shorthand, layer keys, predicates.

Every entry point that takes hook names (``hooks``, ``add_hook``, ``run_with_hooks``,
``run_with_cache``'s ``names_filter``, ``generate``'s ``names_filter``, cache lookups) resolves them
here, so a spelling that works in one works in all of them and fails the same way in all of them:

- a canonical name: ``"blocks.3.hook_resid_post"``;
- a shorthand key: ``("resid_post", 3)``, ``("scale", 2, "ln1")``; negative layers count from the end;
- a bare shorthand: ``"resid_post"`` means that point in every layer (``"scale"`` / ``"normalized"``
  mean the final norm, as TransformerLens' `get_act_name` does); a cache lookup needs a layer;
- a predicate over canonical names; in a ``names_filter``, also a list of any of the above.

A name that is not a hook point raises `UnknownHookError` (with close matches), a layer past the
model's blocks raises `LayerOutOfRangeError`, and a valid point missing from a cache raises
`NotCachedError`. All are `KeyError`s; a filter that matches nothing raises `ValueError`.
"""

import difflib
import re
from collections.abc import Callable, Collection, Container, Iterable, Mapping, Sequence
from typing import Any

from ..checks import as_index

NameFilter = None | str | tuple | Sequence[Any] | Callable[[str], bool]

# Shorthand → where the canonical name lives: "" (model level), "block", "attn", "mlp", or a norm.
_SHORT = {
    "embed": "", "pos_embed": "",
    "resid_pre": "block", "resid_mid": "block", "resid_post": "block", "attn_out": "block", "mlp_out": "block",
    "q": "attn", "k": "attn", "v": "attn", "rot_q": "attn", "rot_k": "attn", "z": "attn", "result": "attn",
    "attn_scores": "attn", "scores": "attn", "pattern": "attn", "attn": "attn",
    "pre": "mlp", "pre_linear": "mlp", "post": "mlp",
    "router_logits": "mlp", "expert_weights": "mlp", "expert_pre": "mlp", "expert_post": "mlp",
    "expert_result": "mlp", "shared_pre": "mlp", "shared_post": "mlp", "shared_gate": "mlp",
    "mixer_out": "block", "kv_latent": "attn", "k_rope": "attn",
    "attn_in": "block", "q_input": "block", "k_input": "block", "v_input": "block", "mlp_in": "block",
    "scale": "norm", "normalized": "norm",
}  # fmt: skip
_RENAME = {"scores": "attn_scores", "attn": "pattern"}
_NORMS = ("ln1", "ln2", "ln1_post", "ln2_post", "ln_final")
_BLOCK_NAME = re.compile(r"blocks\.(-?\d+)\.(.+)")
# TransformerLens 4's bridge spells points by component input/output; each is another spelling of one point.
_TL4_BLOCK = {
    "hook_in": "hook_resid_pre", "hook_out": "hook_resid_post", "ln1.hook_in": "hook_resid_pre",
    "attn.q.hook_out": "attn.hook_q", "attn.k.hook_out": "attn.hook_k", "attn.v.hook_out": "attn.hook_v",
    "attn.o.hook_in": "attn.hook_z", "mlp.out.hook_in": "mlp.hook_post",
    "attn.hook_attn_in": "hook_attn_in", "attn.hook_q_input": "hook_q_input", "attn.hook_k_input": "hook_k_input",
    "attn.hook_v_input": "hook_v_input", "ln1.hook_out": "attn.hook_in", "ln2.hook_out": "mlp.hook_in",
}  # fmt: skip
# TransformerLens' `get_act_name`: its aliases of names and layer types.
_TL_NAME_ALIAS = {
    "attn_logits": "attn_scores", "key": "k", "query": "q", "value": "v",
    "mlp_pre": "pre", "mlp_mid": "mid", "mlp_post": "post",
}  # fmt: skip
_TL_LAYER_TYPE = {
    "a": "attn", "attention": "attn", "attn": "attn", "m": "mlp", "mlp": "mlp", "b": "", "block": "", "blocks": "",
}  # fmt: skip
_TL4_MODEL = {"embed.hook_in": "hook_tokens", "embed.hook_out": "hook_embed", "pos_embed.hook_out": "hook_pos_embed",
              "hook_unembed": "unembed.hook_out"}  # fmt: skip
_RESID_POST = re.compile(r"blocks\.(\d+)\.hook_resid_post")
# Spellings whose point depends on the family, decided from the model's points (``known``):
# - a sublayer's output (TransformerLens 4: its last projection's output) is ``hook_attn_out`` / ``hook_mlp_out``
#   only where no post-norm follows it (Gemma 2/3, OLMo 2: TransformerLens 4's hook_attn_out is after ln1_post, its
#   attn.hook_out before; this bridge has no point before the post-norm, so the spelling is unknown there);
# - a gated MLP's ``in`` is its up projection (``hook_pre_linear``), its ``gate`` the activation's input.
# spelling -> (its point where no post-norm follows, the post-norm)
_TL4_SUBLAYER_OUT = {
    "attn.hook_out": ("hook_attn_out", "ln1_post"), "attn.o.hook_out": ("hook_attn_out", "ln1_post"),
    "mlp.hook_out": ("hook_mlp_out", "ln2_post"), "mlp.out.hook_out": ("hook_mlp_out", "ln2_post"),
}  # fmt: skip
# spelling -> (its point in a gated MLP, in an ungated one; None: it has none)
_TL4_MLP = {"mlp.in.hook_out": ("mlp.hook_pre_linear", "mlp.hook_pre"), "mlp.gate.hook_out": ("mlp.hook_pre", None)}
# A projection's input is the attention's input (TransformerLens 4's q/k/v components read the attention's input).
_TL4_PROJECTION_IN = ("attn.q.hook_in", "attn.k.hook_in", "attn.v.hook_in")


def tl4_spelling(name: str, known: Container[str] | None = None) -> str:
    """The canonical name for a TransformerLens 4 bridge spelling (``blocks.0.hook_in`` →
    ``blocks.0.hook_resid_pre``, ``embed.hook_out`` → ``hook_embed``); other names unchanged.

    ``known``: the model's points (its ``hook_dict``), for the spellings whose point depends on the family (a
    sublayer's output before a post-norm, a gated MLP's ``in`` and ``gate``). Without it those stay unchanged
    (unknown), never read as another family's point."""
    if name.endswith("_grad"):  # a cached gradient: `<point>_grad`
        return tl4_spelling(name[: -len("_grad")], known) + "_grad"
    if name in _TL4_MODEL:
        return _TL4_MODEL[name]
    if name == "ln_final.hook_in" and known is not None:  # the last block's output
        last = max((int(m.group(1)) for n in known if (m := _RESID_POST.fullmatch(n))), default=None)
        return name if last is None else f"blocks.{last}.hook_resid_post"
    match = _BLOCK_NAME.fullmatch(name)
    if match is None:
        return name
    block, rest = f"blocks.{match.group(1)}.", match.group(2)
    if rest in _TL4_PROJECTION_IN and known is not None and f"{block}attn.hook_in" in known:
        return block + "attn.hook_in"
    if rest in _TL4_SUBLAYER_OUT and known is not None:
        point, post_norm = _TL4_SUBLAYER_OUT[rest]
        return name if f"{block}{post_norm}.hook_normalized" in known else block + point
    if rest in _TL4_MLP and known is not None:
        gated, ungated = _TL4_MLP[rest]
        point = gated if f"{block}mlp.hook_pre_linear" in known else ungated
        return name if point is None else block + point
    if rest in _TL4_BLOCK:
        return block + _TL4_BLOCK[rest]
    return name


class UnknownHookError(KeyError):
    """A name that is not a hook point of this model; the message lists the closest valid names."""

    def __init__(self, name: str, valid: Iterable[str], param: str | None = None) -> None:
        valid = list(valid)
        close = difflib.get_close_matches(name, valid, n=5, cutoff=0.5)
        hint = f" Closest valid names: {close}." if close else ""
        example = valid[0] if valid else "?"
        where = f" (in `{param}`)" if param else ""
        super().__init__(
            f"Unknown hook point {name!r}{where}.{hint} Valid names look like {example!r}; see "
            "`model.hook_dict` for all of them."
        )
        self.name = name
        self.suggestions = close

    def __str__(self) -> str:
        return str(self.args[0])


class HookOffError(ValueError):
    """A hook point a setting switches off was named (``attn.hook_result`` under ``cfg.use_attn_result=False``, the
    split-input points ``hook_q_input`` … while their ``cfg`` switch is False)."""


class LayerOutOfRangeError(KeyError, IndexError):
    """A hook name or key whose layer is outside ``0 .. n_layers - 1``."""

    def __str__(self) -> str:
        return str(self.args[0])


class NotCachedError(KeyError):
    """A valid hook point that this cache does not hold."""

    def __str__(self) -> str:
        return str(self.args[0])


def canonical_name(name: str, layer: int | None = None, layer_type: str | None = None) -> str:
    """Canonical hook name from the grammar's shorthand (the core of `utils.get_act_name`, which adds
    TransformerLens' aliases and compact forms).

    Example:
        >>> canonical_name("resid_post", 3)
        'blocks.3.hook_resid_post'
        >>> canonical_name("scale", 2, "ln1")
        'blocks.2.ln1.hook_scale'
    """
    if not isinstance(name, str):
        raise TypeError(f"`name` must be a shorthand str such as 'resid_post', got {type(name).__name__}.")
    if layer is not None:
        index = as_index(layer)
        if index is None:
            raise TypeError(f"`layer` must be an int, got {layer!r} ({type(layer).__name__}).")
        layer = index
    where = _SHORT.get(name)
    if where is None:
        close = difflib.get_close_matches(name, _SHORT, n=3)
        hint = f" Did you mean {close}?" if close else ""
        raise KeyError(f"Unknown shorthand {name!r}.{hint} Valid ones: {sorted(_SHORT)}.")
    name = _RENAME.get(name, name)
    if where == "":
        return f"hook_{name}"
    if where == "norm":
        norm = layer_type or ("ln_final" if layer is None else None)
        if norm not in _NORMS:
            raise KeyError(
                f"{name!r} needs a norm: `layer_type` one of {list(_NORMS[:4])} with a layer, or no layer for "
                f"ln_final; got layer_type={layer_type!r}."
            )
        return f"ln_final.hook_{name}" if norm == "ln_final" else f"blocks.{layer}.{norm}.hook_{name}"
    if layer is None:
        raise KeyError(f"Shorthand {name!r} needs a layer index, e.g. ({name!r}, 0).")
    sub = "" if where == "block" else f"{where}."
    return f"blocks.{layer}.{sub}hook_{name}"


def tl_act_name(name: str, layer: int | None = None, layer_type: str | None = None) -> str:
    """TransformerLens' `get_act_name` rule over this grammar: a name it knows (after its aliases: ``"key"``,
    ``"attn_logits"``, layer types ``"a"`` / ``"m"`` / ``"b"``) gets the grammar's canonical name, and any other
    name gets TransformerLens' own construction, ``blocks.{layer}.[{layer_type}.]hook_{name}``: ``"in"`` with
    layer 3 is ``blocks.3.hook_in``, TransformerLens 4's spelling of ``blocks.3.hook_resid_pre``. Whether the
    result is a point of a model is for the model (or a cache) to say.

    Example:
        >>> tl_act_name("key", 6, "a"), tl_act_name("in", 3), tl_act_name("in", 3, "a")
        ('blocks.6.attn.hook_k', 'blocks.3.hook_in', 'blocks.3.attn.hook_in')
    """
    name = _TL_NAME_ALIAS.get(name, name)
    kind = _TL_LAYER_TYPE.get(layer_type, layer_type) if layer_type is not None else None
    if name in _SHORT:
        full = canonical_name(name, layer, kind if kind not in (None, "", "attn", "mlp") else None)
        if kind in ("attn", "mlp") and f".{kind}." not in full:
            raise ValueError(f"`layer_type`={layer_type!r} does not fit {name!r}, which is {full!r}; leave it out.")
        return full
    if name == "mid":  # SoLU's MLP point, which TransformerLens places in the MLP
        kind = "mlp"
    block = "" if layer is None else f"blocks.{layer}."
    sub = f"{kind}." if kind else ""
    return f"{block}{sub}hook_{name}"


class HookNames:
    """Resolves names against one model's hook points (``valid``, in canonical order)."""

    def __init__(self, valid: Sequence[str], n_layers: int) -> None:
        self.valid = list(valid)
        self.valid_set = set(valid)
        self.n_layers = n_layers
        # The points a setting switches off (name -> how to switch it on), read at each call: a selection of
        # many names leaves them out, and naming one raises `HookOffError`.
        self.off: Callable[[], Mapping[str, str]] = dict
        # On-demand points (`split_inputs.ON_DEMAND`): selections of many points leave them out; named, they run.
        self.lazy: Callable[[], Collection[str]] = frozenset

    # -- one name ---------------------------------------------------------------------------------
    def key(self, key: Any, param: str = "name") -> str:
        """Exactly one canonical name for a canonical name or a ``(shorthand, layer[, layer_type])`` key."""
        if isinstance(key, tuple):
            if not key or not isinstance(key[0], str) or len(key) > 3:
                raise TypeError(
                    f"`{param}`={key!r}: a key tuple is (shorthand, layer[, layer_type]), e.g. ('resid_post', 0)."
                )
            layer = key[1] if len(key) > 1 else None
            if layer is not None:
                index = as_index(layer)
                if index is None:
                    raise TypeError(
                        f"`{param}`={key!r}: the layer must be an int (or a 0-d integer tensor), got "
                        f"{type(layer).__name__}."
                    )
                self._check_layer(index, key)
                layer = index + self.n_layers if index < 0 else index
            name = tl4_spelling(tl_act_name(key[0], layer, key[2] if len(key) > 2 else None), self.valid_set)
        elif isinstance(key, str):
            if key in self.valid_set:
                return self._on(key)
            short = key in _SHORT and _SHORT[key] in ("", "norm")
            name = canonical_name(key) if short else tl4_spelling(key, self.valid_set)
        else:
            raise TypeError(
                f"`{param}` must be a hook name (str) or a key tuple like ('resid_post', 0), got "
                f"{type(key).__name__} {key!r}."
            )
        return self.check(name, param)

    def check(self, name: str, param: str | None = None) -> str:
        """``name`` itself if it is a hook point; otherwise the most specific error."""
        if name in self.valid_set:
            return self._on(name)
        match = _BLOCK_NAME.fullmatch(name)
        if match and f"blocks.0.{match.group(2)}" in self.valid_set:
            self._check_layer(int(match.group(1)), name)
        if name in _SHORT:
            raise KeyError(f"Shorthand {name!r} needs a layer index here, e.g. ({name!r}, 0).")
        raise UnknownHookError(name, self.valid, param)

    def _on(self, name: str) -> str:
        why = self.off().get(name)
        if why is not None:
            raise HookOffError(f"{name!r} is switched off: {why}")
        return name

    def _check_layer(self, layer: int, key: Any) -> None:
        if not -self.n_layers <= layer < self.n_layers:
            raise LayerOutOfRangeError(
                f"{key!r}: layer {layer} is out of range; this model has {self.n_layers} layers, so a layer must "
                f"be 0..{self.n_layers - 1} (or -{self.n_layers}..-1 from the end)."
            )

    # -- many names -----------------------------------------------------------------------------
    def select(self, spec: NameFilter, param: str = "names_filter") -> list[str]:
        """Canonical names selected by ``spec`` (None selects all), in canonical order, no repeats.

        Raises `ValueError` when a predicate or list selects nothing.
        """
        off, lazy = self.off(), self.lazy()
        if spec is None:
            return [n for n in self.valid if n not in off and n not in lazy]
        if isinstance(spec, (str, tuple)) and not _is_list_of_specs(spec):
            return self._one(spec, param)
        if callable(spec):
            try:
                names = [n for n in self.valid if n not in off and spec(n)]
            except Exception as e:
                raise TypeError(f"`{param}` predicate {spec!r} failed on a hook name: {e!r}.") from e
            if not all(n in lazy for n in names):  # a predicate matching only on-demand points names them
                names = [n for n in names if n not in lazy]
            if not names:
                raise ValueError(
                    f"`{param}` predicate {spec!r} matched no hook point. Names look like {self.valid[:3]}; see "
                    "`model.hook_dict`."
                )
            return names
        if isinstance(spec, (list, tuple, set, frozenset)):
            if not spec:
                raise ValueError(f"`{param}` is empty; give at least one hook name, or None for all.")
            chosen = {n for item in spec for n in self._one(item, param)}
            return [n for n in self.valid if n in chosen]
        raise TypeError(
            f"`{param}` must be None, a hook name, a key like ('resid_post', 0), a list of those, or a predicate "
            f"name -> bool; got {type(spec).__name__} {spec!r}."
        )

    def _one(self, item: Any, param: str) -> list[str]:
        if isinstance(item, str) and item not in self.valid_set and _SHORT.get(item) in ("block", "attn", "mlp"):
            off = self.off()
            names = [n for layer in range(self.n_layers) if (n := canonical_name(item, layer)) in self.valid_set]
            if names and all(n in off for n in names):
                self._on(names[0])  # every layer's point is off: say why
            names = [n for n in names if n not in off]
            if not names:
                raise ValueError(f"`{param}`: shorthand {item!r} names no hook point of this model.")
            return names
        if callable(item) and not isinstance(item, str):
            return self.select(item, param)
        return [self.key(item, param)]


def _is_list_of_specs(spec: str | tuple) -> bool:
    """A tuple is a key ``(shorthand, layer[, layer_type])`` unless it reads as a list of names."""
    if isinstance(spec, str):
        return False
    if not spec or not isinstance(spec[0], str):
        return True
    if len(spec) == 1:
        return spec[0] not in _SHORT
    return spec[0] not in _SHORT or isinstance(spec[1], str)
