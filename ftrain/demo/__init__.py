"""The built-in demo, ``python -m ftrain.demo``: read :mod:`ftrain.demo.train`."""

from ftrain.demo.train import CharTransformer, build, build_short, corpus, loss_fn, main

__all__ = ["CharTransformer", "build", "build_short", "corpus", "loss_fn", "main"]
