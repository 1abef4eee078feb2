"""Check that a run resumes exactly: ``python -m ftrain.verify module:function``.

Give it the function that builds your run, ``build(work_dir, resume) -> ftrain.Loop``; it
runs it uninterrupted, resumes it from a checkpoint at every update (and, with
``signals=``, after SIGINT/SIGTERM/SIGKILL in subprocesses), and reports either
``bitwise equal at N/N resume points`` or where a resumed run first differs: the update,
the part (data order, RNG, hook state, transform state, optimizer state, weights, log
lines), the tensor or key, and the largest difference. See ``docs/verify.md``.

Example:
    >>> from ftrain.verify import verify_resume, Verdict
    >>> callable(verify_resume), Verdict.__name__
    (True, 'Verdict')
"""

from ftrain.verify.core import KINDS, verify_resume
from ftrain.verify.fingerprint import PARTS
from ftrain.verify.verdict import Divergence, Signalled, Verdict

__all__ = ["verify_resume", "Verdict", "Divergence", "Signalled", "PARTS", "KINDS"]
