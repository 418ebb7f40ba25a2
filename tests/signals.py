"""Child processes that tests stop with SIGINT must hear it: a test run started from a background job of a
shell without job control (`cmd &` in a script, `nohup`) inherits SIGINT ignored, every child inherits
that, and Python then installs no KeyboardInterrupt handler (a `lorafn up` that never stopped, a `lorafn
logs -f` that never ended: seen in a CI run launched that way). Pass `preexec_fn=sigint_default` to the
child's Popen (or asyncio's create_subprocess_exec)."""

from __future__ import annotations

import signal


def sigint_default() -> None:
    """In the child, before exec: SIGINT back to its default disposition (Python then handles it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
