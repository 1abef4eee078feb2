"""Persistence: how runs are saved and loaded, one module per concept.

``files`` (atomic writes, checksums), ``manifest`` (the run's list of checkpoints),
``writer`` (background writes), ``lock`` (one run per directory), ``rng``, ``state`` (a
``TrainState`` as a dict, and back), ``checkpointer`` (one process, DDP or FSDP2),
``agree`` (ranks agreeing to save), ``resume`` (the run protocol), ``weights`` (weights
only, in), ``export`` and ``safetensors_files`` (weights out as safetensors).
The public names are re-exported by :mod:`ftrain.checkpoint`.
"""
