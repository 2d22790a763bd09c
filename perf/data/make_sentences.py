"""Write and check perf/data/sentences_16tok.json, perf_analyzer's input data for the ensemble.

Sixty hand-written English sentences on varied topics, each exactly 16 tokens after
all-MiniLM-L6-v2's WordPiece tokenization including [CLS] and [SEP]. Exactly 16 keeps every
request in the tokenizer's smallest sequence bucket (16), so a benchmark measures one
fixed encoder shape and its figures compare across runs and machines.

    python -m perf.data.make_sentences           # rewrite the JSON from the list below
    python -m perf.data.make_sentences --check   # verify lengths and that the JSON matches

Needs the exported tokenizer (model_repository/text_tokenizer/1/tokenizer.json, `make export`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
OUTPUT = HERE / "sentences_16tok.json"
TOKENIZER = ROOT / "model_repository" / "text_tokenizer" / "1" / "tokenizer.json"
INPUT_NAME = "TEXT"  # the text_embedding ensemble's input
TOKENS = 16  # with [CLS] and [SEP]

SENTENCES = [
    "The train to Edinburgh was delayed forty minutes because of a signal failure.",
    "She planted tomatoes, basil and peppers in the garden behind her house.",
    "Regular exercise can lower blood pressure and improve sleep quality in older adults.",
    "The central bank raised interest rates again to slow down rising consumer prices.",
    "Our team finished the database migration on Friday without downtime at all.",
    "A good cup of coffee needs freshly ground beans and water below boiling.",
    "The museum reopened its ancient Egypt gallery after two years of careful restoration.",
    "Heavy rain is expected across the northern coast from Tuesday evening until Thursday.",
    "He learned to play the violin at the age of seven in Vienna.",
    "The smartphone has a brighter screen and a battery that lasts two days.",
    "Children in the village walk three kilometres to reach the nearest primary school.",
    "The recipe calls for eggs, a cup of flour and melted butter.",
    "Astronomers discovered a planet orbiting a red star about forty light years away.",
    "Please remember to lock the back door before you leave for the airport.",
    "The football match ended in a draw after a goal from the visitors.",
    "Volunteers cleaned the beach and collected more than two hundred bags of waste.",
    "The library extended its opening hours so students can study late during exams.",
    "Solar panels on the school roof now supply most of its daytime electricity.",
    "My grandmother still writes letters by hand and sends them every single month.",
    "The company plans to hire fifty engineers for its new office in Lisbon.",
    "Bees play an essential role in pollinating fruit trees and many crops.",
    "The hikers reached the summit before sunrise and watched the clouds below.",
    "Customers can return unused items within thirty days for a full refund.",
    "The orchestra performed Beethoven's ninth symphony to a packed concert hall.",
    "Doctors recommend drinking water during long flights to avoid dehydration.",
    "The city council approved a plan to build more cycle lanes next year.",
    "Our cat sleeps on the windowsill every afternoon when it is sunny.",
    "The software update fixes several security issues and also improves battery life.",
    "Farmers are worried that the dry summer will reduce the autumn wheat harvest.",
    "The detective noticed a muddy footprint near the broken window of the kitchen.",
    "Learning a language becomes easier when you practise speaking every day.",
    "The bridge will be closed for repairs during the two weeks of March.",
    "A sudden power cut left thousands of homes without heating for several hours.",
    "The chef prepared a dish of grilled fish with lemon and herbs.",
    "Scientists are testing a new vaccine that could protect young children against malaria.",
    "The bookshop on the corner sells second hand novels and old maps.",
    "Remote work has changed how many people choose where they want to live.",
    "The ferry crossed the calm lake while tourists took photographs of the mountains.",
    "Our flight landed early so we had time for breakfast before the meeting.",
    "The gardener trimmed the hedges and raked the fallen leaves from the lawn.",
    "Electric cars are becoming much cheaper as battery production grows around the world.",
    "The students presented their research on coral reefs at the annual science fair.",
    "He forgot his umbrella on the bus and arrived at work completely soaked.",
    "The hospital opened a new wing for children with heart conditions last spring.",
    "Wind turbines off the coast generate enough power for half a million homes.",
    "She finished reading the novel in one night because she could not stop.",
    "The market sells fresh bread, cheese and seasonal vegetables every Saturday morning.",
    "Engineers inspected the old tunnel and found deep cracks that need urgent repair.",
    "The teacher asked everyone to write a short poem about their favourite season.",
    "An earthquake shook the island early this morning, but nobody was hurt.",
    "The band released its first album in ten years and announced a tour.",
    "Please send me the final report by Thursday so I can review it.",
    "The river flooded the streets of the town after days of heavy rain.",
    "Running shoes should usually be replaced after about eight hundred kilometres of use.",
    "The government announced new funding for local buses and trains in rural areas.",
    "Our neighbours adopted a little puppy from the animal shelter down the road.",
    "The old painting was sold at auction for more than three million dollars.",
    "Snow closed the mountain pass and drivers had to take a longer route.",
    "The small startup uses machine learning to detect tiny defects in factory products.",
    "The baby finally fell asleep after we sang the same lullaby five times.",
]


def token_counts(sentences: list[str], tokenizer_file: Path = TOKENIZER) -> list[int]:
    """Tokens per sentence as the served tokenizer counts them (special tokens included, no padding)."""
    from tokenizers import Tokenizer

    if not tokenizer_file.is_file():
        raise SystemExit(f"{tokenizer_file} not found; run `make export` first")
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return [len(e.ids) for e in tokenizer.encode_batch(sentences)]


def input_data(sentences: list[str]) -> dict:
    """perf_analyzer's real-input JSON: one batch-1 request per entry, used round-robin."""
    return {"data": [{INPUT_NAME: {"content": [s], "shape": [1]}} for s in sentences]}


def render(sentences: list[str]) -> str:
    """The JSON text, one request per line so that diffs stay readable."""
    entries = [json.dumps(entry, ensure_ascii=False) for entry in input_data(sentences)["data"]]
    return '{"data": [\n  ' + ",\n  ".join(entries) + "\n]}\n"


def problems(sentences: list[str], tokenizer_file: Path = TOKENIZER) -> list[str]:
    """What is wrong with the list: duplicates and sentences of the wrong length."""
    found = [f"duplicate: {s!r}" for i, s in enumerate(sentences) if s in sentences[:i]]
    for sentence, count in zip(sentences, token_counts(sentences, tokenizer_file)):
        if count != TOKENS:
            found.append(f"{count} tokens (want {TOKENS}): {sentence!r}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only verify; exit 1 on any problem")
    args = parser.parse_args(argv)
    found = problems(SENTENCES)
    for problem in found:
        print(problem, file=sys.stderr)
    if found:
        return 1
    text = render(SENTENCES)
    if args.check:
        if not OUTPUT.is_file() or OUTPUT.read_text(encoding="utf-8") != text:
            print(f"{OUTPUT.name} is out of date; run `python -m perf.data.make_sentences`", file=sys.stderr)
            return 1
        print(f"{OUTPUT.name}: {len(SENTENCES)} sentences of {TOKENS} tokens, up to date")
        return 0
    OUTPUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUTPUT.relative_to(ROOT)}: {len(SENTENCES)} sentences of {TOKENS} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
