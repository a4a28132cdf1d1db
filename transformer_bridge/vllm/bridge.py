"""`VLLMBridge`: TransformerLens hook names, hooks, caches and per-request interventions on a vLLM engine."""

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from .. import ActivationCache
from . import compiled, internals, worker
from .engine import Finished, Request, run_requests
from .harvest import HarvestModel
from .interventions import Intervention, encode_all
from .naming import RECOMPUTED, NameFilter, ServedNames, needed_for
from .options import sampling_fields
from .patterns import scores_and_pattern

Prompt = str | Sequence[str] | Tensor | Sequence[Sequence[int]]
HookFn = Callable[[Tensor, Any], Tensor | None]


class CompiledEngineError(RuntimeError):
    """A Python hook asked of an engine that runs compiled code, where it would never fire."""


@dataclasses.dataclass
class VLLMConfig:
    """The sizes a cache and its users read (TransformerLens' names)."""

    n_layers: int
    n_heads: int
    n_key_value_heads: int
    d_head: int
    d_model: int
    d_vocab: int
    d_mlp: int
    architecture: str
    default_prepend_bos: bool = True


@dataclasses.dataclass
class VLLMGeneration:
    """One request of `VLLMBridge.generate(..., return_dict=True)`.

    Attributes:
        sequences: ``[1, pos]`` prompt + generated ids.
        prompt_lengths: ``[1]`` the prompt's length.
        text: the generated text (None without a tokenizer).
        finish_reason: vLLM's (``"length"``, ``"stop"``).
        logprobs: ``[new]`` log-probability of each chosen token (``top_logprobs=k`` asked them of vLLM).
        top_logprobs / top_tokens: ``[new, k]``.
    """

    sequences: Int[Tensor, "1 pos"]
    prompt_lengths: Int[Tensor, " 1"]
    text: str | None
    finish_reason: str | None
    logprobs: Tensor | None = None
    top_logprobs: Tensor | None = None
    top_tokens: Tensor | None = None


class VLLMBridge:
    """A vLLM engine with the HF bridge's hook names, `run_with_cache`, `run_with_hooks`, `hooks()` and `generate`.

    Every activation is one tensor per hook name per request with the HF bridge's shapes (batch axis 1 per request);
    the residual points are the true residual stream (vLLM's ``hidden + residual``). Python hooks need an engine
    built with ``enforce_eager=True``; declared interventions (`Intervention`, `steer`) travel with each request.

    Example:
        >>> model = VLLMBridge.from_pretrained(path, enforce_eager=True, dtype="float32")
        >>> logits, cache = model.run_with_cache([[1, 5, 7, 9]], names_filter="resid_post")
        >>> out, caches = model.generate([[1, 5], [1, 7, 9]], max_new_tokens=4, return_cache=True)
    """

    def __init__(self, llm: Any, tokenizer: Any = None) -> None:
        internals.check_version()
        if not internals.core_in_process(llm):
            raise ValueError(
                "`llm` runs its engine core in another process (vLLM's default), which the bridge's per-request "
                f"taps cannot reach: build it with os.environ[{internals.MULTIPROCESSING_ENV!r}] = '0' set first, or "
                "with `VLLMBridge.from_pretrained` (which does so unless you set that variable). Worker processes "
                "(tensor_parallel_size > 1) are fine."
            )
        self.llm = llm
        info = llm.collective_rpc(worker.describe)[0]
        self.info = info
        self.compiled = bool(info["compiled"])
        self.declared = set(info.get("declared", ()))  # a compiled engine's points (`compiled_points`)
        self.names = ServedNames(info["points"], info["n_layers"], internals.fused_points(info))
        self.writable = set(info["writable"])
        self.cfg = VLLMConfig(info["n_layers"], info["n_heads"], info["n_kv_heads"], info["d_head"],
                              info["d_model"], info["d_vocab"], info["d_mlp"], info["class"])  # fmt: skip
        self.tokenizer = tokenizer if tokenizer is not None else internals.tokenizer_of(llm)
        self.hook_dict = dict.fromkeys(self.names.all)  # the names a cache resolves its keys against
        self._hooks: list[tuple[str, HookFn]] = []
        self._steering: list[Intervention] = []

    @classmethod
    def from_pretrained(cls, path: str, compiled_points: NameFilter = None, **engine_kwargs: Any) -> "VLLMBridge":
        """Build a vLLM engine for ``path`` (``engine_kwargs`` go to ``vllm.LLM``) and wrap it.

        ``compiled_points`` (a name, shorthand, list or filter) declares the points a compiled engine (vLLM's default)
        serves: their taps are traced into the compiled code when the engine is built, and declared interventions and
        captures of them then work without recompiling (`transformer_bridge.vllm.compiled`). Python hooks need
        ``enforce_eager=True``.

        Example:
            >>> model = VLLMBridge.from_pretrained("/models/SmolLM2-135M", enforce_eager=True, dtype="float32")
            >>> fast = VLLMBridge.from_pretrained(path, compiled_points=["blocks.10.hook_resid_post"])
        """
        from vllm import LLM  # optional dependency

        if compiled_points is None:
            with internals.core_in_this_process():
                return cls(LLM(model=str(path), **engine_kwargs))
        if engine_kwargs.get("enforce_eager"):
            raise ValueError("`compiled_points` declares points for a compiled engine; drop `enforce_eager=True`.")
        engine_kwargs = dict(engine_kwargs)
        install = functools.partial(compiled.install, names_filter=compiled_points)
        setup = compiled.worker_setup(compiled_points)
        with internals.core_in_this_process(), internals.on_model_load(install, engine_kwargs, setup):
            return cls(LLM(model=str(path), **engine_kwargs))

    def _harvest_model(self) -> HarvestModel:  # read by `harvest`: this engine as the loop's runner
        return HarvestModel(self)

    def _points_off(self) -> dict[str, str]:  # read by ActivationCache: names it reports as not served, not unknown
        return dict.fromkeys(self.names.fused, "vLLM's engine fuses it away (computed inside one kernel)")

    # -- hooks -------------------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def hooks(self, fwd_hooks: Sequence[tuple[NameFilter, HookFn]] = (), bwd_hooks: Sequence = (),
              reset_hooks_end: bool = True) -> Iterator["VLLMBridge"]:  # fmt: skip
        """Hooks on every request of the calls inside the block (removed on exit, also on error).

        Example:
            >>> with model.hooks(fwd_hooks=[("blocks.0.hook_resid_post", lambda x, hook: x * 2)]):
            ...     out = model.generate([[1, 5, 7]], max_new_tokens=4)
        """
        if bwd_hooks:
            raise ValueError("`bwd_hooks`: vLLM runs no backward pass; use the HF bridge for gradients.")
        if not reset_hooks_end:
            raise ValueError("`reset_hooks_end=False`: hooks on vLLM last for one `hooks()` block.")
        added = []
        for name_or_filter, fn in fwd_hooks:
            if not callable(fn):
                raise TypeError(f"A hook on {name_or_filter!r} must be callable as fn(tensor, hook).")
            for name in self.names.matching(name_or_filter, "fwd_hooks"):
                self._check_hookable(name)
                added.append((name, fn))
        self._hooks += added
        try:
            yield self
        finally:
            for entry in added:
                self._hooks.remove(entry)

    def _check_hookable(self, name: str) -> None:
        if self.compiled:
            raise CompiledEngineError(
                f"A Python hook on {name!r} would never fire: this vLLM engine runs compiled code. Build it with "
                "`enforce_eager=True`, or declare the edit (`Intervention` / `model.steer`)."
            )
        if name not in self.writable:
            raise ValueError(
                f"{name!r} is computed for caching only on vLLM (a hook cannot edit it); read it with "
                f"`run_with_cache`. Hookable points: {sorted(self.writable)[:4]} ..."
            )

    @contextlib.contextmanager
    def steer(self, point: str, *, positions: Sequence[int] | int | None = None, **operation: Any) -> Iterator[None]:
        """A declared intervention on every request of the calls inside the block (see `Intervention`).

        Example:
            >>> with model.steer("blocks.1.hook_resid_post", add=4.0 * direction, positions=[3]):
            ...     out = model.generate([[1, 5, 7]], max_new_tokens=4)
        """
        iv = Intervention(self.names.check(point, "point"), positions=positions, **operation)
        self._steering.append(iv)
        try:
            yield
        finally:
            self._steering.remove(iv)

    def run_with_hooks(self, input: Prompt, fwd_hooks: Sequence[tuple[NameFilter, HookFn]] = (),
                       **kwargs: Any) -> Float[Tensor, "batch pos d_vocab"] | list[Tensor]:  # fmt: skip
        """`forward` with temporary hooks.

        Example:
            >>> logits = model.run_with_hooks([[1, 5, 7]], fwd_hooks=[("blocks.0.hook_attn_out", zero)])
        """
        with self.hooks(fwd_hooks):
            return self.forward(input, **kwargs)

    # -- forwards ----------------------------------------------------------------------------------------------------
    def forward(
        self, input: Prompt, prepend_bos: bool | None = None, interventions: Sequence[Any] | None = None
    ) -> Float[Tensor, "batch pos d_vocab"] | list[Tensor]:
        """Logits of every position: ``[batch, pos, d_vocab]``, or one ``[1, pos, d_vocab]`` per request when the
        prompts differ in length.

        Example:
            >>> logits = model([[1, 5, 7, 9]])
        """
        rows, ragged = self._rows(input, prepend_bos)
        done = self._run(rows, interventions, {"max_tokens": 1, "temperature": 0.0}, "forward", {"unembed.hook_out"})
        logits = [self._logits(d) for d in done]
        return logits if ragged else torch.cat(logits)

    __call__ = forward

    def run_with_cache(
        self, input: Prompt, names_filter: NameFilter = None, device: str | torch.device | None = None,
        prepend_bos: bool | None = None, interventions: Sequence[Any] | None = None,
    ) -> tuple[Tensor | list[Tensor], ActivationCache | list[ActivationCache]]:  # fmt: skip
        """``(logits, ActivationCache)`` as the HF bridge's `run_with_cache`; ragged prompts give lists (one per
        request, batch axis 1).

        Example:
            >>> logits, cache = model.run_with_cache([[1, 5, 7, 9]], names_filter=lambda n: "resid" in n)
            >>> cache["resid_post", 0].shape       # [1, 4, d_model]
        """
        rows, ragged = self._rows(input, prepend_bos)
        names = self.names.matching(names_filter)
        fields = {"max_tokens": 1, "temperature": 0.0}
        done = self._run(rows, interventions, fields, "forward", needed_for(names) | {"unembed.hook_out"})
        logits = [self._logits(d) for d in done]
        caches = [self._cache(d, names, device, None) for d in done]
        if ragged:
            return logits, caches
        return torch.cat(logits), _stack(caches, self)

    def _logits(self, d: Finished) -> Tensor:
        """The model's logits ``[1, pos, d_vocab]``: ``unembed.hook_out`` (the head's output, as in the HF bridge), then
        the final soft-cap where the model has one (Gemma 2), computed as vLLM's logits processor does."""
        out = d.captured["unembed.hook_out"][None]
        cap = self.info.get("final_softcap")
        return out if cap is None else torch.tanh(out / cap) * cap

    def _run(self, rows: list[list[int]], interventions: Sequence[Any] | None, fields: dict[str, Any], mode: str,
             capture: set[str]) -> list[Finished]:  # fmt: skip
        per_request = self._interventions(interventions, len(rows))
        if self.compiled:
            points = set(capture) | {iv["point"] for ivs in per_request for iv in ivs}
            undeclared = sorted(points - self.declared)
            if undeclared:
                raise CompiledEngineError(
                    f"{undeclared[:6]} {'is' if len(undeclared) == 1 else 'are'} not served by this compiled engine: "
                    "its points are declared when it is built, `VLLMBridge.from_pretrained(path, "
                    f"compiled_points=[...])` (declared here: {sorted(self.declared)[:6]}), or build it with "
                    "`enforce_eager=True`."
                )
        fns: dict[str, list[HookFn]] = {}
        for name, fn in self._hooks:
            fns.setdefault(name, []).append(fn)
        requests = [Request(r, ivs) for r, ivs in zip(rows, per_request, strict=True)]
        return run_requests(self.llm, requests, fields, mode, capture, fns)

    def _interventions(self, given: Sequence[Any] | None, n: int) -> list[list[dict[str, Any]]]:
        if given is None:
            given = [None] * n
        if isinstance(given, Intervention) or len(given) != n:
            raise ValueError(
                f"`interventions` takes one entry per request ({n}): a list of `Intervention`s or None each."
            )
        out = []
        for items in given:
            items = [items] if isinstance(items, Intervention) else list(items or [])
            for iv in items:
                self.names.check(iv.point, "interventions")
                if iv.point not in self.writable:
                    raise ValueError(f"{iv.point!r} is computed for caching only on vLLM; it cannot be intervened on.")
            out.append(encode_all([*self._steering, *items]))
        return out

    def _cache(self, d: Finished, names: list[str], device: Any, n_prompt: int | None) -> ActivationCache:
        tensors: dict[str, Tensor] = {}
        for name in names:
            if name.endswith(RECOMPUTED):
                block = name.rsplit("attn.", 1)[0]
                q, k = d.captured[f"{block}attn.hook_rot_q"], d.captured[f"{block}attn.hook_rot_k"]
                layer = int(block.split(".")[1])
                scores, pattern = scores_and_pattern(q, k, **self.info["attention"][layer])
                value = scores if name.endswith("hook_attn_scores") else pattern
            else:
                value = d.captured[name][None]
            tensors[name] = value if device is None else value.to(device)
        n = len(d.tokens)
        mask = torch.ones(1, n, dtype=torch.long)
        lengths = None if n_prompt is None else torch.tensor([n_prompt])
        return ActivationCache(tensors, self, attention_mask=mask, prompt_lengths=lengths)

    # -- inputs --------------------------------------------------------------------------------------------------------
    def to_tokens(self, text: str | Sequence[str], prepend_bos: bool | None = None) -> list[list[int]]:
        """Token ids of each text (BOS first unless ``prepend_bos=False``), unpadded.

        Example:
            >>> model.to_tokens("Hello")
        """
        if self.tokenizer is None:
            raise ValueError("This engine has no tokenizer (skip_tokenizer_init=True): give token ids.")
        texts = [text] if isinstance(text, str) else list(text)
        bos = self.tokenizer.bos_token_id
        add = self.cfg.default_prepend_bos if prepend_bos is None else prepend_bos
        out = []
        for t in texts:
            ids = self.tokenizer(t, add_special_tokens=False)["input_ids"]
            out.append(([bos] if add and bos is not None and ids[:1] != [bos] else []) + ids)
        return out

    def _rows(self, input: Prompt, prepend_bos: bool | None) -> tuple[list[list[int]], bool]:
        """Token ids per request, and whether they differ in length."""
        if isinstance(input, str) or (isinstance(input, (list, tuple)) and input and isinstance(input[0], str)):
            rows = self.to_tokens(input, prepend_bos)
        elif isinstance(input, Tensor):
            if input.dim() not in (1, 2) or input.is_floating_point():
                raise TypeError(f"Token ids must be an integer tensor [batch, pos], got shape {tuple(input.shape)}.")
            rows = (input[None] if input.dim() == 1 else input).tolist()
        elif isinstance(input, (list, tuple)) and input and isinstance(input[0], (list, tuple)):
            rows = [[int(t) for t in r] for r in input]
        else:
            raise TypeError("`input` must be text, a list of texts, token ids [batch, pos], or a list of id lists.")
        if any(len(r) == 0 for r in rows):
            raise ValueError("Every request needs at least one token.")
        return rows, len({len(r) for r in rows}) > 1

    # -- generation ----------------------------------------------------------------------------------------------------
    def generate(self, input: Prompt, max_new_tokens: int | None = None, *, return_cache: bool = False,
                 names_filter: NameFilter = None, device: str | torch.device | None = None,
                 return_type: str = "input", return_dict: bool = False, prepend_bos: bool | None = None,
                 interventions: Sequence[Any] | None = None, **options: Any) -> Any:  # fmt: skip
        """Generate with the engine (continuous batching, paged KV cache), hooks and interventions at every step.

        ``options`` are the HF bridge's (`options.OPTIONS`: temperature, top_k/p, min_p, seed, stop_strings,
        eos_token_id, top_logprobs, penalties ...; greedy unless ``do_sample=True`` or a temperature); one vLLM
        cannot honour raises naming it. ``interventions``: per request, a list of `Intervention`s (or None).
        ``return_cache=True`` adds, per request, the `ActivationCache` of prompt + output from one more forward
        over those tokens with the same hooks and interventions (`run_with_cache`'s, with ``prompt_lengths``).

        Example:
            >>> out = model.generate([[1, 5], [1, 7, 9]], max_new_tokens=4)
            >>> out, caches = model.generate("Hello", max_new_tokens=4, return_cache=True, names_filter="resid_post")
        """
        rows, _ = self._rows(input, prepend_bos)
        fields = sampling_fields({"max_new_tokens": max_new_tokens, **options})
        done = self._run(rows, interventions, fields, "generate", set())
        results = [self._generation(d, fields) for d in done]
        caches = None
        if return_cache:
            names = self.names.matching(names_filter)
            full = [d.tokens + d.generated for d in done]
            again = self._run(full, interventions, {"max_tokens": 1, "temperature": 0.0}, "recompute",
                              needed_for(names))  # fmt: skip
            caches = [self._cache(a, names, device, len(d.tokens)) for a, d in zip(again, done, strict=True)]
        out = self._shape(input, results, return_type, return_dict)
        return (out, caches) if return_cache else out

    def _generation(self, d: Finished, fields: dict[str, Any]) -> VLLMGeneration:
        completion = d.output.outputs[0]
        seq = torch.tensor([d.tokens + d.generated])
        gen = VLLMGeneration(seq, torch.tensor([len(d.tokens)]), completion.text, completion.finish_reason)
        if fields.get("logprobs") and completion.logprobs:
            chosen, tops, ids = [], [], []
            for tok, step in zip(d.generated, completion.logprobs, strict=False):
                chosen.append(step[tok].logprob)
                best = sorted(step.items(), key=lambda kv: -kv[1].logprob)[: fields["logprobs"]]
                ids.append([t for t, _ in best])
                tops.append([lp.logprob for _, lp in best])
            gen.logprobs, gen.top_logprobs = torch.tensor(chosen), torch.tensor(tops)
            gen.top_tokens = torch.tensor(ids)
        return gen

    def _shape(self, input: Prompt, results: list[VLLMGeneration], return_type: str, return_dict: bool) -> Any:
        if return_dict:
            return results
        text_in = isinstance(input, str) or (isinstance(input, (list, tuple)) and isinstance(input[0], str))
        if return_type == "str" or (return_type == "input" and text_in and self.tokenizer is not None):
            texts = [self.tokenizer.decode(r.sequences[0].tolist(), skip_special_tokens=True) for r in results]
            return texts[0] if isinstance(input, str) else texts
        seqs = [r.sequences for r in results]
        if isinstance(input, Tensor) and len({s.shape[1] for s in seqs}) == 1:
            return torch.cat(seqs)
        return [s[0].tolist() for s in seqs]


def _stack(caches: list[ActivationCache], model: VLLMBridge) -> ActivationCache:
    """Requests of one length as one cache with a batch axis."""
    if len(caches) == 1:
        return caches[0]
    tensors = {k: torch.cat([c[k] for c in caches]) for k in caches[0]}
    mask = torch.cat([c.attention_mask for c in caches])
    return ActivationCache(tensors, model, attention_mask=mask)
