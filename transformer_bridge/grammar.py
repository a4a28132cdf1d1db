"""Grammar controllers for `generate(..., controller=...)`, through llguidance (the optional extra ``grammar``).

``json_schema(schema)``, ``regex(pattern)``, ``lark(text)``, ``choice(options)`` return a `Grammar`;
``force(text)`` and ``stop_on(...)`` are small controllers that need no grammar. See docs/control.md.

Example:
    >>> from transformer_bridge import grammar
    >>> model.generate("Pick one: ", max_new_tokens=8, controller=grammar.choice(["yes", "no"]))
"""

from .generation.builtins import force, stop_on
from .generation.grammar import Grammar, GrammarError, choice, json_schema, lark, regex

__all__ = ["Grammar", "GrammarError", "choice", "force", "json_schema", "lark", "regex", "stop_on"]
