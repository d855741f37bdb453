"""JAX's persistent compilation cache for the command-line tools, and a count of what a run compiled.

The CLIs take `--compile-cache DIR|off`. With a directory, every program a run compiles is
written there (no minimum compile time or entry size, so the small programs count too), and a
later run with the same shapes, model and jax version loads them instead of compiling: a
second `dsv4-generate` with the same request compiles nothing. The default directory is
`$XDG_CACHE_HOME/dsv4-jax/jax`, or `~/.cache/dsv4-jax/jax` (delete it to reclaim the space).
"""

from __future__ import annotations

import argparse
import os

import jax

# jax's event around each compilation request; a request the persistent cache answers records
# CACHE_HIT_EVENT first.
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
OFF = "off"


def default_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "dsv4-jax", "jax")


def add_flag(parser: argparse.ArgumentParser, default: str | None = None) -> None:
    """Adds `--compile-cache DIR|off` (default: `default`, else default_dir())."""
    default = default_dir() if default is None else default
    parser.add_argument("--compile-cache", metavar="DIR|off", default=default,
                        help=f"JAX's persistent compilation cache directory, or 'off' (default: {default})")


def enable(setting: str) -> str | None:
    """Points JAX's persistent compilation cache at the directory `setting` (created if needed),
    keeping every program; "off" leaves it off. Call before anything compiles: jax decides once
    per process whether it uses the cache. Returns the directory, or None when off."""
    if setting == OFF:
        return None
    path = os.path.abspath(os.path.expanduser(setting))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise OSError(f"--compile-cache {setting}: cannot create the directory ({e.strerror or e})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise OSError(f"--compile-cache {setting}: the directory is not writable")
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # -1: no minimum, no override
    return path


class CompileCounter:
    """Counts the programs jax compiles while it is open (`with CompileCounter() as c:`):
    `c.compiled` (compiled here; their names in `c.programs`), `c.loaded` (answered by the
    persistent cache), `c.seconds` (time spent in compile requests, both kinds)."""

    def __init__(self):
        self.programs: list[str] = []
        self.loaded = 0
        self.seconds = 0.0
        self._hit = False  # the request under way was answered by the persistent cache

    @property
    def compiled(self) -> int:
        return len(self.programs)

    def _event(self, event: str, **_) -> None:
        if event == CACHE_HIT_EVENT:
            self._hit = True

    def _duration(self, event: str, seconds: float, fun_name: str = "?", **_) -> None:
        if event != COMPILE_EVENT:
            return
        self.seconds += seconds
        if self._hit:
            self.loaded += 1
        else:
            self.programs.append(fun_name)
        self._hit = False

    def __enter__(self) -> "CompileCounter":
        jax.monitoring.register_event_listener(self._event)
        jax.monitoring.register_event_duration_secs_listener(self._duration)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self._duration)
        jax.monitoring.unregister_event_listener(self._event)
