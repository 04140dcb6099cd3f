"""The job's arguments checked once before torchrun starts workers (``launch/multinode.sh``
runs ``python -m fbtriton_dist.train.precheck``): a config error or a run folder holding
another run is said once, exit 2, as one process says it; nothing imports torch."""

import subprocess
import sys

from fbtriton_dist.train.config import precheck
from tests.train.test_job import write_job
from tests.train.test_multirank import ROOT


def test_precheck_says_a_config_error_once_with_exit_2(tmp_path, capsys):
    path = write_job(tmp_path)
    assert precheck(["--config", str(path)]) == 0
    assert precheck(["--config", str(path), "train.batch_size=-1"]) == 2
    err = capsys.readouterr().err
    assert err.count("train: error:") == 1 and "train.batch_size: expected an integer >= 1" in err


def test_precheck_refuses_a_folder_holding_another_run(tmp_path, capsys):
    path = write_job(tmp_path)
    run = tmp_path / "tiny"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"kind": "train"}\n')
    assert precheck(["--config", str(path)]) == 2
    assert f"run_dir {run} holds another run (metrics.jsonl)" in capsys.readouterr().err
    assert precheck(["--config", str(path), "--resume"]) == 0
    assert precheck(["--config", str(path), "--overwrite"]) == 0


def test_multinode_script_stops_before_torchrun_on_a_bad_config(tmp_path):
    path = write_job(tmp_path)
    done = subprocess.run(["bash", f"{ROOT}/launch/multinode.sh", str(path),
                           "train.batch_size=-1"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count("train: error:") == 1 and "Traceback" not in done.stderr


def test_precheck_does_not_import_torch(tmp_path):
    path = write_job(tmp_path)
    code = ("import sys; from fbtriton_dist.train.config import precheck; "
            f"rc = precheck(['--config', {str(path)!r}]); "
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
