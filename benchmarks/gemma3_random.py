"""A random-weight checkpoint of google/gemma-3-4b-it's shapes, for side-by-side runs against vLLM
(no weights can be downloaded here): 34 text layers of width 2560 (8 query / 4 KV heads of 256),
five sliding-window layers (window 1024) to each full one, vocabulary 262,208; the SigLIP
so400m tower at 896 px (27 layers of 1152) and 256 tokens an image. The tokenizer is the small
built-in BPE with Gemma's turn and image marks (the vocabulary beyond it is never named by a
prompt); weights are transformers' own init (std 0.02) from seed 0, in bfloat16.

    python benchmarks/gemma3_random.py PATH [--device cuda] [--text-layers N] [--vision-layers N]

Fewer layers (`--text-layers 2 --vision-layers 1`) make a quick checkpoint of the same widths."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.models.hf_tiny import GEMMA_TURNS, _gemma_template, ids, make_tokenizer  # noqa: E402


def build(path: Path, device: str = "cpu", text_layers: int = 34, vision_layers: int = 27) -> Path:
    import transformers as tf

    marks = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
             "image_token": "<image_soft_token>"}
    tok = make_tokenizer([*GEMMA_TURNS, *marks.values()], extra=marks)
    image_processor = getattr(tf, "Gemma3ImageProcessorPil", None) or tf.Gemma3ImageProcessor
    processor = tf.Gemma3Processor(
        image_processor=image_processor(size={"height": 896, "width": 896},
                                        image_mean=[0.5] * 3, image_std=[0.5] * 3),
        tokenizer=tok, image_seq_length=256, chat_template=_gemma_template("<start_of_image>"))
    boi, eoi, image = ids(tok, *marks.values())
    special = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                   pad_token_id=tok.pad_token_id)
    text = dict(
        model_type="gemma3_text", vocab_size=262208, hidden_size=2560, intermediate_size=10240,
        num_hidden_layers=text_layers, num_attention_heads=8, num_key_value_heads=4,
        head_dim=256, query_pre_attn_scalar=256, sliding_window=1024,
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                     for i in range(text_layers)],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                            "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
        max_position_embeddings=131072, **special)
    vision = dict(model_type="siglip_vision_model", hidden_size=1152, intermediate_size=4304,
                  num_hidden_layers=vision_layers, num_attention_heads=16, image_size=896,
                  patch_size=14, vision_use_head=False)
    config = tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=256,
                             boi_token_index=boi, eoi_token_index=eoi, image_token_index=image,
                             **special)
    config.architectures = ["Gemma3ForConditionalGeneration"]
    with torch.device(device):
        torch.manual_seed(0)
        model = tf.Gemma3ForConditionalGeneration(config).to(torch.bfloat16).eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", type=Path)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--text-layers", type=int, default=34)
    ap.add_argument("--vision-layers", type=int, default=27)
    a = ap.parse_args()
    print(build(a.path, a.device, a.text_layers, a.vision_layers))


if __name__ == "__main__":
    main()
