"""`forked(fn, *args)`: run one benchmark configuration in a forked child, shared by
benchmarks/bench_draft.py and its worker in the speculators venv (benchmarks/bench_speculators_step.py),
so this module imports nothing beyond the standard library."""

import json
import os


def forked(fn, *args) -> dict:
    """fn(*args) in a forked child (imports are shared, so a configuration costs no start-up; its
    peak memory is its own). Returns fn's dict (JSON round-tripped), or {"error": ...} if the
    child raised or died (e.g. killed for memory)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        try:
            out = json.dumps(fn(*args))
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            out = json.dumps({"error": f"failed: {type(e).__name__}: {str(e)[:140]}"})
        with os.fdopen(w, "w") as f:
            f.write(out)
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    if not data:
        return {"error": f"failed: the process died (status {status}; out of memory?)"}
    return json.loads(data)
