"""`stoker bench --scenarios` runs the scenarios in the order named: a run cut short (a device call's time
limit, benchmarks/gpu_checks.sh) has measured, and written to its --json, the ones named first."""

import json
import re

import pytest

from stoker.cli import main


@pytest.mark.timeout(300)
def test_scenarios_run_in_the_order_named(tmp_path, capsys):
    doc_path = tmp_path / "bench.json"
    assert main(["bench", "--tiny", "--scenarios", "6,1", "--batches", "2", "--rounds", "1", "--peers", "stoker",
                 "--data", str(tmp_path / "data"), "--json", str(doc_path)]) == 0
    printed = [int(n) for n in re.findall(r"^Scenario (\d+): ", capsys.readouterr().out, re.M)]
    assert printed == [6, 1]
    assert [s["number"] for s in json.loads(doc_path.read_text())["scenarios"]] == [6, 1]
