"""The JIT builder: builds the modules of ``jit/modules.py`` with ninja and caches them per target.

* The cache key covers the module's sources and every header they may include, the flags,
  the compiler's identity and the target, so an edit or a compiler upgrade rebuilds.
* A file lock serialises concurrent first calls from several processes (one builds, the
  others wait and then load its result); the ``.so`` and its manifest are installed by
  atomic rename, and a cached file whose hash does not match its manifest is rebuilt.
* A missing compiler raises :class:`CompilerNotFound`, which says what to install; a cache
  directory that cannot hold or load modules raises :class:`CacheDirError`; a build lock held
  too long (``AITER_SAGE_LOCK_TIMEOUT``) raises :class:`LockTimeout`, naming the holder.

One job per module: ``paths`` (where csrc/, jit/, the cache and the prebuilt modules are),
``toolchains`` (one per build kind, and ``toolchain_for``), ``cache`` (the cache folder, the
key, the lock, the manifest), ``ninja`` (build files and the ninja run), ``driver``
(``ensure_module``, ``build_into``, ``prebuild``); ``errors`` holds what they raise. The log
lines go to the package's logger (``aiter_sage.log``).

Nothing here imports torch at import time: ``setup.py`` loads this package without importing
``aiter_sage`` itself, to prebuild.
"""
