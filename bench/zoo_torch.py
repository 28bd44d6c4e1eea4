"""Full-size torch models for the zoo suite, written here (torchvision is not a dependency).

One per shape family: ResNet-50 (bottlenecks), MobileNetV2 (inverted residuals, depthwise
convs, ReLU6), EfficientNet-B0 (MBConv with squeeze-excitation and SiLU), a RegNetY-800MF
style net (grouped 3x3 convs + SE), BERT-base (``transformers.BertModel``, 12 layers,
hidden 768, seq 128) and ViT-B/16 (224x224, 197 tokens). Random weights, eval mode, batch 1.
Each goes through ``torch.export`` + ``from_exported_program`` (:func:`bench.frontends.from_torch`);
its module is also the torch eager peer and the source of onnxruntime's file.

Weights: conv weights are He-initialized with zero-mean filters and batch norms get
random running statistics (variance in [0.5, 1.5]); the last batch norm of each residual
branch is scaled by 0.2-0.4 so that sums of branches do not grow with depth and the
outputs stay in a range where an error means something.
"""

from __future__ import annotations

import os
import tempfile
import zlib

from .case import Case, Skip
from .frontends import from_torch
from .peers import onnx_file


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


def _conv_bn(nn, cin, cout, k=1, stride=1, groups=1, act=None):
    """conv (no bias) + batch norm (+ activation): the unit of every CNN here."""
    layers = [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False),
              nn.BatchNorm2d(cout)]
    return nn.Sequential(*layers, *([act()] if act else []))


def _squeeze_excite(nn, channels, squeezed, act):
    class SE(nn.Module):
        def __init__(self):
            super().__init__()
            self.pool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Sequential(nn.Conv2d(channels, squeezed, 1), act(),
                                    nn.Conv2d(squeezed, channels, 1), nn.Sigmoid())

        def forward(self, x):
            return x * self.fc(self.pool(x))

    return SE()


def _residual(nn, body, shortcut=None):
    """``body(x) + shortcut(x)`` (identity shortcut when None)."""
    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.shortcut = body, shortcut

        def forward(self, x):
            return self.body(x) + (x if self.shortcut is None else self.shortcut(x))

    return Residual()


def _init(torch, net, seed: str):
    """He-initialized zero-mean conv filters, random BN statistics (see the module doc)."""
    nn = torch.nn
    torch.manual_seed(zlib.crc32(seed.encode()))
    for m in net.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
            with torch.no_grad():  # zero-mean filters: relu's positive mean does not pile up
                m.weight -= m.weight.mean(dim=(1, 2, 3), keepdim=True)
        elif isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.1, 0.1)
            m.running_var.uniform_(0.5, 1.5)
            nn.init.uniform_(m.weight, 0.8, 1.2)
            nn.init.uniform_(m.bias, -0.1, 0.1)
    for m in net.modules():  # the branch ends, after the generic pass
        if type(m).__name__ == "Residual":
            bns = [b for b in m.body.modules() if isinstance(b, nn.BatchNorm2d)]
            nn.init.uniform_(bns[-1].weight, 0.2, 0.4)
    return net.eval()


def _classifier(nn, features, cin, head=1000):
    return nn.Sequential(*features, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, head))


def resnet50_net(torch):
    """ResNet-50 v1.5 (stride in the 3x3 conv), torchvision's layout."""
    nn = torch.nn
    layers, cin = [_conv_bn(nn, 3, 64, 7, 2, act=nn.ReLU), nn.MaxPool2d(3, 2, 1)], 64
    for width, blocks, stride in [(64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)]:
        for b in range(blocks):
            s, cout = (stride if b == 0 else 1), width * 4
            body = nn.Sequential(_conv_bn(nn, cin, width, 1, act=nn.ReLU),
                                 _conv_bn(nn, width, width, 3, s, act=nn.ReLU),
                                 _conv_bn(nn, width, cout, 1))
            short = _conv_bn(nn, cin, cout, 1, s) if (s != 1 or cin != cout) else None
            layers += [_residual(nn, body, short), nn.ReLU()]
            cin = cout
    return _classifier(nn, layers, cin)


def _inverted(nn, cin, cout, expand, k, stride, act, se_ratio=0.0):
    """MobileNetV2 / EfficientNet block: 1x1 expand, kxk depthwise, (SE), 1x1 project."""
    mid = cin * expand
    parts = [_conv_bn(nn, cin, mid, 1, act=act)] if expand != 1 else []
    parts.append(_conv_bn(nn, mid, mid, k, stride, groups=mid, act=act))
    if se_ratio:
        parts.append(_squeeze_excite(nn, mid, max(1, int(cin * se_ratio)), act))
    parts.append(_conv_bn(nn, mid, cout, 1))
    body = nn.Sequential(*parts)
    return _residual(nn, body) if stride == 1 and cin == cout else body


def mobilenet_v2_net(torch):
    """MobileNetV2 1.0, 224x224 (ReLU6, inverted residuals, linear bottlenecks)."""
    nn = torch.nn
    layers, cin = [_conv_bn(nn, 3, 32, 3, 2, act=nn.ReLU6)], 32
    for t, c, n, s in [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
                       (6, 160, 3, 2), (6, 320, 1, 1)]:
        for i in range(n):
            layers.append(_inverted(nn, cin, c, t, 3, s if i == 0 else 1, nn.ReLU6))
            cin = c
    layers.append(_conv_bn(nn, cin, 1280, 1, act=nn.ReLU6))
    return _classifier(nn, layers, 1280)


def efficientnet_b0_net(torch):
    """EfficientNet-B0: MBConv with squeeze-excitation (ratio 0.25) and SiLU."""
    nn = torch.nn
    layers, cin = [_conv_bn(nn, 3, 32, 3, 2, act=nn.SiLU)], 32
    for e, k, s, c, n in [(1, 3, 1, 16, 1), (6, 3, 2, 24, 2), (6, 5, 2, 40, 2), (6, 3, 2, 80, 3),
                          (6, 5, 1, 112, 3), (6, 5, 2, 192, 4), (6, 3, 1, 320, 1)]:
        for i in range(n):
            layers.append(_inverted(nn, cin, c, e, k, s if i == 0 else 1, nn.SiLU, 0.25))
            cin = c
    layers.append(_conv_bn(nn, cin, 1280, 1, act=nn.SiLU))
    return _classifier(nn, layers, 1280)


def regnety_net(torch):
    """RegNetY-800MF-style: stages of bottleneck-ratio-1 blocks, grouped 3x3 (group width
    16), SE (0.25 of the block input), widths 64-144-320-784, depths 1-3-8-2."""
    nn = torch.nn
    layers, cin = [_conv_bn(nn, 3, 32, 3, 2, act=nn.ReLU)], 32
    for width, depth in [(64, 1), (144, 3), (320, 8), (784, 2)]:
        for i in range(depth):
            stride = 2 if i == 0 else 1
            body = nn.Sequential(_conv_bn(nn, cin, width, 1, act=nn.ReLU),
                                 _conv_bn(nn, width, width, 3, stride, groups=width // 16,
                                          act=nn.ReLU),
                                 _squeeze_excite(nn, width, max(1, cin // 4), nn.ReLU),
                                 _conv_bn(nn, width, width, 1))
            short = _conv_bn(nn, cin, width, 1, stride) if (stride != 1 or cin != width) else None
            layers += [_residual(nn, body, short), nn.ReLU()]
            cin = width
    return _classifier(nn, layers, cin)


def vit_base_net(torch, layers=12, dim=768, heads=12, mlp=3072, patch=16, size=224):
    """ViT-B/16: patch embedding, class token, 12 pre-norm encoder layers, head on the token."""
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
            self.mlp = nn.Sequential(nn.Linear(dim, mlp), nn.GELU(), nn.Linear(mlp, dim))

        def forward(self, x):  # attention written out: nn.MultiheadAttention's fast path
            b, n, _ = x.shape  # (a fused kernel in eval mode) is not what the frontends see
            q, k, v = self.qkv(self.ln1(x)).reshape(b, n, 3, heads, dim // heads).permute(2, 0, 3, 1, 4)
            att = torch.softmax(q @ k.transpose(-2, -1) * (dim // heads) ** -0.5, dim=-1)
            x = x + self.proj((att @ v).transpose(1, 2).reshape(b, n, dim))
            return x + self.mlp(self.ln2(x))

    class ViT(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Conv2d(3, dim, patch, patch)
            self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
            self.pos = nn.Parameter(torch.randn(1, (size // patch) ** 2 + 1, dim) * 0.02)
            self.blocks = nn.Sequential(*[Block() for _ in range(layers)])
            self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, 1000)

        def forward(self, img):
            x = self.embed(img).flatten(2).transpose(1, 2)
            x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
            return self.head(self.norm(self.blocks(x))[:, 0])

    return ViT()


def bert_base_net(torch):
    """``transformers.BertModel`` with BERT-base's config (random init), returning the
    last hidden state; eager attention (matmul + softmax), as in the original."""
    import transformers

    cfg = transformers.BertConfig(attn_implementation="eager")
    bert = transformers.BertModel(cfg, add_pooling_layer=False).eval()

    class LastHidden(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = bert

        def forward(self, ids):  # a tensor, not a ModelOutput: the peers flatten outputs
            return self.bert(input_ids=ids).last_hidden_state

    return LastHidden()


CNNS = {"resnet50": resnet50_net, "mobilenet_v2": mobilenet_v2_net,
        "efficientnet_b0": efficientnet_b0_net, "regnety_800mf": regnety_net}


def torch_model(name: str) -> Case | Skip:
    """The zoo's torch model ``name`` (a key of :data:`CNNS`, ``vit_base`` or ``bert_base``)
    through ``torch.export``, or a Skip naming what is missing."""
    torch = _torch()
    if torch is None:
        return Skip("torch is not installed (pip install torch==2.13.0)")
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name}/input".encode()))
    if name == "bert_base":
        torch.manual_seed(zlib.crc32(name.encode()))  # BertModel initializes its own weights
        try:
            net = bert_base_net(torch)
        except ImportError:
            return Skip("transformers is not installed (pip install transformers)")
        return from_torch(net, torch.randint(0, 30522, (1, 128), generator=gen))
    maker = vit_base_net if name == "vit_base" else CNNS[name]
    torch.manual_seed(zlib.crc32(name.encode()))
    net = _init(torch, maker(torch), name)
    return from_torch(net, torch.randn(1, 3, 224, 224, generator=gen))


def exported_model(name: str) -> Case | Skip:
    """The zoo's torch model ``name`` as its ONNX export (the file onnxruntime and OpenVINO
    read), through TVM's ONNX frontend: the model as an ONNX user hands it to TVM, where
    ``torch.export`` gives Relax ops directly (ReLU6 arrives as ``Clip``, which the ONNX
    frontend writes as TOPI tensor expressions: :mod:`jitbyoc.tvm.lift_te`)."""
    case = torch_model(name)
    if isinstance(case, Skip):
        return case
    try:
        import onnx
    except ImportError:
        return Skip("onnx is not installed (pip install onnx)")
    from tvm.relax.frontend.onnx import from_onnx

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{name}.onnx")
        why = onnx_file(case, path)
        if why is not None:
            return Skip(why)
        with open(path, "rb") as f:
            data = f.read()
    mod = from_onnx(onnx.load_from_string(data), keep_params_in_input=False)
    return Case(mod, case.inputs, onnx_model=data)
