"""llama.cpp's ``convert_hf_to_gguf.py``, run with one change: a tokenizer its table of known
pre-tokenizers lacks is recorded as llama.cpp's ``default`` instead of refused.

The converter identifies a BPE tokenizer by hashing its encoding of a fixed text and refuses one
it has not seen (a fine-tuned vocabulary, or another model's vocabulary under a new architecture).
The ``llama_*`` and ``ov_*`` runtimes never use the GGUF's tokenizer: the engine tokenizes with
transformers and hands them token ids, so the recorded pre-tokenizer is never read. Run by
``export/llama_cpp.py`` as ``python gguf_convert.py CONVERT_SCRIPT ARGS...`` with the vendored
sources on ``PYTHONPATH``.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path


def main() -> None:
    script, *args = sys.argv[1:]
    if sys.path and sys.path[0] == str(Path(__file__).resolve().parent):
        del sys.path[0]  # the project's export/ modules are not the converter's
    from conversion import base  # the vendored converter's package, on PYTHONPATH

    known = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            print(
                "gguf_convert: the tokenizer's pre-tokenizer is not in llama.cpp's table: recorded as 'default' "
                "(the engine tokenizes with transformers; llama.cpp is given token ids)",
                file=sys.stderr,
            )
            return "default"

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
