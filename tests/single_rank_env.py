"""The environment of a one-rank torch.distributed child process that imports this checkout."""

import os
import socket
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_rank_env(**extra: str) -> dict:
    """os.environ plus rank 0 of 1 on a free local port, the checkout and tests/ first on PYTHONPATH."""
    return dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(free_port()),
                PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
                **extra)
