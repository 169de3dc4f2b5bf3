"""Build the small datasets under data/ from the King James Version of the Bible (public domain).

    apt-get install bible-kjv          # Debian's KJV text and its `bible` reader
    python scripts/build_kjv_data.py   # rewrites data/kjv_genres/ and data/kjv_sft/

The shipped files were made with this script from Debian's bible-kjv-text 4.38; the recipes and
the demo read the files, not the Debian package. Deterministic: a fixed seed picks the verses.

- data/kjv_genres/{train,eval}.jsonl: {"text": verse, "label": genre} for sequence
  classification; four genres of books with distinct vocabulary and style (law, poetry, gospels,
  letters), balanced, chance accuracy 25 %.
- data/kjv_sft/{train,eval}.jsonl: {"prompt": ..., "response": ...} for supervised fine-tuning
  of a causal LM: the prompt asks which of the four parts a verse comes from, the response names
  it. Only the response is learned (the recipe masks the prompt).
"""

from __future__ import annotations

import json
import random
import re
import subprocess
from pathlib import Path

GENRES = {
    "law": ["Leviticus", "Numbers", "Deuteronomy"],
    "poetry": ["Psalms", "Proverbs", "Ecclesiastes", "Song of Solomon"],
    "gospels": ["Matthew", "Mark", "Luke", "John"],
    "letters": ["Romans", "1 Corinthians", "2 Corinthians", "Galatians", "Ephesians", "Philippians",
                "Colossians", "Hebrews", "James", "1 Peter", "1 John"],
}
TRAIN_PER_GENRE = 450
EVAL_PER_GENRE = 75
SFT_TRAIN_PER_GENRE = 250
SFT_EVAL_PER_GENRE = 25
MIN_WORDS, MAX_WORDS = 8, 40  # short enough for 64-token samples, long enough to carry style
SEED = 1611
DATA = Path(__file__).resolve().parent.parent / "data"
VERSE = re.compile(r"^\s+(\d+) (.+)$")
SFT_PROMPT = ("Which part of the Bible is this verse from: law, poetry, gospels or letters?\n"
              "Verse: {verse}\nPart:")


def book_verses(book: str) -> list[str]:
    """All verses of a book, one string each, from Debian's `bible` reader."""
    # NOTE: the reader wants "1Corinthians"; with a space it silently reads another book.
    output = subprocess.run(["bible", "-l", "100000", f"{book.replace(' ', '')} 1:1-200:200"], check=True,
                            capture_output=True, text=True).stdout
    verses = []
    for line in output.splitlines():
        if match := VERSE.match(line):
            verses.append(match.group(2).strip())
        elif line.strip() and line.strip().rsplit(" ", 1)[0] != book:
            raise SystemExit(f"asked the reader for {book}, it printed {line.strip()!r}")
    return verses


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def main() -> None:
    rng = random.Random(SEED)
    pools = {}
    for genre, books in GENRES.items():
        verses = [verse for book in books for verse in book_verses(book)
                  if MIN_WORDS <= len(verse.split()) <= MAX_WORDS]
        rng.shuffle(verses)
        pools[genre] = verses
        print(f"{genre}: {len(verses)} verses of {MIN_WORDS}-{MAX_WORDS} words from {', '.join(books)}")

    classification = {"train": [], "eval": []}
    sft = {"train": [], "eval": []}
    for genre, verses in pools.items():
        cursor = 0
        for split, count in (("train", TRAIN_PER_GENRE), ("eval", EVAL_PER_GENRE)):
            classification[split] += [{"text": verse, "label": genre} for verse in verses[cursor:cursor + count]]
            cursor += count
        for split, count in (("train", SFT_TRAIN_PER_GENRE), ("eval", SFT_EVAL_PER_GENRE)):
            sft[split] += [{"prompt": SFT_PROMPT.format(verse=verse), "response": f" {genre}"}
                           for verse in verses[cursor:cursor + count]]
            cursor += count
    for split in ("train", "eval"):
        rng.shuffle(classification[split])
        rng.shuffle(sft[split])
        write_jsonl(DATA / "kjv_genres" / f"{split}.jsonl", classification[split])
        write_jsonl(DATA / "kjv_sft" / f"{split}.jsonl", sft[split])
    print("wrote", ", ".join(f"{name}/{split}: {len(rows[split])}" for name, rows in
                            (("kjv_genres", classification), ("kjv_sft", sft)) for split in rows))


if __name__ == "__main__":
    main()
