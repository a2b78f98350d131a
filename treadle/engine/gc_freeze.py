"""The start-up heap, frozen out of the garbage collector's full passes.

Owns `freeze_startup_heap`: once an engine (and a server around it) has loaded, the
objects it built — the model's modules and parameters, the tokenizer, the app — live as
long as the process, yet CPython's full (generation 2) collections walk every one of them
each time: ~90-120 ms for the ~330,000 objects of an offline engine on the demo model,
more in a server (~347,000 objects), and every thread waits meanwhile (the collector
holds the GIL), so each full pass under load is an engine step that much longer.
`gc.freeze()` moves what exists
into a permanent generation that collections skip; what requests allocate later is
collected as before. vLLM and SGLang freeze after start-up for the same reason.

Called where a process serves one engine for its whole life (`treadle serve`, a Ray
Serve replica), never by the library's constructors: a process that builds and drops
engines (a test suite, a notebook) would keep the cycles of every engine it froze.
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)


def freeze_startup_heap(what: str) -> int:
    """Collect start-up garbage, then freeze what is left (call once `what` has loaded);
    the number of objects frozen so far in the process."""
    start = time.perf_counter()
    gc.collect()  # start-up garbage is freed, not frozen
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.debug("%s loaded: %d objects frozen out of full collections (%.0f ms)", what,
                 frozen, 1e3 * (time.perf_counter() - start))
    return frozen
