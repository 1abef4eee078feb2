"""The built-in demo: a tiny character-level transformer trained on shipped text.

Run it with ``python -m ftrain.demo`` (``--help`` for the options). It trains
with :func:`ftrain.loop` and hooks into a run directory (``runs/demo``:
checkpoints, the best checkpoint, ``metrics.jsonl``, TensorBoard) and, run
again, resumes from it. The pieces are reusable from benchmarks and notebooks:

* :class:`~ftrain.demo.model.CharTransformer`, the model;
* :func:`~ftrain.demo.model.make_dataset`, the shipped corpus as character ids,
  with random ``(x, y)`` batches (:meth:`~ftrain.demo.model.CharDataset.sample`,
  :meth:`~ftrain.demo.model.CharDataset.batches`);
* :func:`~ftrain.demo.model.lm_loss`, the ``loss_fn(model, batch)`` for a step;
* :func:`~ftrain.demo.train.make_loader`, resumable shuffled batches
  (a torchdata ``StatefulDataLoader``);
* :func:`~ftrain.demo.train.build_step` / :func:`~ftrain.demo.train.build_hooks`,
  the composed step and the hooks;
* :func:`~ftrain.demo.train.main` / :func:`~ftrain.demo.train.train`.

The corpus (``corpus.txt``) was generated from standard-library docstrings by
:mod:`ftrain.demo.make_corpus`; nothing is downloaded.
"""

from ftrain.demo.model import CharDataset, CharTransformer, lm_loss, load_corpus, make_dataset
from ftrain.demo.train import TrainResult, main, train

__all__ = [
    "CharTransformer",
    "CharDataset",
    "make_dataset",
    "load_corpus",
    "lm_loss",
    "main",
    "train",
    "TrainResult",
]
