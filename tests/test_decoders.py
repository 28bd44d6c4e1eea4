"""Decoder LLMs from HuggingFace ``transformers`` (small configs, ``use_cache=False``),
exported with ``torch.export`` and imported with ``from_exported_program``: TVM 0.27's own
build fails on ops it leaves to its legalization (a bool ``cumsum``, int8 reductions...);
with jitbyoc every op is offloaded (or computed by TVM where it can) and the logits
match torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
import tvm
from tvm import relax
from tvm.relax.frontend.torch import from_exported_program

import jitbyoc

SMALL = dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=64, intermediate_size=128,
             vocab_size=128, max_position_embeddings=512)
CONFIGS = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_head=4, n_embd=64, vocab_size=128, n_positions=512, bos_token_id=0, eos_token_id=0)),
    # grouped-query attention (4 query heads share 2 key/value heads), rotary embeddings,
    # RMS norm, SiLU-gated MLP
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(num_key_value_heads=2, **SMALL)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(num_key_value_heads=2, **SMALL)),
    # multi-query attention: one key/value head, taken from the fused projection by
    # x[..., [-2], :] and x[..., [-1], :] ("fast" takes of indices -2 and -1: logits 0.38 off
    # torch's when they were clamped to 0)
    "falcon": lambda: transformers.FalconForCausalLM(transformers.FalconConfig(
        num_hidden_layers=2, num_attention_heads=4, hidden_size=64, vocab_size=128, multi_query=True,
        new_decoder_architecture=False, parallel_attn=True, bias=False, alibi=False)),
}


class Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, use_cache=False).logits


def model_of(name: str) -> Logits:
    torch.manual_seed(0)
    return Logits(CONFIGS[name]().eval()).eval()


def exported(name: str, length: int):
    model = model_of(name)
    ids = torch.randint(0, 128, (1, length))
    with torch.no_grad():
        program = torch.export.export(model, (ids,))
        want = model(ids).numpy()
    return from_exported_program(program, keep_params_as_input=False), ids.numpy(), want


def run(ex, ids: np.ndarray) -> np.ndarray:
    got = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(ids))
    return (got[0] if not hasattr(got, "numpy") else got).numpy()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_decoder_builds_with_jitbyoc_and_matches_torch(name):
    mod, ids, want = exported(name, 7)
    with jitbyoc.disabled(), pytest.raises(Exception, match="kDLFloat"):  # TVM 0.27 alone
        tvm.compile(mod, target="llvm")
    with jitbyoc.enabled():
        ex = tvm.compile(mod, target="llvm")
        report = jitbyoc.last_report()
    assert report.fallbacks == [], str(report)
    np.testing.assert_allclose(run(ex, ids), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_decoder_with_a_symbolic_length_builds_once_and_matches_torch_at_every_length(name):
    """``torch.export.Dim`` for the sequence: TVM alone cannot build it (its cumsum
    lowering needs a shape that slicing clamps erased); jitbyoc recovers the shapes from
    the declared bounds and builds one executable for every length."""
    model = model_of(name)
    seq = torch.export.Dim("seq", min=1, max=512)
    with torch.no_grad():
        program = torch.export.export(model, (torch.zeros((1, 7), dtype=torch.int64),),
                                      dynamic_shapes={"ids": {1: seq}})
    mod = from_exported_program(program, keep_params_as_input=False)
    with jitbyoc.disabled(), pytest.raises(Exception, match="non-symbolic shape"):
        tvm.compile(mod, target="llvm")
    with jitbyoc.enabled():
        ex = tvm.compile(mod, target="llvm")
        report = jitbyoc.last_report()
    assert report.fallbacks == [], str(report)
    rng = np.random.default_rng(0)
    for length in (1, 7, 128, 500):
        ids = rng.integers(0, 128, (1, length), dtype=np.int64)
        with torch.no_grad():
            want = model(torch.from_numpy(ids)).numpy()
        np.testing.assert_allclose(run(ex, ids), want, rtol=1e-4, atol=2e-5, err_msg=f"length {length}")
