"""The model served when none is named: the small trained model shipped in the package, else a tiny random one.

``default_model_path()`` returns ``python/dgserve/models/small/`` when it holds a ``config.json``. Otherwise it
writes (once per machine, reused afterwards) a tiny random checkpoint (``dgserve.model.tiny``'s ``tiny`` preset) with a
byte-level BPE tokenizer trained on a few sentences (which transformers' ``AutoTokenizer`` loads too and encodes
as dgserve does), and logs a warning: its output is random tokens, useful only
to exercise the service end to end.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil
import tempfile

log = logging.getLogger("dgserve")

SHIPPED = pathlib.Path(__file__).resolve().parents[1] / "models" / "small"
RANDOM_DIR_NAME = "dgserve-tiny-random-v2"  # v2: tokenizer.json prepends <bos>; tokenizer_config.json
SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>"]  # ids 0, 1, 2 = the tiny preset's pad, eos, bos
# transformers' generic fast tokenizer (without a class, AutoTokenizer picks GemmaTokenizer from config.json,
# which needs an <unk>); add_bos_token states what tokenizer.json's post-processor does.
TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": "<bos>",
    "eos_token": "<eos>",
    "pad_token": "<pad>",
    "add_bos_token": True,
    "add_eos_token": False,
}
CORPUS = [
    "The quick brown fox jumps over the lazy dog, and the dog sleeps in the sun all day long.",
    "A diffusion model writes a whole canvas of tokens at once and refines it over a few steps.",
    "Hello! How are you today? I am fine, thank you. What would you like to know?",
]


def default_model_path(cache_dir: str | os.PathLike | None = None) -> str:
    """The shipped small model's directory, or a tiny random checkpoint with a tokenizer (warning logged)."""
    if (SHIPPED / "config.json").is_file():
        return str(SHIPPED)
    path = pathlib.Path(cache_dir or tempfile.gettempdir()) / RANDOM_DIR_NAME
    if not (path / "tokenizer.json").is_file():
        write_tiny_random_model(path)
    log.warning("no trained model at %s: serving a tiny RANDOM checkpoint from %s (its output is noise)", SHIPPED, path)
    return str(path)


def write_tiny_random_model(path: str | os.PathLike, seed: int = 0) -> str:
    """A tiny random checkpoint + byte-level BPE tokenizer at ``path`` (written to a sibling, then renamed)."""
    from dgserve.model.tiny import make_random_checkpoint

    final = pathlib.Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=final.name + ".", dir=final.parent))
    try:
        make_random_checkpoint(tmp, "tiny", seed=seed)
        train_tokenizer(300).save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2) + "\n")
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
    """A byte-level BPE ``tokenizers.Tokenizer`` with ids 0, 1, 2 = <pad>, <eos>, <bos>, whose post-processor
    prepends <bos> (``add_bos_post_processor``)."""
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
    return add_bos_post_processor(tok)


def add_bos_post_processor(tok, bos_token: str = "<bos>"):
    """Give ``tok`` (a ``tokenizers.Tokenizer``) the post-processor ``<bos> $A`` and return it.

    A checkpoint's ``tokenizer.json`` post-processor is what transformers 5.23's ``AutoTokenizer`` applies (it
    ignores ``tokenizer_config.json``'s ``add_bos_token`` when a ``tokenizer.json`` exists), and so does dgserve's
    ``Tokenizer``: with this one, ``tokenizers``, transformers and dgserve all encode text as ``<bos>`` + text, as
    the small models are trained (documents start with <bos>). Chat templates write ``{{ bos_token }}``
    themselves and are encoded without special tokens, so chat prompts hold one BOS. Encode training documents
    with ``add_special_tokens=False`` when adding <bos> by hand.
    """
    from tokenizers import processors

    bos_id = tok.token_to_id(bos_token)
    if bos_id is None:
        raise ValueError(f"{bos_token!r} is not in the tokenizer's vocabulary")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos_token} $A", pair=f"{bos_token} $A {bos_token}:1 $B:1", special_tokens=[(bos_token, bos_id)]
    )
    return tok
