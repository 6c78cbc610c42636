"""The delta-rule swap and the extra arguments a block's call carries through ``**kwargs``."""

from __future__ import annotations

import pytest
import torch

from onboarding.patching.linear_attention import _call_ours


def _ignores(query, key, value, g, beta, chunk_size=64, initial_state=None,
             output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
    return query  # the body never reads kwargs


def _reads(query, key, value, g, beta, **kwargs):
    offsets = kwargs.get("cu_seqlens")  # variable-length sequences: other maths
    return query if offsets is None else query * 0


def _kernel(q, k, v, g, beta, **extra):
    return ("ours", extra)


def test_a_tensor_in_kwargs_the_function_never_reads_keeps_the_kernel():
    """onboard run hf:glm5_next_text --llm off: every Kimi-delta layer's patch was rejected
    ('arguments the kernel does not take: ['input_ids']'; 72 of 78 coverable blocks checked):
    its layers pass the model's input_ids down to chunk_kimi_delta_attention(..., **kwargs),
    whose body never reads them. A tensor in a **kwargs the body reads (sequence offsets) still
    keeps the original."""
    q = torch.zeros(1, 4, 2, 8)
    args = (q, q, q, q[..., 0], q[..., 0])
    ids = torch.zeros(1, 4, dtype=torch.long)
    got = _call_ours(_ignores, _kernel, args, {"input_ids": ids, "output_final_state": True})
    assert got == ("ours", {"initial_state": None, "output_final_state": True,
                            "use_qk_l2norm_in_kernel": False})
    with pytest.raises(TypeError, match=r"arguments the kernel does not take: \['cu_seqlens'\]"):
        _call_ours(_reads, _kernel, args, {"cu_seqlens": torch.tensor([0, 4])})


def test_the_hub_decorated_form_is_read_through_its_module():
    """transformers 5.25 turns chunk_kimi_delta_attention into a stateless module whose forward
    (``*args, **kwargs``, the function's signature) calls the function: its **kwargs are read
    as the function's own (here ignored), as the swap met it in hf:glm5_next_text."""
    modeling = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")
    fn = modeling.chunk_kimi_delta_attention
    fn = getattr(fn, "forward", fn)
    q = torch.zeros(1, 4, 2, 8)
    got = _call_ours(fn, _kernel, (q, q, q, q, q[..., 0]),
                     {"input_ids": torch.zeros(1, 4, dtype=torch.long)})
    assert got[0] == "ours"
