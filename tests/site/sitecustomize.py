"""The test environment's start-up hook (tests/conftest.py runs it in the test process and puts
this folder on PYTHONPATH of every process the tests start).

On the CPU test machines the torchvision that installs beside the CPU torch is PyTorch's CUDA
build: its C++ ops do not load, and its import then fails declaring fake kernels for two ops
that do not exist. Image processing (resize, normalize) is plain torch and works, so when
torchvision is first looked for, the two op schemas are declared if, and only if, its C++ ops
do not load. Where torchvision loads normally (the GPU image) nothing is declared. Nothing
is imported at start-up (a process that never looks for torchvision never loads torch here)."""

import sys


def declare_missing_torchvision_ops():
    """Declare ``torchvision::nms`` and ``torchvision::qnms`` where torchvision is installed
    and its C++ ops do not load: the `torch.library.Library` that holds them (the schemas go
    when it is collected), or None where nothing was declared."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return None
    import torch

    try:
        torch.ops.torchvision.nms  # noqa: B018  (declared or loaded already)
        return None
    except (AttributeError, RuntimeError):
        pass
    for lib in Path(spec.submodule_search_locations[0]).glob("_C*.so"):
        try:
            torch.ops.load_library(str(lib))
            return None
        except OSError:
            pass
    lib = torch.library.Library("torchvision", "DEF")
    for op in ("nms", "qnms"):
        lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    return lib


class _TorchvisionOps:
    """A finder that finds nothing: on the first look-up of torchvision it declares the
    missing ops, and it stays on ``sys.meta_path`` holding them."""

    def __init__(self) -> None:
        self.looked = False
        self.library = None

    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" and not self.looked:
            self.looked = True
            self.library = declare_missing_torchvision_ops()
        return None


if not any(type(f).__name__ == "_TorchvisionOps" for f in sys.meta_path):
    sys.meta_path.insert(0, _TorchvisionOps())
