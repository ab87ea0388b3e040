"""The built-in checkpoints' tokenizers, made locally and deterministically: a byte-level BPE
trained on a small corpus with the Qwen2-VL special tokens and chat template, or with LLaVA's
(`<image>`, Llama/Mistral chat templates)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
TOKENIZER_BPE_VOCAB = 441  # byte tokens + merges; plus 7 special tokens = 448 ids

# Qwen2-VL style chat template (ChatML; image parts become a one-token placeholder).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = """\
You are a helpful assistant. The user shows you an image and asks a question about it.
Describe the image in one sentence. What is in this picture? How many people are there?
There is a cat sitting on the table next to a cup of coffee, and a dog is sleeping in the
garden under a tall green tree. The sky is blue with a few white clouds. A red car is parked
on the street in front of the house. Two children are playing with a yellow ball on the grass.
The quick brown fox jumps over the lazy dog. A picture is worth a thousand words.
What color is the car? The car is red. Where is the cat? The cat is on the table.
Read the text in the image and translate it into English. Compare the two images and tell me
what is different between them. The first image shows a city at night with bright lights,
while the second image shows the same city in the morning. Answer the question with a short
phrase. Write a story about the picture. Count the objects and list them from left to right.
The model looks at every patch of the image, then writes the answer one token at a time.
"""

# LLaVA-1.5: Llama's special tokens plus <image>; llava-hf's prompt format
# ("USER: <image>\n... ASSISTANT:"; images first, then the text of each message)
LLAVA_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>", "<image>")
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{{ message['content'] if message['content'] is string else "
    "message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') "
    "| join(' ') }}{{ ' ' }}"
    "{% else %}{{ message['role'].upper() + ': ' }}"
    "{% if message['content'] is string %}{{ message['content'] + ' ' }}"
    "{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}{{ '<image>\n' }}{% endif %}"
    "{% endfor %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] + ' ' }}{% endif %}"
    "{% endfor %}{% endif %}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

# LLaVA-NeXT (Mistral): llava-hf/llava-v1.6-mistral-7b-hf's prompt format
# ("[INST] <image>\n... [/INST]"; images first, then the text of each user message)
LLAVA_NEXT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}{{ '<image>\n' }}{% endif %}"
    "{% endfor %}"
    "{{ message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') "
    "| join(' ') }}"
    "{% endif %}{{ ' [/INST]' }}"
    "{% else %}"
    "{{ '<<SYS>>\n' if message['role'] == 'system' else ' ' }}"
    "{{ message['content'] if message['content'] is string else "
    "message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') "
    "| join(' ') }}{{ '</s>' if message['role'] == 'assistant' else '\n<</SYS>>\n\n' }}"
    "{% endif %}"
    "{% endfor %}"
)


def build_tokenizer(family: str = "qwen2_vl") -> PreTrainedTokenizerFast:
    """The tiny byte-level BPE tokenizer with the special tokens (and chat template) of
    ``family``: Qwen's, or LLaVA-1.5's (Llama's tokens plus ``<image>``; a BOS is added)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if family in ("llava", "llava_next"):
        return _build_llava_tokenizer(
            LLAVA_CHAT_TEMPLATE if family == "llava" else LLAVA_NEXT_CHAT_TEMPLATE)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_BPE_VOCAB,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=32768,
    )


def _build_llava_tokenizer(chat_template: str = LLAVA_CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_BPE_VOCAB,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=list(LLAVA_SPECIAL_TOKENS[:4]),  # ids 0-3, as in Llama's order
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    tok.add_special_tokens([AddedToken("<image>", special=True, normalized=False)])
    bos = tok.token_to_id("<s>")
    tok.post_processor = TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        extra_special_tokens={"image_token": "<image>"},
        chat_template=chat_template,
        model_max_length=4096,
    )


def token_ids(tokenizer: PreTrainedTokenizerFast, family: str = "qwen2_vl") -> dict[str, int]:
    if family in ("llava", "llava_next"):
        ids = {t: tokenizer.convert_tokens_to_ids(t) for t in LLAVA_SPECIAL_TOKENS}
        return dict(image_token_id=ids["<image>"], bos_token_id=ids["<s>"],
                    eos_token_id=ids["</s>"], pad_token_id=ids["<pad>"])
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    return dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
