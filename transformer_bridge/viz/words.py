"""What pictures of relevance say in words: visible tokens (``␣`` space, ``↵`` newline), component label
legends (``L29H1`` = layer 29, head 1), headers, captions and sums, shared by the HTML and the PNG figures."""

import re
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass

# A `transformer_bridge.relevance.Relevance`; not imported, because `Relevance` draws itself with this module.
Relevance = Any

_MAX_PNG_COLS = 160  # beyond this, ticks are thinned so labels stay legible
_RED, _BLUE, _NOT_SEEN = "#dc2626", "#2563eb", "#d4d4d4"
_WHITESPACE = {" ": "␣", "\n": "↵", "\t": "⇥", "\r": "␍"}
_LOG_FLOOR = -8  # logit-lens HTML: probabilities at or below 1e-8 are left uncoloured

# What component and hook labels mean: (pattern, explanation with {0} the label and {1}.. its groups).
_LABEL_FORMS = [
    (r"L(\d+)H(\d+)", "{0} = layer {1}, attention head {2}"),
    (r"L(\d+)\.mlp", "{0} = layer {1} MLP"),
    (r"L(\d+)\.attn_bias", "{0} = layer {1} attention output bias"),
    (r"L(\d+)", "{0} = residual stream after layer {1}"),
    (r"embed", "embed = token embedding"),
    (r"pos_embed", "pos_embed = position embedding"),
    (r"bias:ln_final", "bias:ln_final = final norm's bias, read out by the unembedding"),
    (r"bias:unembed", "bias:unembed = unembedding bias"),
    (
        r"edit:(blocks\.\d+\.hook_\w+|ln_final\.hook_normalized)",
        "{0} = what hooks added at {1} during the cached forward (an edit, e.g. steering), in no block's output",
    ),
    (r"edit:unlocated", "edit:unlocated = what hooks added to the residual stream between points the cache lacks"),
    (r"blocks\.(\d+)\.hook_resid_pre", "{0} = residual stream entering layer {1}"),
    (r"blocks\.(\d+)\.hook_resid_mid", "{0} = residual stream between layer {1}'s attention and MLP"),
    (r"blocks\.(\d+)\.hook_resid_post", "{0} = residual stream after layer {1}"),
    (r"blocks\.(\d+)\.hook_attn_out", "{0} = layer {1} attention output"),
    (r"blocks\.(\d+)\.hook_mlp_out", "{0} = layer {1} MLP output"),
]


def visible_token(token: str) -> str:
    """``token`` with its whitespace drawn: ``␣`` space, ``↵`` newline, ``⇥`` tab, ``␍`` carriage return.

    Example:
        >>> visible_token(" Paris"), visible_token("\\n\\t")
        ('␣Paris', '↵⇥')
    """
    return "".join(_WHITESPACE.get(ch, ch) for ch in token)


def label_legend(labels: list[str]) -> list[str]:
    """One line per kind of label in ``labels``, explained on its first example (layers count from 0).

    Example:
        >>> label_legend(["L29H1", "L3.mlp", "L29H0"])
        ['L29H1 = layer 29, attention head 1', 'L3.mlp = layer 3 MLP', 'layers and heads count from 0']
    """
    lines, counted = [], set()
    for pattern, text in _LABEL_FORMS:
        match = next((m for m in map(re.compile(pattern).fullmatch, labels) if m), None)
        if match:
            lines.append(text.format(match.group(0), *match.groups()))
            counted.update(["layers", "heads"][: len(match.groups())])
    return [*lines, f"{' and '.join(sorted(counted, reverse=True))} count from 0"] if counted else lines


def in_notebook() -> bool:
    """Whether this runs in a Jupyter-style kernel that renders HTML (not a script or terminal IPython)."""
    ipython = sys.modules.get("IPython")  # a kernel has always imported it; never import it ourselves
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is None:
        return False
    # Jupyter, VS Code and Colab shells are (subclasses of) ZMQInteractiveShell started by IPKernelApp.
    kernel_shell = any(c.__name__ == "ZMQInteractiveShell" for c in type(shell).__mro__)
    return kernel_shell or "IPKernelApp" in getattr(shell, "config", {})


def default_html_path(rel: Relevance) -> Path:
    """A new ``.html`` file in the temporary folder: where `Relevance.show` writes ``rel`` outside notebooks."""
    with tempfile.NamedTemporaryFile(prefix=f"relevance_{rel.method}_", suffix=".html", delete=False) as f:
        return Path(f.name)


# -- words shared by both kinds of picture ----------------------------------------------------------
def _target_words(target: str) -> str:
    contrast = re.fullmatch(r"logit_diff\(contrast=(\d+)\)", target)
    if contrast:
        return f"logit difference (token − token id {contrast.group(1)})"
    return {"logit": "logit", "logprob": "log-probability"}.get(target, f"target {target}")


def _score_words(rel: Relevance) -> str:
    """What one score of a token method is, e.g. 'relevance for the logit'."""
    fixed = {"attention": "attention weight", "random": "random baseline score"}
    if rel.method == "grad_norm":
        return f"gradient norm of the {_target_words(rel.target)}"
    return fixed.get(rel.method, f"relevance for the {_target_words(rel.target)}")


def _sign_words(rel: Relevance) -> str:
    if rel.method in ("attention", "random", "grad_norm"):
        return "darker = larger"
    return f"red raises the {_target_words(rel.target)}, blue lowers it"


def _row_label(rel: Relevance, i: int, with_row: bool = True) -> str:
    """``step 0 → "␣Paris"`` (``row 1, step 0 → …`` in batches, ``pos 7 → …`` outside generation)."""
    e = rel.explained[i]
    where = f"step {e.step_index}" if e.step_index is not None else f"pos {e.position}"
    if with_row and rel.tokens.shape[0] > 1:
        where = f"row {e.batch_index}, {where}"
    return f'{where} → "{visible_token(rel.str_tokens[e.batch_index][e.position])}"'


def _header_words(rel: Relevance) -> str:
    if rel.kind == "layers":
        return f"probability and rank of {len(rel)} explained token(s) after each layer"
    if rel.method in ("attention", "random"):
        return f"{_score_words(rel)}s for {len(rel)} token(s)"
    return f"explains the {_target_words(rel.target)} of {len(rel)} token(s)"


def sum_words(rel: Relevance, i: int, digits: int = 4) -> str:
    """What the components of explained token ``i`` sum to, and whether that is the target: checked against
    ``rel.values`` (the value the forward computed), never assumed.

    Example:
        >>> sum_words(rel, 0)   # 'all 301 sum to 13.2, the logit'
    """
    n = len(rel.labels or [])
    total = float(rel.scores[i].float().sum())
    target = _target_words(rel.target)
    if rel.values is None:
        why = "the cache lacks the final residual stream" if rel.extras.get("checked") is False else "no value given"
        return f"all {n} sum to {total:.{digits}g} (not checked against the {target}: {why})"
    value = float(rel.values[i])
    if abs(total - value) <= 1e-4 * max(1.0, abs(value)):
        return f"all {n} sum to {total:.{digits}g}, the {target}"
    return f"all {n} sum to {total:.{digits}g}, but the {target} is {value:.{digits}g}: no component holds the gap"


def _shown(rel: Relevance, limit: int) -> list[int]:
    return list(range(min(len(rel), limit)))


def _not_all(rel: Relevance, shown: list[int]) -> list[str]:
    return [f"first {len(shown)} of {len(rel)} explained tokens shown"] if len(shown) < len(rel) else []


# -- HTML ---------------------------------------------------------------------------------------------
