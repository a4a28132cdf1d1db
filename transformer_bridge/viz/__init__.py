"""Pictures of relevance: HTML for notebooks and browsers, matplotlib figures for PNG files.

Both read a `transformer_bridge.relevance.Relevance` and say on the picture what is drawn: axis and
colour-bar labels, what each component label means (``L29H1`` = layer 29, head 1), and token labels
with their whitespace made visible (``␣`` space, ``↵`` newline, ``⇥`` tab), so ``' Paris'`` and
``'Paris'`` differ. Token heatmaps are row-normalised (each explained token's scores divided by their
largest magnitude), red for positive and blue for negative; raw values are in the HTML tooltips.

It imports nothing else of the package (relevance results are read through their attributes), so relevance and
graphs may use it.
"""

from .figures import relevance_figure, save_relevance_png
from .html import relevance_html
from .words import default_html_path, in_notebook, label_legend, sum_words, visible_token

__all__ = [
    "default_html_path",
    "in_notebook",
    "label_legend",
    "relevance_figure",
    "relevance_html",
    "save_relevance_png",
    "sum_words",
    "visible_token",
]
