"""A test run leaves nothing in the user's home: every cache it fills (the target, airflow, matplotlib, compiled
kernels, inductor, triton, Hugging Face) lives inside the clone."""
import os
import subprocess
import sys
from pathlib import Path

from conftest import CACHES

ROOT = Path(__file__).resolve().parents[1]
# tests that plot, load the DAG, build the CPU kernel and read configs: what would fill ~/.cache and ~/airflow
SAMPLE = ["tests/export/test_layer_map.py::test_plot_writes_a_png", "tests/dags/test_dags.py::test_dag_graph",
          "tests/kernels/test_cpu_gemm.py::test_serves_only_what_it_can_multiply", "tests/pipeline/test_config.py"]


def test_a_plain_pytest_run_writes_nothing_into_home(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in CACHES} | {"HOME": str(home)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SAMPLE], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert sorted(str(p.relative_to(home)) for p in home.rglob("*")) == []
