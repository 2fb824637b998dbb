"""Registered TensorIntrins (desc/impl pairs) with systematic names."""
