"""The benchmark scripts' tests share the suite's setup (a private TRAINFORGE_CACHE, the kernel
cache `make install` built, one thread per xdist worker): tests/conftest.py."""

from tests.conftest import *  # noqa: F401,F403
from tests.conftest import builtin_data, small_data, tf_cache  # noqa: F401
