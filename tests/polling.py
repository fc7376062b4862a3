"""Waiting on other threads, always with a bound, so that a bug fails a test instead of hanging it."""

import threading
import time

TIMEOUT = 5.0


def wait_until(condition, timeout: float = 5.0) -> bool:
    """Whether `condition()` became true within `timeout` seconds (checked every 2 ms)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.002)
    return condition()


def background(fn, timeout: float = TIMEOUT):
    """Runs `fn` on a thread; the returned `result()` joins it (within `timeout`) and gives what
    it returned or re-raises what it raised."""
    out = {}

    def body():
        try:
            out["value"] = fn()
        except BaseException as e:  # handed to the test thread
            out["error"] = e

    t = threading.Thread(target=body, daemon=True)
    t.start()

    def result():
        t.join(timeout)
        assert not t.is_alive(), "the other side hung"
        if "error" in out:
            raise out["error"]
        return out["value"]

    return result
