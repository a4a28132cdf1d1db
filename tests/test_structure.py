"""The shape of the code the issues ask to keep: a bridge class a reader can hold in their head (few mixins, no
method overridden across them, one `get_act_name`) and modules of at most 500 lines."""

from pathlib import Path

import transformer_bridge
import transformer_bridge.utils
from transformer_bridge import TransformerBridge
from transformer_bridge.compat import TransformerLensSurface
from transformer_bridge.core import BridgeCore

PACKAGE = Path(transformer_bridge.__file__).parent
LIMIT = 500


def test_the_public_class_is_the_core_plus_one_surface():
    assert TransformerBridge.__bases__ == (TransformerLensSurface, BridgeCore)
    assert len(TransformerBridge.__mro__) <= 8, [c.__name__ for c in TransformerBridge.__mro__]


def test_no_member_is_defined_by_two_classes_of_the_bridge():
    owners: dict[str, list[str]] = {}
    for cls in TransformerBridge.__mro__[1:-1]:  # the bases, not the public class itself nor object
        for name in vars(cls):
            if not name.startswith("__") or name in ("__getattr__", "__deepcopy__", "__call__"):
                owners.setdefault(name, []).append(cls.__name__)
    shared = {name: classes for name, classes in owners.items() if len(classes) > 1}
    assert shared == {"forward": ["Running", "Module"]}  # nn.Module's contract: the model defines forward


def test_one_get_act_name():
    assert transformer_bridge.get_act_name is transformer_bridge.utils.get_act_name


def test_no_module_is_much_over_500_lines():
    long = {
        str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > LIMIT
    }
    assert long == {}


def test_test_files_have_unique_basenames():
    """tests/ has no __init__.py files, so pytest imports each test file by its basename: two files of one name in
    different folders stop the collection of the whole suite ("import file mismatch")."""
    tests = Path(__file__).parent
    names: dict[str, list[str]] = {}
    for p in tests.rglob("*.py"):
        if ".venv" not in p.parts:
            names.setdefault(p.name, []).append(str(p.relative_to(tests)))
    repeated = {name: paths for name, paths in names.items() if len(paths) > 1 and name != "conftest.py"}
    assert repeated == {}
