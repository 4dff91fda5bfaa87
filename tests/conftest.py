"""Test-wide settings: JAX's persistent compilation cache.

Many tests compile the same small programs (the same model and step on digits) in new trainer
objects or new processes; the persistent cache turns those recompilations into disk reads. The
environment variables reach the `experiments.main` subprocesses too.
"""

import os
import pathlib
import tempfile

import jax

_CACHE = os.environ.setdefault(
  'JAX_COMPILATION_CACHE_DIR', str(pathlib.Path(tempfile.gettempdir()) / 'jfed-test-jax-cache')
)
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '0')
jax.config.update('jax_compilation_cache_dir', _CACHE)
jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)
