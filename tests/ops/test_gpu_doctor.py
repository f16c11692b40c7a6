"""`python -m glm5_dsa_plugin doctor` on a GPU: its kernel-vs-reference self-check runs and passes."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu


def test_doctor_self_check_passes():
    r = subprocess.run([sys.executable, "-m", "glm5_dsa_plugin", "doctor"], capture_output=True, text=True,
                       timeout=600)
    assert "backend='auto' picks   tilelang" in r.stdout, r.stdout + r.stderr[-2000:]
    assert "self-check             PASS" in r.stdout, r.stdout + r.stderr[-2000:]
    assert r.returncode == 0, r.stdout
