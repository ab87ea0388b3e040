"""vlmserve: a serving engine for vision-language models."""

from vlmserve.llm import LLM
from vlmserve.outputs import CompletionOutput, RequestOutput
from vlmserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "MultimodalEncoder"]
__version__ = "0.1.0"


def __getattr__(name: str):  # the encoder service's class, imported on first use
    if name == "MultimodalEncoder":
        from vlmserve.encoder.encoder import MultimodalEncoder

        return MultimodalEncoder
    raise AttributeError(f"module 'vlmserve' has no attribute {name!r}")
