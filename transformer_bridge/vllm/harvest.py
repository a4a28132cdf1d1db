"""`harvest` on a vLLM engine: the #21 harvest loop (windows, shards, manifest, resume) with vLLM as the runner.

`harvest(model, ...)` takes a `VLLMBridge` as it takes a `TransformerBridge`: it asks the bridge for this adapter
(`VLLMBridge._harvest_model`), which answers the few things the loop reads from a model: the names, the per-token
shapes, the config fields, and ``forward_tokens`` on a right-padded batch of windows. Each window becomes one vLLM
request (its real tokens only; vLLM batches them continuously), and the loop's read-only hooks are then shown the
batch as the HF bridge's forward would show it, ``[window, position, ...]`` with zeros at the padding, which the
loop never stores. The forward always runs the whole model (vLLM has no ``stop_at_layer``).
"""

import contextlib
from collections.abc import Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from . import internals


class HarvestModel:
    """What `harvest` reads of a model, answered by a `VLLMBridge` (see the module docstring).

    Example:
        >>> store = harvest(VLLMBridge.from_pretrained(path, enforce_eager=True), ids, "resid_post", "acts/")
    """

    harvest_runner = True  # `activations.plan.resolve` accepts it in place of a TransformerBridge

    def __init__(self, bridge: Any) -> None:
        self.bridge = bridge
        engine = internals.engine_config(bridge.llm)
        config = engine.model_config.hf_config
        self.cfg = SimpleNamespace(
            n_layers=bridge.cfg.n_layers,
            d_vocab=bridge.cfg.d_vocab,
            n_ctx=int(engine.model_config.max_model_len),
            dtype=engine.model_config.dtype,
            bos_token_id=getattr(config, "bos_token_id", None),
            default_prepend_bos=bridge.cfg.default_prepend_bos,
        )
        self.hf_model = SimpleNamespace(config=config)  # the manifest records its name and model type
        self.tokenizer = bridge.tokenizer
        self.device = torch.device("cpu")  # captures come back to the driver on the CPU
        self._hooks: list[tuple[str, Any]] = []

    def names_matching(self, names: Any, param: str = "names_filter") -> list[str]:
        return self.bridge.names.matching(names, param)

    def cache_forward(self, tokens: Tensor, mask: Tensor, names: Sequence[str], **_: Any) -> tuple[None, dict]:
        rows = self._rows(tokens, mask)
        _, caches = self.bridge.run_with_cache(rows, names_filter=list(names))
        cache = caches[0] if isinstance(caches, list) else caches
        return None, {name: cache[name] for name in names}

    @contextlib.contextmanager
    def hooks(self, fwd_hooks: Sequence[tuple[str, Any]] = (), read_only: bool = False) -> Iterator[None]:
        self._hooks = list(fwd_hooks)
        try:
            yield
        finally:
            self._hooks = []

    def forward_tokens(self, tokens: Tensor, mask: Tensor, **_: Any) -> None:
        """One vLLM request per window; each hook then sees ``[window, position, ...]`` (zeros at the padding)."""
        rows = self._rows(tokens, mask)
        names = sorted({name for name, _ in self._hooks})
        _, caches = self.bridge.run_with_cache(rows, names_filter=names)
        per_row = caches if isinstance(caches, list) else None
        for name, fn in self._hooks:
            if per_row is None:
                fn(caches[name], None)
                continue
            first = per_row[0][name]
            batch = first.new_zeros((len(rows), tokens.shape[1], *first.shape[2:]))
            for i, cache in enumerate(per_row):
                batch[i, : len(rows[i])] = cache[name][0]
            fn(batch, None)

    @staticmethod
    def _rows(tokens: Tensor, mask: Tensor) -> list[list[int]]:
        return [t[m.bool()].tolist() for t, m in zip(tokens.cpu(), mask.cpu(), strict=True)]
