"""The torchrun-style environment of a task that ``srun`` started (used by ``ftrain.dist.init``).

Example:
    >>> from ftrain._slurm import first_host, slurm_env
    >>> first_host("gpu[03-05,9],cpu1")
    'gpu03'
    >>> slurm_env({}) is None   # not started by srun
    True
"""

from __future__ import annotations

import re
from collections.abc import Mapping

#: The port rank 0 listens on under ``srun`` when ``MASTER_PORT`` is not set:
#: ``SLURM_PORT_BASE + SLURM_JOB_ID % 20000`` (a different port for each job).
SLURM_PORT_BASE = 20000


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list (``"gpu[03-05,9],cpu1"`` -> ``"gpu03"``)."""
    m = re.fullmatch(r"([^,\[]*)(?:\[([^\]]*)\]([^,]*))?(?:,.*)?", nodelist.strip())
    if m is None or not (m.group(1) or m.group(2)):
        raise ValueError(f"not a Slurm node list: {nodelist!r}")
    if m.group(3) and "[" in m.group(3):
        raise ValueError(f"unsupported Slurm node list: {nodelist!r}")
    first = m.group(2).split(",")[0].split("-")[0] if m.group(2) is not None else ""
    return m.group(1) + first + (m.group(3) or "")


def slurm_env(environ: Mapping[str, str]) -> dict[str, str] | None:
    """The torchrun-style variables of a task started by ``srun`` (None: not one)."""
    if "SLURM_PROCID" not in environ:
        return None
    tasks = environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS")
    if tasks is None or int(tasks) <= 1:
        return None  # one task (or a batch script's own shell): one process
    missing = [k for k in ("SLURM_LOCALID",) if k not in environ]
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_NODELIST")
    if nodelist is None and "MASTER_ADDR" not in environ:
        missing.append("SLURM_STEP_NODELIST or SLURM_NODELIST (or MASTER_ADDR)")
    if "SLURM_JOB_ID" not in environ and "MASTER_PORT" not in environ:
        missing.append("SLURM_JOB_ID (or MASTER_PORT)")
    if missing:
        raise RuntimeError(
            f"ftrain.dist.init: this looks like an srun launch of {tasks} tasks "
            f"(SLURM_PROCID is set) but {', '.join(missing)} is not set, so the processes "
            "cannot find each other. Launch with `srun python train.py` inside an allocation, "
            "or use torchrun (which sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."
        )
    out = {
        "RANK": environ["SLURM_PROCID"],
        "WORLD_SIZE": str(int(tasks)),
        "LOCAL_RANK": environ["SLURM_LOCALID"],
    }
    if "SLURM_NTASKS_PER_NODE" in environ and environ["SLURM_NTASKS_PER_NODE"].isdigit():
        out["LOCAL_WORLD_SIZE"] = environ["SLURM_NTASKS_PER_NODE"]
    if "MASTER_ADDR" not in environ:
        try:
            out["MASTER_ADDR"] = first_host(nodelist or "")
        except ValueError as exc:
            raise RuntimeError(
                f"ftrain.dist.init (srun): cannot read the master host from the node list "
                f"{nodelist!r} ({exc}). Set MASTER_ADDR to the first node's host name "
                "(e.g. `export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | "
                "head -n1)`)."
            ) from exc
    if "MASTER_PORT" not in environ:
        out["MASTER_PORT"] = str(SLURM_PORT_BASE + int(environ["SLURM_JOB_ID"]) % 20000)
    return out
