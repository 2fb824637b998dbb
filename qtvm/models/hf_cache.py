"""transformers decoder -> a module with flat past tensors in and flat present tensors out.

How optimum (and qtvm's KV-cache tests and ``qtvm bench e2e``) export a cache: inputs
``input_ids, attention_mask, past.0.key, past.0.value, ...``, outputs ``logits, present...``.
"""
from __future__ import annotations


def flat_cache_module(model, layers: int):
    """``model`` (a transformers causal LM) wrapped for export with a flat KV cache."""
    import torch
    import transformers as tf

    class WithCache(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, input_ids, attention_mask, *past):
            cache = tf.DynamicCache(ddp_cache_data=[(past[2 * i], past[2 * i + 1]) for i in range(layers)])
            out = self.m(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True)
            flat = []
            for layer in out.past_key_values.layers:
                flat += [layer.keys, layer.values]
            return (out.logits, *flat)

    return WithCache()
