"""Write the greetings task of notebooks/06_finetune.ipynb: train/valid/test.jsonl (100/16/16).

Each row is a one-turn chat in mlx-lm's {"messages"} format: the user asks to greet a person
in a language, the assistant answers with that language's greeting, the name and a wave
("Greet Ada in Spanish." -> "¡Hola, Ada! 👋"). Every name and every language appear in
training; the valid and test rows are pairs never seen there. Deterministic (fixed seed):
rerunning rewrites the same files.

  python notebooks/data/greetings/make_data.py
"""
from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

NAMES = ["Ada", "Ben", "Chloe", "Dmitri", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kemal",
         "Lena", "Mateo", "Nadia", "Oscar", "Priya", "Quinn", "Rosa", "Sven", "Tariq", "Uma", "Viktor"]
GREETINGS = {"French": "Bonjour, {}!", "Spanish": "¡Hola, {}!", "German": "Hallo, {}!",
             "Italian": "Ciao, {}!", "Portuguese": "Olá, {}!", "Japanese": "Konnichiwa, {}-san!"}
SPLITS = {"train": 100, "valid": 16, "test": 16}
SEED = 6


def row(name: str, language: str) -> dict:
    return {"messages": [{"role": "user", "content": f"Greet {name} in {language}."},
                         {"role": "assistant", "content": GREETINGS[language].format(name) + " 👋"}]}


def main() -> None:
    pairs = list(itertools.product(NAMES, GREETINGS))       # 22 x 6 = 132 = 100 + 16 + 16
    random.Random(SEED).shuffle(pairs)
    out = Path(__file__).parent
    start = 0
    for split, n in SPLITS.items():
        rows = [row(*p) for p in pairs[start:start + n]]
        start += n
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                                            encoding="utf-8")
    train = set(pairs[:SPLITS["train"]])
    assert {n for n, _ in train} == set(NAMES) and {lang for _, lang in train} == set(GREETINGS)


if __name__ == "__main__":
    main()
