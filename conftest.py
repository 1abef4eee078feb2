"""Root pytest configuration: what ``pytest --doctest-modules ftrain`` skips."""

# The old name of ftrain.transforms.remat: importing it raises an ImportError naming the new one.
collect_ignore = ["ftrain/transforms/checkpoint.py"]
