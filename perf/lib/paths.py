"""Where the measuring tools find the repository, their checked-in inputs and their results folder.

One owner for these paths, so a tool's place in ``perf/``'s rooms does not change what it reads
or where it writes: inputs under ``perf/data/``, outputs under ``perf/results/`` (ignored by git).
"""

from pathlib import Path

PERF_DIR = Path(__file__).resolve().parents[1]
ROOT = PERF_DIR.parent
DATA = PERF_DIR / "data"
RESULTS = PERF_DIR / "results"
REPOSITORY = ROOT / "model_repository"
SENTENCES_16TOK = DATA / "sentences_16tok.json"
GENERATION_PROMPTS = DATA / "generation_prompts.json"
