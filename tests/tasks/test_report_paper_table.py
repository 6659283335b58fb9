"""task=report is the paper's table: each job in the row of the table it ran (labelled as the paper labels it,
matched on the overrides that define the row whatever setup overrides the machine needed, those listed beside
it), the rows no job ran listed as missing, a failed job as failed; report.png the paper's training-curve
figure over several run directories. Real tiny training runs from a fresh checkout, no hydra.sweep.dir."""

import csv

import pytest
import yaml

from flowformer.tasks import report

from helpers.run import fresh_checkout, run_py

TINY = ["debug=tiny", "trainer.max_steps=2", "trainer.val_check_interval=1"]
# A table of the tiny network's AGT depth as the paper writes its tables (conf/paper/<table>.yaml): each row's
# overrides include a batch of 8, which the runs below do not use (data.batch_size is a setup override).
TABLE = {
    "title": "AGT depth",
    "caption": "The tiny network with one to three AGT layers.",
    "training": "2 steps on synthetic pairs",
    "rows": {
        "one": {
            "label": "AGT x1",
            "overrides": ["backbone.agt_depth=1", "data.batch_size=8"],
            "published": {"synthetic/epe": 5.0},
        },
        "two": {
            "label": "AGT x2",
            "overrides": ["backbone.agt_depth=2", "data.batch_size=8"],
            "published": {"synthetic/epe": 4.0},
        },
        "three": {
            "label": "AGT x3",
            "overrides": ["backbone.agt_depth=3"],
            "published": {"synthetic/epe": 3.0},
        },
    },
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A sweep of depths 1, 2 and -1 (which fails) with data.batch_size=1, a single run of depth 2 with another
    gamma, and the table in its own tables folder: (checkout, sweep dir, run dir, tables dir)."""
    checkout = fresh_checkout(tmp_path_factory.mktemp("checkout"))
    result = run_py(
        "-m", *TINY, "backbone.agt_depth=1,2,-1", "data.batch_size=1", cwd=checkout, expect_ok=False
    )
    assert result.returncode == 1, result.stderr[-3000:]  # the sweep names its failed job
    run_py(*TINY, "backbone.agt_depth=2", "model.gamma=0.5", cwd=checkout)
    [sweep] = (checkout / "logs" / "train" / "default" / "multiruns").iterdir()
    [run] = (checkout / "logs" / "train" / "default" / "runs").iterdir()
    tables = tmp_path_factory.mktemp("tables")
    (tables / "agt.yaml").write_text(yaml.safe_dump(TABLE))
    return checkout, sweep, run, tables


def test_the_report_is_the_papers_table_with_setup_overrides_beside_and_missing_rows(runs, tmp_path):
    checkout, sweep, run, tables = runs
    result = run_py(
        "task=report",
        f"report.runs=[{sweep},{run}]",
        f"report.tables_dir={tables}",
        "report.table=agt",
        f"report.output_dir={tmp_path}",
        cwd=checkout,
    )
    assert "report: 4 jobs of the 4 launched: 3 done, 1 failed, 1 missing" in result.stdout
    with (tmp_path / "report.csv").open(newline="") as file:
        rows = list(csv.DictReader(file))
    assert [(row["row"], row["status"]) for row in rows] == [
        ("AGT x1", "done"),
        ("AGT x2", "done"),
        ("backbone.agt_depth=-1,data.batch_size=1", "failed"),
        ("AGT x2", "done"),
        ("AGT x3", "missing"),
    ]
    for row, published in zip(rows[:2], [5.0, 4.0], strict=True):  # matched although run with a batch of 1
        assert float(row["synthetic/epe paper"]) == published
        assert float(row["synthetic/epe diff"]) == pytest.approx(float(row["synthetic/epe"]) - published)
        assert row["other_overrides"] == " ".join([*TINY, "data.batch_size=1"])
    assert rows[3]["other_overrides"] == " ".join([*TINY, "model.gamma=0.5"])
    assert rows[4]["synthetic/epe"] == "" and rows[4]["synthetic/epe paper"] == "3.0"
    markdown = (tmp_path / "report.md").read_text()
    assert "| row | job | status | synthetic/epe |" in markdown
    assert "| Params (M) | other overrides | train h:mm:ss |" in markdown
    assert "| AGT x3 |  | missing | - / 3.00 |" in markdown
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_figure_is_the_training_curves_of_every_row_failed_ones_named(runs):
    """report.png's panels: the training loss and the validation AEPE against the step, a line per job named
    by its row, the failed job in the legend, the y axis without an offset."""
    _, sweep, run, tables = runs
    jobs = [*report.read_jobs(sweep), *report.read_jobs(run)]
    table = report.load_table(tables, "agt", explicit=True)
    figure = report.draw_curves(jobs, report.curve_labels(jobs, table))
    axes = {axis.get_title(): axis for axis in figure.axes}
    assert sorted(axes) == ["training loss", "validation AEPE, synthetic"]
    for axis in axes.values():
        legend = [text.get_text() for text in axis.get_legend().get_texts()]
        assert legend == [
            "AGT x1",
            "AGT x2 [backbone.agt_depth=2,data.batch_size=1]",
            "backbone.agt_depth=-1,data.batch_size=1 (failed)",
            "AGT x2 [backbone.agt_depth=2,model.gamma=0.5]",
        ]
        assert all(len(line.get_xdata()) == 2 for line in axis.get_lines()[:2])  # steps 0 and 1
        assert not axis.yaxis.get_major_formatter().get_useOffset()
    assert axes["validation AEPE, synthetic"].get_ylabel() == "validation AEPE"
