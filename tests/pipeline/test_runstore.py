import signal
import subprocess
import sys
import textwrap

import pytest

from pipeline.runstore import RunStore, StageResult


def _write(out, text="x"):
    (out / "data.txt").write_text(text)
    return StageResult(outputs={"data": "data.txt"}, metrics={"n": len(text)})


def test_completed_stage_has_record(tmp_path):
    store = RunStore(tmp_path, "r1")
    rec = store.run_stage("prepare", "d1", _write)
    assert rec["status"] == "completed" and store.record("prepare")["inputs_digest"] == "d1"
    assert (store.stage_dir("prepare") / "data.txt").read_text() == "x"
    assert store.is_current("prepare", "d1") and not store.is_current("prepare", "d2")


def test_exception_leaves_no_output_and_keeps_old(tmp_path):
    store = RunStore(tmp_path, "r1")
    store.run_stage("prepare", "d1", _write)

    def boom(out):
        (out / "data.txt").write_text("half")
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError):
        store.run_stage("prepare", "d2", boom)
    assert (store.stage_dir("prepare") / "data.txt").read_text() == "x"  # old output intact
    assert store.last_error("prepare")["error"].endswith("disk on fire")
    assert "in boom" in store.last_error("prepare")["traceback"]
    assert not list(store.dir.glob(".tmp-*"))


def test_killed_mid_write_leaves_no_completed_output(tmp_path):
    script = textwrap.dedent(f"""
        import os, signal
        from pipeline.runstore import RunStore
        def half(out):
            (out / "data.txt").write_text("half written")
            os.kill(os.getpid(), signal.SIGKILL)
        RunStore({str(tmp_path)!r}, "r1").run_stage("prepare", "d1", half)
    """)
    proc = subprocess.run([sys.executable, "-c", script])
    assert proc.returncode == -signal.SIGKILL
    store = RunStore(tmp_path, "r1")
    assert store.record("prepare") is None and not store.stage_dir("prepare").exists()
    assert list(store.dir.glob(".tmp-prepare-*"))  # the debris is there, but under a name no reader uses
    store.run_stage("prepare", "d1", _write)  # a rerun cleans it and completes
    assert store.record("prepare")["status"] == "completed"
    assert not list(store.dir.glob(".tmp-prepare-*"))


@pytest.mark.parametrize("bad", ["", "../x", ".hidden", "a/b"])
def test_bad_run_id(tmp_path, bad):
    from pipeline.errors import DraftsmithError

    with pytest.raises(DraftsmithError, match="run id"):
        RunStore(tmp_path, bad)
