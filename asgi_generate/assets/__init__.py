"""Files bundled with the package: the simulator's tokenizer."""

import pathlib

ASSETS_DIR = pathlib.Path(__file__).parent
#: The bundled byte-level BPE tokenizer (Hugging Face ``tokenizer.json``).
TOKENIZER_PATH = ASSETS_DIR / "tokenizer.json"
