import subprocess
import sys

import pytest

from tests.parallel.torchrun import WORKERS, torchrun_env


@pytest.mark.slow
def test_torchrun_max_restarts_rendezvous_again_with_gloo():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1",
           "--monitor-interval=0.2", str(WORKERS / "restart_worker.py")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=torchrun_env())
    assert r.returncode == 0, r.stderr[-4000:]
    assert "attempt 1 ok" in r.stdout
