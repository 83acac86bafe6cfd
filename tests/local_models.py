"""Model folders on disk, made offline, for tests of loading, the CLI and bad input.

`tiny_model_folder` writes a random tiny Llama plus a byte-level BPE tokenizer trained in memory
(with a chat template), i.e. a complete Hugging Face model folder that `multidecode.load` and
`--model` accept, without touching the network.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers as tf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Question: what is the answer? Answer in one short sentence.",
    "Here is a document about support calls, routers, cables and tickets.",
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
] * 20

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer(chat: bool = True, vocab_size: int = 400) -> tf.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with eos `<|im_end|>` (id 2), trained on a few sentences."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = tf.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<|im_start|>", eos_token="<|im_end|>",
        pad_token="<unk>",
    )
    if chat:
        fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_model_folder(path: Path, *, max_positions: int = 256, chat: bool = True, vocab_size: int = 400) -> Path:
    """Write a tiny Llama + tokenizer (of at most `vocab_size` tokens) into `path`; returns `path`."""
    tokenizer = tiny_tokenizer(chat, vocab_size)
    config = tf.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(config)
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def tiny_mtp_folder(path: Path, *, seed: int = 5) -> Path:
    """Write a tiny Mellum (a model whose checkpoint carries an MTP layer) + tokenizer into `path`,
    its MTP layer's weights in the published layout (`mtp.*` keys beside the model's, which its own
    load leaves out); returns `path`."""
    from safetensors.torch import load_file, save_file
    from tiny_models import MTP_ARCHITECTURES, random_mtp

    tokenizer = tiny_tokenizer(True, 400)
    config, cls = MTP_ARCHITECTURES["mellum"]()
    config.vocab_size = len(tokenizer)
    torch.manual_seed(0)
    model = cls(config)
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    mtp = {f"mtp.{k}": v.contiguous() for k, v in random_mtp(model, seed).state_dict().items()
           if not k.startswith(("embed_tokens", "shared_head"))}
    weights = path / "model.safetensors"
    save_file({**load_file(weights), **mtp}, weights, metadata={"format": "pt"})
    return path
