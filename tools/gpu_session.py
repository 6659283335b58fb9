"""The GPU figures and checks of issue 35 in one command of a lent GPU machine (docs/performance.md, "GPU figures:
`make bench-gpu`"), the most important first, each step with its own time limit and none past --budget-s:

    python3 tools/gpu_session.py --wheels .whl --out "$OUT"     # on the GPU machine, after `make gpu-wheels` here
    .venv/bin/python tools/gpu_session.py --dry-run              # the same steps on this CPU at tiny sizes

Steps: set-up (the carried wheels into a folder on PYTHONPATH), probe (GPU, torch, the package imports), each
attention's kernels timed (docs/measured/attention_backends.py, attention.log), then
the rows of conf/bench/gpu.yaml (`task=bench bench=gpu`, the rows a step names, each row stopped after its
bench.timeout_s): the bf16 training step; inference at 440x1024 in TF32 and bf16; the MCVA step; the inference
row compiled (`runtime.compile=true`: compile_s), then with its decoder alone compiled; the data wait of a
100-step `trainer=gpu` training run; `pytest -m gpu`; every other row of gpu.yaml and the compiled training row. A step past its limit is killed with
its processes and recorded as stopped; the steps after the budget are recorded as not run.

Writes to --out (at most 8 files, what a lent machine sends back): summary.md (each step's status and seconds,
the machine, the data wait, pytest's result line; also printed last), bench.md and bench.json (every bench
step's table and record), pytest.txt, data_wait.log, attention.log, session.log (every other step's output).
Exit status 1 when a step did not end well. --dry-run runs every step on the CPU with the tiny backbone and tiny
sizes (bench.row_overrides), trainer=cpu and the eager compile backend, its limits and budget x DRY_SCALE, so
this machine checks that each command parses and starts and that the files are written.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO_DIR = Path(__file__).resolve().parents[1]
PRESET = REPO_DIR / "conf" / "bench" / "gpu.yaml"
MIN_STEP_S = 3  # a step with less of the budget left is not started
BUDGET_S = 480  # the session's steps within 8 minutes: a lent machine's command runs 10 at most
BENCH_START_S = 30  # a bench step's own start and its rows' configs, beside the rows' limits
PROFILED = "bench.profile_steps=3"  # the first rows' steps under torch.profiler too: where the time goes
DRY_SCALE = 5  # --dry-run: every limit and the budget x this (2 CPU cores at tiny sizes are slower than a GPU)

TINY_ROWS = ["backbone=tiny", "bench.sizes=[[64,96]]", "bench.iters=2", "bench.batch_size=2"]
DRY_BENCH = ["bench.device=cpu", "bench.warmup=1", "bench.repeats=1",
             "bench.row_overrides=[" + ",".join(f"'{override}'" for override in TINY_ROWS) + "]"]
DATA_WAIT = [
    "backbone=flowformer", "trainer=gpu", "data=synthetic", "data.batch_size=8", "data.train.size=[368,496]",
    "trainer.max_steps=100", "logger=csv", "trainer.enable_progress_bar=false",
]
DRY_DATA_WAIT = ["backbone=tiny", "trainer=cpu", "data.batch_size=2", "data.train.size=[64,96]", "trainer.max_steps=3"]
DRY_ATTENTION = ["--device", "cpu", "--backbone", "tiny", "--batch", "1", "--size", "64", "96", "--repeats", "1"]
PROBE = (
    "import torch, hydra, lightning, flowformer.tasks.bench; "
    "print('probe: torch', torch.__version__, 'cuda', torch.version.cuda, 'hydra', hydra.__version__, "
    "'lightning', lightning.__version__, 'gpu', torch.cuda.get_device_name() if torch.cuda.is_available() else None)"
)


@dataclass
class Step:
    """One command of the session: `python <argv>` (`dry` appended with --dry-run), stopped after `limit_s`."""

    name: str
    limit_s: float
    argv: list[str]
    dry: list[str] = field(default_factory=list)
    log: str = "session.log"
    rows: int = 0  # rows bench measures: each gets an equal share of the step's limit as its bench.timeout_s


def bench_step(name: str, rows: list[str], row_limit_s: float, *extra: str) -> Step:
    """`task=bench bench=gpu` with the preset's rows narrowed to `rows` (in the preset's order)."""
    preset = preset_rows()
    others = [f"~bench.rows.{row}" for row in preset if row not in rows]
    argv = ["run.py", "task=bench", "bench=gpu", *others, *extra]
    measured = sum(measured_rows(preset[row]) for row in rows)
    return Step(name, row_limit_s * measured + BENCH_START_S, argv, DRY_BENCH, rows=measured)


def preset_rows() -> dict[str, list[str]]:
    """Each row of conf/bench/gpu.yaml: its overrides."""
    return yaml.safe_load(PRESET.read_text())["rows"]


def measured_rows(overrides: list[str]) -> int:
    """How many rows bench measures for a preset row: its sizes x memory paths x recomputed stages x precisions."""
    lists = ("bench.sizes", "bench.memory_budgets_gb", "bench.activation_checkpoints", "bench.precisions")
    count = 1
    for key, _, value in (override.partition("=") for override in overrides):
        count *= len(yaml.safe_load(value)) if key in lists else 1
    return count


def session_steps() -> list[Step]:
    """The steps, most important first (issue 35's order: training, inference, MCVA, compile, data wait)."""
    train, tf32, bf16, mcva = ("train_b8_368x496_bf16", "inference_440x1024_tf32", "inference_440x1024_bf16",
                               "mcva_b24_368x496_bf16")
    named = {train, tf32, bf16, mcva}
    pytest = ["-m", "pytest", "-m", "gpu", "-v", "-rfE", "--durations=0", "-p", "no:cacheprovider",
              "--continue-on-collection-errors", "tests"]
    return [
        Step("probe", 60, ["-c", PROBE]),
        Step("attention_kernels", 90, ["docs/measured/attention_backends.py"], DRY_ATTENTION, log="attention.log"),
        bench_step("train_bf16", [train], 90, PROFILED),
        bench_step("inference_tf32_bf16", [tf32, bf16], 60, PROFILED),
        bench_step("mcva_bf16", [mcva], 120, PROFILED),
        bench_step("compile_inference", [tf32], 150, "runtime.compile=true"),
        bench_step("compile_inference_decoder", [tf32], 120, "runtime.compile=true",
                   "runtime.compile_regions=[decoder]"),
        Step("data_wait", 150, ["run.py", *DATA_WAIT], DRY_DATA_WAIT, log="data_wait.log"),
        Step("pytest_gpu", 360, pytest, log="pytest.txt"),  # 13 tests; of the first 9, 5 took 218 s and 4 85 s on an H200
        bench_step("other_rows", [row for row in preset_rows() if row not in named], 60),
        bench_step("compile_train", [train], 150, "runtime.compile=true"),
    ]


def run_step(step: Step, argv: list[str], limit_s: float, log: Path, env: dict) -> tuple[str, float]:
    """Runs `python <argv>` in its own process group, output appended to `log`; (status, seconds)."""
    start = time.monotonic()
    with log.open("a") as output:
        output.write(f"\n===== {step.name}: {' '.join(argv)} (limit {limit_s:.0f} s)\n")
        output.flush()
        process = subprocess.Popen(
            [sys.executable, *argv], cwd=REPO_DIR, env=env, stdout=output, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code = process.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the step and every process it started (bench rows)
            process.wait()
            return f"stopped after {limit_s:.0f} s", time.monotonic() - start
    return ("ok" if code == 0 else f"exit status {code}"), time.monotonic() - start


def install_wheels(wheels: Path, site: Path, log: Path) -> tuple[str, float]:
    """The carried wheels into `site` (no index: the lent machine reaches no registry)."""
    argv = ["-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir", "--upgrade",
            "--target", str(site), *map(str, sorted(wheels.glob("*.whl")))]
    return run_step(Step("setup", 120, argv), argv, 120, log, dict(os.environ))


def step_argv(step: Step, work: Path, dry: bool, limit_s: float, scale: int) -> list[str]:
    """The step's command: its run directory, its rows' time limits, and in a dry run its tiny settings."""
    argv = list(step.argv)
    if argv[0] == "run.py":
        argv.append(f"hydra.run.dir={work / step.name}")
    if step.rows:
        argv.append(f"bench.timeout_s={max(1, int((limit_s - BENCH_START_S * scale) / step.rows))}")
    if dry:
        argv += step.dry + (["runtime.compile_backend=eager"] if "runtime.compile=true" in argv else [])
    return argv


def bench_outputs(results: list[dict], work: Path, out: Path) -> None:
    """bench.md (each bench step's table under its name) and bench.json (each step's record) in `out`."""
    tables, records = [], []
    for result in (result for result in results if result["bench"]):
        folder = work / result["step"]
        found = (folder / "bench.json").exists()
        tables.append(f"## {result['step']}: {result['status']}, {result['seconds']:.0f} s\n\n"
                      + ((folder / "bench.md").read_text() if found else "no table\n"))
        records.append(result | {"record": json.loads((folder / "bench.json").read_text()) if found else None})
    (out / "bench.md").write_text("\n".join(tables))
    (out / "bench.json").write_text(json.dumps(records, indent=2))


def last_line_with(path: Path, *fragments: str) -> str:
    """The last line of `path` holding every fragment, or "-"."""
    text = path.read_text() if path.exists() else ""
    lines = [line for line in text.splitlines() if all(fragment in line for fragment in fragments)]
    return lines[-1].split("] - ")[-1].strip() if lines else "-"  # without a log line's time and logger


def write_summary(results: list[dict], out: Path, dry: bool) -> str:
    lines = [f"# GPU session{' (dry run on the CPU, tiny sizes)' if dry else ''}", "",
             "| step | status | seconds | limit s |", "|---|---|---|---|"]
    lines += [f"| {r['step']} | {r['status']} | {r['seconds']:.0f} | {r['limit_s']:.0f} |" for r in results]
    lines += ["", f"machine: {last_line_with(out / 'session.log', 'probe: torch ')}",
              f"data wait: {last_line_with(out / 'data_wait.log', 'data wait:').removeprefix('data wait: ')}",
              f"pytest -m gpu: {last_line_with(out / 'pytest.txt', '==', ' in ')}"]
    summary = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(summary)
    return summary


def record(result: dict, results: list[dict], work: Path, out: Path, dry: bool) -> str:
    """Adds a step's result and rewrites the files in `out` (what comes back if the command is cut short);
    prints the step's line at once; the summary."""
    results.append(result)
    print(f"{result['step']}: {result['status']}, {result['seconds']:.0f} s", flush=True)
    bench_outputs(results, work, out)
    return write_summary(results, out, dry)


def run_session(args: argparse.Namespace) -> int:
    started = time.monotonic()
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    out = Path(args.out or REPO_DIR / "logs" / "gpu_session" / stamp).resolve()
    work = REPO_DIR / "logs" / "gpu_session" / f"runs_{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_MODE="offline")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_DIR), env.get("PYTHONPATH")]))
    results: list[dict] = []
    if args.wheels:
        status, seconds = install_wheels(Path(args.wheels).resolve(), Path(args.site), out / "session.log")
        setup = {"step": "setup", "status": status, "seconds": seconds, "limit_s": 120, "bench": False}
        summary = record(setup, results, work, out, args.dry_run)
        env["PYTHONPATH"] = os.pathsep.join([args.site, env["PYTHONPATH"]])
    scale = DRY_SCALE if args.dry_run else 1
    budget_s = args.budget_s or BUDGET_S * scale
    for step in (step for step in session_steps() if not args.steps or step.name in args.steps):
        limit_s = min(step.limit_s * scale, budget_s - (time.monotonic() - started))
        result = {"step": step.name, "status": "not run: session budget spent", "seconds": 0.0,
                  "limit_s": step.limit_s * scale, "bench": step.rows > 0}
        if limit_s >= MIN_STEP_S:
            argv = step_argv(step, work, args.dry_run, limit_s, scale)
            status, seconds = run_step(step, argv, limit_s, out / step.log, env)
            result |= {"status": status, "seconds": seconds, "limit_s": limit_s, "command": " ".join(argv)}
        summary = record(result, results, work, out, args.dry_run)
    print(f"\n{summary}\n{(out / 'bench.md').read_text()}\nwrote {out}")
    return 0 if all(result["status"] == "ok" for result in results) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="where the files go (default logs/gpu_session/<time>/)")
    parser.add_argument("--wheels", help="a folder of wheels to install first (make gpu-wheels: .whl)")
    parser.add_argument("--site", default="/tmp/gpu_session_site", help="where --wheels are installed")
    parser.add_argument("--budget-s", type=float, help=f"no step runs past this many seconds (default {BUDGET_S})")
    parser.add_argument("--steps", nargs="+", help="only these steps, by name (default: all, in order)")
    parser.add_argument("--dry-run", action="store_true", help="every step on the CPU at tiny sizes")
    args = parser.parse_args()
    known = {step.name for step in session_steps()}
    unknown = sorted(set(args.steps or []) - known)
    if unknown:
        print(f"--steps: {', '.join(unknown)} unknown; expected some of {', '.join(sorted(known))}", file=sys.stderr)
        return 1
    return run_session(args)


if __name__ == "__main__":
    sys.exit(main())
