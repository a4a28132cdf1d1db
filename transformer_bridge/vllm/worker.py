"""The bridge inside a vLLM worker: torch hooks on the model's modules, the rows of each request, captures.

Functions here are sent to every worker with ``collective_rpc`` (``fn(worker, ...)``). A worker keeps one `Taps`
per model. Each forward, the first hook reads which request owns which rows of the flattened batch from the
step's metadata (`internals.batch_rows`) and its positions from the model's ``positions`` input; every point then
runs, per request, that request's declared interventions, the user's functions (in-process engines) and its
capture. Captured rows are stored per request and position, so a request recomputed after preemption overwrites
its own rows and never another's.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from . import internals
from .hf_sites import batched, hf_layer_sites
from .interventions import apply_interventions
from .sites import Shards, Site, model_sites

_TAPS: dict[int, "Taps"] = {}  # id(model) -> its taps, in this worker process


@dataclasses.dataclass
class RequestContext:
    """What ``hook.ctx`` holds on vLLM: the chunk of one request that the hook sees.

    Attributes:
        request: the request's index in the call (its row in the outputs).
        phase: ``"forward"`` (run_with_hooks / run_with_cache), ``"prefill"`` (prompt tokens), ``"decode"``
            (generated tokens fed back) or ``"recompute"`` (the cache-building forward of ``return_cache``).
        positions: ``[1, chunk]`` absolute position of each token in its request.
        is_generated: ``[1, chunk]`` True where the token was generated.
        pad_mask: ``[1, chunk]`` all False (requests are never padded on vLLM).
        step: 0 at prefill, then the number of tokens generated before this chunk.
    """

    request: int
    phase: str
    positions: Tensor
    is_generated: Tensor
    pad_mask: Tensor
    step: int


class VLLMHook:
    """The ``hook`` argument of a function on vLLM: ``hook.name``, ``hook.layer()``, ``hook.ctx``."""

    def __init__(self, name: str, ctx: RequestContext) -> None:
        self.name, self.ctx = name, ctx

    def layer(self) -> int:
        parts = self.name.split(".")
        return int(parts[1]) if parts[0] == "blocks" else -1

    def __repr__(self) -> str:
        return f"VLLMHook(name={self.name!r}, request={self.ctx.request}, phase={self.ctx.phase!r})"


class Taps:
    """One model's sites, what is asked of them, and what they captured."""

    def __init__(self, model: nn.Module, runner: Any) -> None:
        self.model, self.runner = model, runner
        self.fam = internals.family_of(model)
        rank, size = internals.tp_rank_size()
        self.shards = Shards(rank, size)
        self.n_layers = len(internals.submodule(model, self.fam.layers, "the decoder layers"))
        backend = self.fam.classes == (internals.TRANSFORMERS_BACKEND,)  # HF's own layers, on a batch of one
        self.sites: list[Site] = (
            model_sites(model, self.fam, self.n_layers, self.shards, hf_layer_sites, batched)
            if backend
            else model_sites(model, self.fam, self.n_layers, self.shards)
        )
        self.points = {p.name: (s, p) for s in self.sites for p in s.points}
        self.handles: list[Any] = []
        self.capture: set[str] = set()
        self.fns: dict[str, list[Callable]] = {}
        self.intervened: set[str] = set()
        self.store: dict[str, dict[str, list[tuple[Tensor, Tensor]]]] = {}
        self.rows: list[internals.Row] = []
        self.positions: Tensor | None = None
        self.vectors: dict[str, Any] = {}  # per request id: its interventions, as tensors (built once)
        self.declared: set[str] = set()  # a compiled engine's points, traced in when it was built (`compiled`)

    # -- plan ------------------------------------------------------------------------------------------------------
    def set_plan(self, capture: set[str], fns: dict[str, list[Callable]], intervened: set[str]) -> None:
        self.clear_hooks()
        self.capture, self.fns, self.intervened = set(capture), dict(fns), set(intervened)
        wanted = self.capture | set(self.fns) | self.intervened
        if not wanted:
            return
        if internals.model_is_compiled(self.model):
            # Compiled code: the declared points' taps are already traced in (`compiled.install`); nothing to hook.
            undeclared = sorted(wanted - self.declared)
            if fns or undeclared:
                raise RuntimeError(
                    "This vLLM engine runs compiled code: torch hooks registered now never fire. Build the engine "
                    f"with `enforce_eager=True`, or declare {undeclared} in `compiled_points=` (no Python hooks)."
                )
            return
        self.handles.append(self.model.register_forward_pre_hook(self._begin, with_kwargs=True))
        for site in self.sites:
            if not any(p.name in wanted for p in site.points):
                continue
            if site.kind == "pre":
                handle = site.module.register_forward_pre_hook(self._pre(site), with_kwargs=True)
            elif site.kind == "attn":  # the Transformers backend's (query, key), where HF hands them to vLLM
                handle = internals.tap_attention(site.module, lambda q, k, site=site: self._run_site(site, (q, k)))
            else:
                handle = site.module.register_forward_hook(self._fwd(site))
            self.handles.append(handle)

    def clear_hooks(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    # -- per forward -----------------------------------------------------------------------------------------------
    def _begin(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        positions = args[1] if len(args) > 1 else kwargs.get("positions")
        self.positions = positions
        self.rows = internals.batch_rows(self.runner, int(positions.shape[-1]))

    def _pre(self, site: Site) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> Any:
            new = self._run_site(site, (args, kwargs))
            return None if new is None else new

        return hook

    def _fwd(self, site: Site) -> Callable:
        def hook(module: nn.Module, args: tuple, out: Any) -> Any:
            return self._run_site(site, out)

        return hook

    def _run_site(self, site: Site, x: Any) -> Any:
        changed = False
        for point in site.points:
            name = point.name
            if name not in self.capture and name not in self.fns and name not in self.intervened:
                continue
            t = point.get(x)
            if t is None:  # a gather to rank 0 (the logits on some platforms): other ranks hold nothing
                continue
            new, rows = self._run_point(name, t, point.put is not None)
            if rows is not None:
                x = point.put(x, new, rows)
                changed = True
        return x if changed else None

    def _run_point(self, name: str, t: Tensor, writable: bool) -> tuple[Tensor, Tensor | None]:
        """Interventions, then functions, per request; then the capture. ``(tensor, edited-row mask or None)``."""
        out, edited = t, None
        fns = self.fns.get(name, ())
        for row in self.rows:
            tag = row.tag
            if tag is None:
                continue
            s = slice(row.start, row.stop)
            positions = self.positions[s]
            if name in self.intervened and tag.get("iv"):
                view = out[s]
                new = apply_interventions(tag, self.vectors, row.req_id, name, view, positions)
                if new is not view:
                    out, edited = self._write(out, t, edited, s, new)
            for fn in fns:
                view = out[s][None]
                before = view.clone()  # vLLM runs under inference_mode: no version counter tells of in-place edits
                returned = fn(view, VLLMHook(name, self._context(tag, row, positions)))
                if returned is not None and returned is not view:
                    if not isinstance(returned, Tensor) or returned.shape != view.shape:
                        raise ValueError(
                            f"A hook on {name!r} must return None or a tensor of shape {tuple(view.shape)}, got "
                            f"{getattr(returned, 'shape', type(returned).__name__)}."
                        )
                    out, edited = self._write(out, t, edited, s, returned[0])
                elif not torch.equal(view, before):
                    edited = self._mark(edited, t, s)
            if name in self.capture and tag.get("cap"):
                self.store.setdefault(tag["id"], {}).setdefault(name, []).append(
                    (positions.to("cpu", copy=True), out[s].detach().to("cpu", copy=True))
                )
        if edited is not None and not writable:
            raise ValueError(f"{name!r} is computed for caching only on vLLM; it cannot be edited.")
        return out, edited

    @staticmethod
    def _mark(edited: Tensor | None, t: Tensor, s: slice) -> Tensor:
        if edited is None:
            edited = torch.zeros(t.shape[0], dtype=torch.bool, device=t.device)
        edited[s] = True
        return edited

    def _write(self, out: Tensor, t: Tensor, edited: Tensor | None, s: slice, new: Tensor) -> tuple[Tensor, Tensor]:
        if out is t:
            out = t.clone()
        out[s] = new.to(out.dtype)
        return out, self._mark(edited, t, s)

    def _context(self, tag: dict, row: internals.Row, positions: Tensor) -> RequestContext:
        pos = positions[None]
        mode = tag.get("mode", "forward")
        first = int(pos[0, 0]) if pos.numel() else 0
        phase = ("prefill" if first < row.n_prompt else "decode") if mode == "generate" else mode
        generated = pos >= row.n_prompt if mode == "generate" else torch.zeros_like(pos, dtype=torch.bool)
        step = max(0, first - row.n_prompt + 1) if phase == "decode" else 0
        return RequestContext(int(tag["index"]), phase, pos, generated, torch.zeros_like(generated), step)

    # -- results ---------------------------------------------------------------------------------------------------
    def take(self, ids: list[str]) -> dict[str, dict[str, Tensor]]:
        """Each request's captures, ordered by position (a recomputed position keeps its last value)."""
        out = {}
        for rid in ids:
            chunks = self.store.pop(rid, {})
            out[rid] = {name: _by_position(name, rid, parts) for name, parts in chunks.items()}
        return out


def _by_position(name: str, rid: str, parts: list[tuple[Tensor, Tensor]]) -> Tensor:
    positions = torch.cat([p for p, _ in parts])
    rows = torch.cat([r for _, r in parts])
    n = int(positions.max()) + 1
    index = torch.full((n,), -1, dtype=torch.long)
    index[positions] = torch.arange(len(positions))  # later chunks win: a recomputed position keeps its last value
    if bool((index < 0).any()):
        missing = (index < 0).nonzero().flatten().tolist()[:8]
        raise RuntimeError(f"Request {rid}: {name!r} was never computed at positions {missing} (served from a cache?).")
    return rows[index]


# -- entry points for collective_rpc -------------------------------------------------------------------------------


def taps_of(worker: Any) -> Taps:
    model = internals.worker_model(worker)
    taps = _TAPS.get(id(model))
    if taps is None or taps.model is not model:
        taps = _TAPS[id(model)] = Taps(model, internals.worker_runner(worker))
    return taps


def describe(worker: Any) -> dict[str, Any]:
    """What the driver needs to name points: sizes, the served points, rank, and whether the model is compiled."""
    taps = taps_of(worker)
    core = internals.submodule(taps.model, f"{taps.fam.layers}.0.{taps.fam.core}", "block 0's attention")
    n_q, n_kv, d_head, scale = internals.head_sizes(core)
    embed = internals.submodule(taps.model, taps.fam.embed, "the token embedding")
    cfg = getattr(getattr(internals.worker_runner(worker), "model_config", None), "hf_config", None)
    return {
        "class": type(taps.model).__name__,
        "points": list(taps.points),
        "writable": [n for n, (_, p) in taps.points.items() if p.put is not None],
        "n_layers": taps.n_layers,
        "n_heads": n_q * taps.shards.size,
        "n_kv_heads": n_kv * taps.shards.size,
        "d_head": d_head,
        "scale": scale,
        "d_model": int(getattr(cfg, "hidden_size", embed.embedding_dim)),
        "d_vocab": int(getattr(cfg, "vocab_size", 0)),
        "d_mlp": int(getattr(cfg, "intermediate_size", 0) or 0),
        "attention": [  # per layer: scale, sliding window, soft-cap (for the recomputed scores and patterns)
            internals.attention_params(
                internals.submodule(taps.model, f"{taps.fam.layers}.{i}.{taps.fam.core}", f"block {i}'s attention")
            )
            for i in range(taps.n_layers)
        ],
        "final_softcap": internals.final_softcap(taps.model),
        "rank": taps.shards.rank,
        "tp": taps.shards.size,
        "compiled": internals.model_is_compiled(taps.model),
        "declared": sorted(taps.declared),
    }


def set_plan(worker: Any, capture: list[str], fns: dict[str, list[Callable]] | bytes, intervened: list[str]) -> None:
    """Install a plan; ``fns`` arrive cloudpickled (bytes) when the workers are other processes."""
    if isinstance(fns, bytes):
        import cloudpickle  # a dependency of vLLM: only multi-process engines send pickled functions

        fns = cloudpickle.loads(fns)
    taps_of(worker).set_plan(set(capture), fns, set(intervened))


def clear(worker: Any) -> None:
    taps = taps_of(worker)
    taps.clear_hooks()
    taps.store.clear()
    taps.vectors.clear()


def take(worker: Any, ids: list[str]) -> dict[str, dict[str, Tensor]] | None:
    taps = taps_of(worker)
    result = taps.take(ids)
    return result if taps.shards.rank == 0 else None


def weights(worker: Any, names: list[str]) -> dict[str, Tensor] | None:
    """Whole (gathered) parameters by vLLM name, from rank 0."""
    taps = taps_of(worker)
    params = dict(taps.model.named_parameters())
    out = {n: params[n].detach().to("cpu", copy=True) for n in names}
    return out if taps.shards.rank == 0 else None
