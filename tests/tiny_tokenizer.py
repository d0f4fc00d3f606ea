"""A tiny byte-level BPE tokenizer built offline, matching ``tiny_models``' vocabulary.

Ids 0..3 are ``<pad> <s> </s> <unk>`` (the tiny models' pad/bos/eos), 4..259 the 256 bytes
(GPT-2's byte-to-unicode alphabet), and 260..511 merges of lowercase letter pairs, so the
vocabulary is exactly 512. A random model samples any byte, so its outputs often hold
broken UTF-8 sequences: the right test bed for incremental detokenization.
"""

from __future__ import annotations

import itertools
import string

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")
VOCAB_SIZE = 512

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def make_tiny_tokenizer() -> PreTrainedTokenizerFast:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: ord(c))
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    merges = []
    for a, b in itertools.product(string.ascii_lowercase, repeat=2):
        if len(vocab) == VOCAB_SIZE:
            break
        merges.append((a, b))
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast
