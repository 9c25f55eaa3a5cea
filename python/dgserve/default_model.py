"""The model served when none is named: the small trained model shipped in the package, else a tiny random one.

``default_model_path()`` returns ``python/dgserve/models/small/`` when it holds a ``config.json``. Otherwise it
writes (once per machine, reused afterwards) a tiny random checkpoint (``dgserve.tiny``'s ``tiny`` preset) with a
byte-level BPE tokenizer trained on a few sentences, and logs a warning: its output is random tokens, useful only
to exercise the service end to end.
"""

from __future__ import annotations

import logging
import os
import pathlib
import shutil
import tempfile

log = logging.getLogger("dgserve")

SHIPPED = pathlib.Path(__file__).resolve().parent / "models" / "small"
RANDOM_DIR_NAME = "dgserve-tiny-random-v1"
SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>"]  # ids 0, 1, 2 = the tiny preset's pad, eos, bos
CORPUS = [
    "The quick brown fox jumps over the lazy dog, and the dog sleeps in the sun all day long.",
    "A diffusion model writes a whole canvas of tokens at once and refines it over a few steps.",
    "Hello! How are you today? I am fine, thank you. What would you like to know?",
]


def default_model_path(cache_dir: str | os.PathLike[str] | None = None) -> str:
    """The shipped small model's directory, or a tiny random checkpoint with a tokenizer (warning logged)."""
    if (SHIPPED / "config.json").is_file():
        return str(SHIPPED)
    path = pathlib.Path(cache_dir or tempfile.gettempdir()) / RANDOM_DIR_NAME
    if not (path / "tokenizer.json").is_file():
        write_tiny_random_model(path)
    log.warning("no trained model at %s: serving a tiny RANDOM checkpoint from %s (its output is noise)", SHIPPED, path)
    return str(path)


def write_tiny_random_model(path: str | os.PathLike[str], seed: int = 0) -> str:
    """A tiny random checkpoint + byte-level BPE tokenizer at ``path`` (written to a sibling, then renamed)."""
    from dgserve.tiny import make_random_checkpoint

    final = pathlib.Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=final.name + ".", dir=final.parent))
    try:
        make_random_checkpoint(tmp, "tiny", seed=seed)
        train_tokenizer(300).save(str(tmp / "tokenizer.json"))
        try:
            os.replace(tmp, final)  # atomic; fails if another process got there first
        except OSError:
            if not (final / "tokenizer.json").is_file():
                shutil.rmtree(final, ignore_errors=True)
                os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


def train_tokenizer(vocab_size: int = 300, corpus: list[str] | None = None):
    """A byte-level BPE ``tokenizers.Tokenizer`` with ids 0, 1, 2 = <pad>, <eos>, <bos>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        corpus or CORPUS,
        trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=SPECIAL_TOKENS,
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    return tok
