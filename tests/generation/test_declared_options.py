"""`generate`'s options are declared once (`generation.declare.OPTIONS`): its signature, docstring, the stream's
refusals, the HF-config resolution and the docs' option table agree with the declaration."""

import inspect
import pydoc
import re
from pathlib import Path

from transformer_bridge import TransformerBridge
from transformer_bridge.generation import _NOT_STREAMED, generate
from transformer_bridge.generation import declare as declare_module
from transformer_bridge.generation.builders import BUILDERS
from transformer_bridge.generation.declare import BY_NAME, CONFIG_FIELDS, OPTIONS, PROCESSORS, markdown_table
from transformer_bridge.generation.keywords import UNSUPPORTED
from transformer_bridge.generation.signature import POSITIONAL, GenerateOptions

DOC = Path(__file__).resolve().parents[2] / "docs" / "generation.md"


def test_the_signature_is_the_declaration():
    params = [p for name, p in inspect.signature(generate).parameters.items() if name != "model"]
    assert [p.name for p in params] == [o.name for o in OPTIONS]
    assert {p.name: p.default for p in params} == {o.name: o.default for o in OPTIONS}
    assert inspect.signature(TransformerBridge.generate) == inspect.signature(generate)


def test_the_typed_options_are_the_declaration_and_help_shows_them_all():
    """`generate` takes ``**options: Unpack[GenerateOptions]`` (no `locals()`): editors read the `TypedDict`,
    ``help()`` the signature built from the table; both name every option, with its type and default."""
    assert list(GenerateOptions.__annotations__) == [o.name for o in OPTIONS if o.name not in POSITIONAL]
    params = inspect.signature(generate).parameters
    assert all(params[name].annotation == kind for name, kind in GenerateOptions.__annotations__.items())
    assert [n for n, p in params.items() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD] == ["model", *POSITIONAL]
    shown = pydoc.render_doc(TransformerBridge.generate, renderer=pydoc.plaintext)
    header = shown[shown.index("generate(") :].split("\n\n")[0]  # the signature help() prints
    for option in OPTIONS:
        assert re.search(rf"[(,] {option.name}: .+? = ", header), option.name


def test_the_docstring_documents_every_option_with_its_declared_text():
    doc = " ".join(generate.__doc__.split())
    for option in OPTIONS:
        assert f"{option.name}" in doc, option.name
        assert " ".join(option.doc.split())[:60] in doc, option.name


def test_stream_refusals_and_config_fields_come_from_the_declaration():
    assert {o.name: o.elsewhere for o in OPTIONS if "stream" not in o.paths} == _NOT_STREAMED
    assert all(_NOT_STREAMED.values())
    assert set(CONFIG_FIELDS) == {o.name for o in OPTIONS if o.config}
    # Nothing is both an option and refused as unsupported.
    assert not set(BY_NAME) & set(UNSUPPORTED)
    orders = [o.order for o in PROCESSORS]
    assert orders == sorted(orders) and len(set(orders)) == len(orders)


def test_the_docs_option_table_is_the_declaration():
    text = DOC.read_text()
    table = re.search(r"<!-- options-table: begin -->\n(.*?)\n<!-- options-table: end -->", text, re.S)
    assert table is not None, "docs/generation.md lacks the option table markers"
    assert table.group(1) == markdown_table(), "regenerate: python scripts/options_table.py"


def test_every_processor_option_has_its_builder_and_the_table_needs_no_torch():
    assert sorted(BUILDERS) == sorted(o.name for o in PROCESSORS)
    source = Path(declare_module.__file__).read_text()
    assert "import torch" not in source and "from torch" not in source
