"""docs/design.md opens with a map of the package, one line per folder: adding or removing a folder without
changing the map fails here, and so does a map line naming a folder that does not exist."""

import re
from pathlib import Path

import transformer_bridge

PACKAGE = Path(transformer_bridge.__file__).parent
DESIGN = PACKAGE.parent / "docs" / "design.md"


def _map_folders() -> list[str]:
    text = DESIGN.read_text()
    start = text.index("<!-- package-map:")
    end = text.index("<!-- package-map: end -->")
    assert text.index("## Map of the package") < start < 400, "docs/design.md must open with the map"
    return re.findall(r"^  (\w+)/\s", text[start:end], re.M)


def test_the_design_map_lists_every_folder_of_the_package_once():
    folders = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))
    listed = _map_folders()
    assert len(listed) == len(set(listed)), listed
    assert sorted(listed) == folders


def test_every_folder_says_what_lives_there_and_what_it_may_import():
    for init in PACKAGE.glob("*/__init__.py"):
        doc = init.read_text().split('"""')
        assert len(doc) >= 3 and len(doc[1]) > 80, f"{init.parent.name}/__init__.py needs a docstring paragraph"
