"""Regenerate imagenet_labels.txt (the 1000 ImageNet-1k class names in index order).

Source: timm's wheel, which ships the class order and WordNet lemmas as plain text:
``timm/data/_info/imagenet_synsets.txt`` (1000 synsets, index order) and
``timm/data/_info/imagenet_synset_to_lemma.txt`` (synset<TAB>comma-separated lemmas). The
label is the first lemma. Some names repeat (``crane`` the bird and the machine,
``maillot`` twice): the index, not the name, identifies a class.

    pip download timm==1.0.31 --no-deps -d build/timm
    python export/data/make_imagenet_labels.py build/timm/timm-1.0.31-py3-none-any.whl

Nothing imports timm; the wheel is only read as a zip file.
"""

from __future__ import annotations

import argparse
import sys
import zipfile
from pathlib import Path

OUT = Path(__file__).resolve().parent / "imagenet_labels.txt"
SYNSETS = "timm/data/_info/imagenet_synsets.txt"
LEMMAS = "timm/data/_info/imagenet_synset_to_lemma.txt"


def labels_from_wheel(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        synsets = z.read(SYNSETS).decode("utf-8").split()
        lemmas = {}
        for line in z.read(LEMMAS).decode("utf-8").splitlines():
            synset, _, names = line.partition("\t")
            lemmas[synset.strip()] = names
    if len(synsets) != 1000:
        raise SystemExit(f"{SYNSETS}: expected 1000 synsets, found {len(synsets)}")
    missing = [s for s in synsets if s not in lemmas]
    if missing:
        raise SystemExit(f"{LEMMAS}: no lemma for {', '.join(missing[:5])}")
    return [lemmas[s].split(",")[0].strip() for s in synsets]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("wheel", type=Path, help="a timm wheel (.whl)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    labels = labels_from_wheel(args.wheel)
    args.out.write_text("\n".join(labels) + "\n", encoding="utf-8")
    print(f"wrote {len(labels)} labels to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
