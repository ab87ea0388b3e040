"""Every model class the registry hands out has the whole model interface
(`models/interfaces.py`), checked when it is handed out; a class missing a part is refused
naming it."""

from __future__ import annotations

import importlib

import pytest

from vlmserve.models import registry
from vlmserve.models.interfaces import check_model_class
from vlmserve.models.llava import LlavaForConditionalGeneration
from vlmserve.models.transformers_backend import TransformersVLM


@pytest.mark.parametrize("arch", sorted(registry._MODELS))
def test_every_native_class_has_the_interface(arch):
    module, name = registry._MODELS[arch]
    cls = getattr(importlib.import_module(module), name)
    assert check_model_class(cls) is cls
    # Gemma 3's images read themselves both ways; every other native family causally
    assert cls.reads_images_both_ways(None) is (arch == "Gemma3ForConditionalGeneration")


def test_the_transformers_backend_has_the_interface():
    assert check_model_class(TransformersVLM) is TransformersVLM


def test_a_class_missing_a_part_is_refused_naming_it():
    class NoMerge(LlavaForConditionalGeneration):
        merge_image_rows = None

    del NoMerge.merge_image_rows
    broken = type("Broken", (), {k: getattr(LlavaForConditionalGeneration, k)
                                 for k in ("input_processor_cls", "encoder_prefixes",
                                           "image_row_width", "forward")})
    with pytest.raises(TypeError, match="lacks .*reads_images_both_ways.*merge_image_rows"
                                        ".*load_weights or from_checkpoint"):
        check_model_class(broken)
