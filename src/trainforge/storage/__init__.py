"""Files on disk that a crash, a kill or a full disk never leaves half-written.

One technique per file, used by every writer in trainforge (training checkpoints,
``trainforge quantize``, ``trainforge prepare``, the shard cache, the measured-facts
cache):

* ``atomic.py``: write a file or a directory under a temporary name, fsync, rename into place.
* ``manifest.py``: sha256 of files, and checking files against a recorded list of digests.
* ``checkpoint_format.py``: a checkpoint directory's ``meta.json`` (format and version
  fields, the files' sha256) written and read with errors that name the file.
* ``checkpoint_dirs.py``: ``step_NNNNNNN`` directories: naming, listing, resolving, replacing.
* ``output_paths.py``: a command's output never is, contains or lies inside what it reads.

This package imports nothing from the rest of trainforge but ``errors`` and ``log``, so
any layer may write through it.
"""
