"""Rename a LLaVA checkpoint written by transformers 5.x to the hub's names, in place.

transformers 5.x saves the CLIP tower as `model.vision_tower.embeddings...`; vLLM 0.26.0
reads `...vision_tower.vision_model.embeddings...` (the hub's llava-hf layout). vlmserve
reads both. Usage: python benchmarks/hub_names.py CHECKPOINT_DIR
"""

import json
import re
import sys
from pathlib import Path

from safetensors.torch import load_file, save_file


def hub_name(key: str) -> str:
    return re.sub(r"vision_tower\.(?!vision_model\.)", "vision_tower.vision_model.", key)


def main(folder: Path) -> None:
    for f in sorted(folder.glob("*.safetensors")):
        tensors = load_file(f)
        save_file({hub_name(k): v for k, v in tensors.items()}, f, metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = {hub_name(k): v for k, v in data["weight_map"].items()}
        index.write_text(json.dumps(data, indent=2))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
