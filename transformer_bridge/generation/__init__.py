"""Generation: `generate(model, ...)`, a KV-cached loop over the HF model with hooks that know where they are.

One engine, two drivers. The KV cache (``kv.py``: dynamic or a preallocated static one, and `run_chunk`,
the one forward over either) is shared by the *tensor driver* (``decode.py``: plain sampling, no Python
per row, no host sync per step with a static cache, the compiled one-token step of ``fast.py`` /
``compiled.py``) and the *row driver* (``control.py`` over ``engine.py``'s per-row state: controllers,
backtrack, fork, forced tokens, speculative decoding (``speculative.py``), with ``records.py`` and
``finish.py``). Beam search (``beams.py``, ``beam_control.py`` for controllers) reorders its beams over
the same model calls.

Options: ``keywords.py`` (the keywords `generate` takes; HF's it lacks, and what to use instead),
``resolve.py`` (HF's and TransformerLens' keywords, generation configs and input forms, resolved once),
``options.py`` (every option validated once into a `Plan`), ``sampling.py`` (pure logits → token
functions), ``processors.py`` (penalties, bans, biases), ``stopping.py`` (EOS, stop strings, criteria,
time). Controllers: ``branch.py`` (`Branch`, `View`), ``grammar.py`` (llguidance), ``builtins.py``
(`force`, `stop_on`). Output: ``outputs.py`` (`GenerationOutput`), ``stream.py`` (`generate_stream`).

It is a function package over the core bridge: it may import the core, `cache`, `hooks`, `inputs` and `versions`,
never relevance, compat or the CLI.
"""

import importlib
from typing import Any

__all__ = [
    "ANY_TOKEN",
    "FINISH_REASONS",
    "Branch",
    "ControllerError",
    "FinishReason",
    "GenerationOutput",
    "View",
    "draw",
    "generate",
    "generate_stream",
    "sample",
    "warp_logits",
]


def __getattr__(name: str) -> Any:
    """The public names (and `generate`'s module-level tables) from `api`, imported on first use: importing
    `declare` (the option table the command line reads) then costs no torch."""
    if name.startswith("__"):
        raise AttributeError(name)
    api = importlib.import_module(f"{__name__}.api")
    try:
        return getattr(api, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
