"""The zoo suite's models (``python -m bench --suite zoo``): real architectures at full size.

The ONNX project's architectures shipped in the onnx wheel (:mod:`bench.zoo_onnx`, through
TVM's ONNX frontend), torch models of each shape family (:mod:`bench.zoo_torch`,
through ``torch.export``) and one of them as its ONNX export, through the ONNX frontend
(MobileNetV2: ReLU6 as ONNX ``Clip``). They are registered in :data:`bench.models.ZOO` with suite
``"zoo"``; :mod:`bench.zoo_run` measures them.

Each row of :data:`ENTRIES` is ``(name, make, description, rounds, quick, tvm_default)``:
``rounds`` of timed blocks per candidate (few for the heavy models), ``quick`` puts the
model in ``--suite zoo --quick``, and ``tvm_default`` runs and times TVM's default build
too (its build time is measured for every model). That build runs single-threaded and
unscheduled (about 0.1-1.5 s per call for the models marked, several seconds for
ResNet-50, 20 s or more for VGG-19), so only the smaller models are run on it; the rest
are checked against onnxruntime's outputs instead.
"""

from __future__ import annotations

from functools import partial

from .zoo_onnx import light_model
from .zoo_torch import exported_model, torch_model


def _onnx(name: str, description: str, rounds: int, quick: bool = False, tvm: bool = False):
    return (f"onnx_{name}", partial(light_model, name), f"{description} (onnx wheel, ONNX "
            "frontend)", rounds, quick, tvm)


def _exported(name: str, description: str, rounds: int):
    return (f"onnx_{name}", partial(exported_model, name), f"{description} (torch model's ONNX "
            "export, ONNX frontend)", rounds, False, False)


def _torch(name: str, description: str, rounds: int, quick: bool = False):
    return (f"torch_{name}", partial(torch_model, name), f"{description} (torch.export)",
            rounds, quick, False)


ENTRIES = [
    _onnx("squeezenet", "SqueezeNet 1.1, 224x224", 5, quick=True, tvm=True),
    _onnx("shufflenet", "ShuffleNet (g=3), 224x224", 5, tvm=True),
    _onnx("inception_v1", "Inception v1 (GoogLeNet), 224x224", 4, tvm=True),
    _onnx("alexnet", "AlexNet (BVLC), 224x224", 4, tvm=True),
    _onnx("zfnet512", "ZFNet-512, 224x224", 4),
    _onnx("inception_v2", "Inception v2 (BN-Inception), 224x224", 4),
    _onnx("densenet121", "DenseNet-121, 224x224", 4),
    _onnx("resnet50", "ResNet-50 v1, 224x224", 4),
    _onnx("vgg19", "VGG-19, 224x224", 3),
    _torch("resnet50", "ResNet-50 v1.5, 224x224", 4),
    _torch("mobilenet_v2", "MobileNetV2 1.0, 224x224", 5, quick=True),
    _exported("mobilenet_v2", "MobileNetV2 1.0, 224x224, ReLU6 as Clip", 5),
    _torch("efficientnet_b0", "EfficientNet-B0 (MBConv+SE+SiLU), 224x224", 5),
    _torch("regnety_800mf", "RegNetY-800MF-style (grouped conv+SE), 224x224", 5),
    _torch("bert_base", "BERT-base encoder, 12 layers, seq 128 (transformers)", 3),
    _torch("vit_base", "ViT-B/16, 224x224, 197 tokens", 3),
]
