"""TransformerLens' component tree over the core bridge: ``model.blocks[3].attn.hook_pattern``,
``model.blocks[3].attn.W_Q``, ``model.blocks[3].ln1``, ``model.embed.W_E``, ``model.unembed.W_U``,
``model.ln_final``, and root-level points as attributes (``model.hook_embed``).

The components are light views, not modules: each answers attribute lookups with the hook point
of that name under its prefix, a child view, or a weight (per-layer weights are views of the HF
parameters where the layout allows, see `compat.weights`). ``.module`` is the HF module.
"""

from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from ..core import BridgeCore
from ..hooks.names import tl4_spelling
from ..hooks.points import HookPoint
from ..sites.module_paths import get_module, optional_module
from ..sites.moe import is_moe_block
from . import weights

Weight = Callable[[BridgeCore, int], Any]


class ComponentView:
    """Hook points under ``prefix`` as attributes, child components, and weights of one layer.

    Example:
        >>> model.blocks[0].attn.hook_pattern.add_hook(lambda p, hook: None)
        >>> model.blocks[0].attn.W_Q.shape                 # [n_heads, d_model, d_head]
    """

    def __init__(
        self,
        core: BridgeCore,
        prefix: str,
        module: nn.Module | None,
        children: dict[str, "ComponentView"] | None = None,
        weight_fns: dict[str, Weight] | None = None,
        layer: int | None = None,
        model_weights: dict[str, Callable[[BridgeCore], Any]] | None = None,
    ) -> None:
        self._core, self._prefix, self.module = core, prefix, module
        self._children = children or {}
        self._weights = weight_fns or {}
        self._layer = layer
        self._model_weights = model_weights or {}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        point = self._core.hook_dict.get(tl4_spelling(self._prefix + name, self._core.hook_dict))
        if point is not None:
            return point
        if name == "hook_in" and self._prefix.endswith(".ln2."):  # what the MLP's norm reads (TL 4's ln2.hook_in)
            which = "hook_resid_pre" if self._core.cfg.parallel_attn_mlp else "hook_resid_mid"
            point = self._core.hook_dict.get(self._prefix[: -len("ln2.")] + which)
            if point is not None:
                return point
        if name in self._children:
            return self._children[name]
        if name in self._weights:
            return self._weights[name](self._core, self._layer)
        if name in self._model_weights:
            return self._model_weights[name](self._core)
        if self.module is not None and hasattr(self.module, name):
            return getattr(self.module, name)
        raise AttributeError(
            f"{self._prefix.rstrip('.') or 'model'} has no attribute {name!r}; it has hook points "
            f"{self.hook_names()}, components {list(self._children)} and weights "
            f"{[*self._weights, *self._model_weights]}."
        )

    @property
    def original_component(self) -> nn.Module | None:
        """TransformerLens 4's name for the HF module this component stands for (``.module``)."""
        return self.module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the HF module itself (``model.blocks[0].mlp(x)`` is the HF MLP's output)."""
        if self.module is None:
            raise TypeError(f"{self._prefix.rstrip('.') or 'model'} has no single HF module to call.")
        return self.module(*args, **kwargs)

    def _io_point(self, which: str) -> HookPoint | None:
        return self._core.hook_dict.get(tl4_spelling(self._prefix + which, self._core.hook_dict))

    def add_hook(
        self, hook: Callable, dir: str = "fwd", is_permanent: bool = False, level: int | None = None,
        prepend: bool = False,
    ) -> Any:  # fmt: skip
        """TransformerLens 4's component hook: ``hook`` on this component's output point (``hook_out``, e.g.
        ``blocks.0.hook_attn_out`` for ``model.blocks[0].attn``). Returns the point's handle.

        Example:
            >>> model.blocks[0].attn.add_hook(lambda out, hook: out * 0.5)   # halves block 0's attention output
            >>> model.blocks[0].attn.remove_hooks()
        """
        point = self._io_point("hook_out")
        if point is None:
            raise AttributeError(
                f"{self._prefix.rstrip('.') or 'model'} has no output hook point; add hooks to one of its points "
                f"{self.hook_names()}."
            )
        return point.add_hook(hook, dir=dir, is_permanent=is_permanent, level=level, prepend=prepend)  # type: ignore[arg-type]

    def remove_hooks(self, dir: str = "fwd", including_permanent: bool = False, level: int | None = None) -> None:
        """Remove the hooks on this component's input and output points (``hook_in`` / ``hook_out``)."""
        for which in ("hook_in", "hook_out"):
            point = self._io_point(which)
            if point is not None:
                point.remove_hooks(dir, including_permanent=including_permanent, level=level)  # type: ignore[arg-type]

    def hook_names(self) -> list[str]:
        """The hook points directly on this component (relative names)."""
        return [n[len(self._prefix) :] for n in self._core.hook_dict if n.startswith(self._prefix)
                and "." not in n[len(self._prefix) :]]  # fmt: skip

    def hook_points(self) -> list[HookPoint]:
        """Every hook point under this component."""
        return [p for n, p in self._core.hook_dict.items() if n.startswith(self._prefix)]

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *self.hook_names(), *self._children, *self._weights, *self._model_weights})

    def __repr__(self) -> str:
        kind = type(self.module).__name__ if self.module is not None else "component"
        return f"<{self._prefix.rstrip('.') or 'model'}: {kind}, hook points {self.hook_names()}>"


class Blocks:
    """``model.blocks``: indexable and iterable like TransformerLens' ModuleList of blocks."""

    def __init__(self, views: list[ComponentView]) -> None:
        self._views = views

    def __getitem__(self, index: int | slice) -> Any:
        return self._views[index]

    def __len__(self) -> int:
        return len(self._views)

    def __getattr__(self, name: str) -> ComponentView:
        """``getattr(model.blocks, "3")``: a ModuleList's child names, which dotted-path walkers use."""
        if name.isdigit() and int(name) < len(self.__dict__.get("_views", ())):
            return self._views[int(name)]
        raise AttributeError(f"model.blocks has no attribute {name!r}; index it: model.blocks[0].")

    def __iter__(self) -> Iterator[ComponentView]:
        return iter(self._views)


def _held(block: nn.Module, path: str | None) -> nn.Module | None:
    """The module at ``path`` in ``block``, or None where this block has none (a hybrid's mixer block)."""
    try:
        return optional_module(block, path, may_be_absent=True)
    except AttributeError:
        return None


def _norm(core: BridgeCore, prefix: str, path: str | None, root: nn.Module) -> ComponentView | None:
    if path is None or not any(n.startswith(prefix) for n in core.hook_dict):
        return None
    module = get_module(root, path)
    return ComponentView(
        core, prefix, module, model_weights={"w": lambda c: module.weight, "b": lambda c: getattr(module, "bias", None)}
    )


def build_components(core: BridgeCore) -> tuple[Blocks, dict[str, ComponentView]]:
    """``model.blocks`` and the model-level components (``embed``, ``pos_embed``, ``unembed``, ``ln_final``)."""
    a = core.adapter
    blocks_module = get_module(core.hf_model, a.blocks)
    views = []
    for layer, block in enumerate(blocks_module):
        p = f"blocks.{layer}."
        attn = ComponentView(core, p + "attn.", get_module(block, a.attn), weight_fns=weights.ATTN_WEIGHTS, layer=layer)
        mlp_module = _held(block, a.mlp_down.rsplit(".", 1)[0]) if "." in a.mlp_down else None
        mlp = ComponentView(core, p + "mlp.", mlp_module, weight_fns=weights.MLP_WEIGHTS, layer=layer)
        # TransformerLens 4's projection components (attn.q … attn.o, mlp.in / mlp.out): their hook_in / hook_out
        # resolve to the canonical points (attn.q.hook_out is attn.hook_q), `.original_component` is the HF module.
        projections = {"q": a.q or a.qkv, "k": a.k or a.qkv, "v": a.v or a.qkv, "o": a.o_proj}
        for key, path in projections.items():
            if (module := _held(block, path)) is not None:
                attn._children[key] = ComponentView(core, f"{p}attn.{key}.", module)
        for key, path in (("in", a.mlp_up or a.mlp_in), ("out", a.mlp_down)):
            if not is_moe_block(block, a.moe) and (module := _held(block, path)) is not None:
                mlp._children[key] = ComponentView(core, f"{p}mlp.{key}.", module)
        children: dict[str, ComponentView] = {"attn": attn, "mlp": mlp}
        for key in ("q_norm", "k_norm"):
            view = _norm(core, f"{p}attn.{key}.", getattr(a, key), block)
            if view is not None:
                attn._children[key] = view
        for key, path in (("ln1", a.ln1), ("ln2", a.ln2), ("ln1_post", a.attn_out), ("ln2_post", a.mlp_out)):
            view = _norm(core, f"{p}{key}.", path, block)
            if view is not None:
                children[key] = view
        views.append(ComponentView(core, p, block, children=children, layer=layer))
    model_level = {
        "embed": ComponentView(core, "embed.", get_module(core.hf_model, a.embed), model_weights={"W_E": weights.W_E}),
        "unembed": ComponentView(
            core,
            "unembed.",
            core.hf_model.get_output_embeddings(),
            model_weights={
                "W_U": weights.W_U,
                "b_U": weights.b_U,
                "W_U_raw": weights.W_U_raw,
                "b_U_raw": weights.b_U_raw,
            },
        ),
        "ln_final": _norm(core, "ln_final.", a.ln_final, core.hf_model),
    }
    if a.pos_embed:
        model_level["pos_embed"] = ComponentView(
            core, "pos_embed.", get_module(core.hf_model, a.pos_embed), model_weights={"W_pos": weights.W_pos}
        )
    return Blocks(views), {k: v for k, v in model_level.items() if v is not None}
