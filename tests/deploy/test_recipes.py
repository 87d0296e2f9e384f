"""The deploy/ recipes: the local one runs end to end; the others parse and carry what makes them work."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
yaml = pytest.importorskip("yaml")


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def test_every_shell_script_passes_bash_n():
    scripts = [*DEPLOY.rglob("*.sh"), *DEPLOY.rglob("*.sbatch")]
    assert {p.name for p in scripts} >= {"run.sh", "train.sbatch"}
    for script in scripts:
        out = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert out.returncode == 0, f"{script}: {out.stderr}"


def test_every_yaml_file_parses():
    files = [*DEPLOY.rglob("*.yml"), *DEPLOY.rglob("*.yaml")]
    assert len(files) >= 2
    for path in files:
        documents = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert documents, path


def test_compose_has_minio_a_bucket_and_a_trainer_with_health_checks():
    compose = yaml.safe_load((DEPLOY / "compose" / "docker-compose.yml").read_text())
    services = compose["services"]
    minio, bucket, trainer = services["minio"], services["create-bucket"], services["trainer"]
    assert minio["image"].startswith("minio/minio:") and minio["command"][:2] == ["server", "/data"]
    assert any(v.endswith(":/data") for v in minio["volumes"]) and "minio-data" in compose["volumes"]
    assert minio["healthcheck"]["test"][0] in ("CMD", "CMD-SHELL")
    assert bucket["depends_on"]["minio"]["condition"] == "service_healthy"
    assert "mc mb" in " ".join(bucket["command"])
    bucket_name = re.search(r"mc mb \S* ?local/(\S+)", " ".join(bucket["command"])).group(1)
    env = trainer["environment"]
    assert env["CKPTD_CHECKPOINT_URL"].startswith(f"s3://{bucket_name}/")
    assert '"endpoint_url": "http://minio:9000"' in env["CKPTD_STORAGE_OPTIONS"]
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(env)
    assert trainer["depends_on"]["create-bucket"]["condition"] == "service_completed_successfully"
    assert trainer["command"][0] == "torchrun" and "/app/deploy/local/train.py" in trainer["command"]
    assert trainer["build"]["dockerfile"] == "deploy/compose/Dockerfile"
    assert trainer["healthcheck"]["test"][0] == "CMD" and "heartbeat" in trainer["healthcheck"]["test"][-1]
    assert env["TRAIN_HEARTBEAT"] == "/tmp/heartbeat" and trainer["shm_size"]
    assert trainer["stop_signal"] == "SIGTERM" and trainer["stop_grace_period"]
    dockerfile = (DEPLOY / "compose" / "Dockerfile").read_text()
    assert "download.pytorch.org/whl/cpu" in dockerfile and '".[s3]"' in dockerfile
    assert "COPY deploy/local/train.py ./deploy/local/train.py" in dockerfile


def test_kubernetes_job_has_rendezvous_secret_configmap_and_grace_period():
    documents = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "ckptd-train.yaml").read_text()))
    by_kind = {d["kind"]: d for d in documents}
    assert set(by_kind) >= {"Secret", "ConfigMap", "Service", "Job"}
    secret, config, service, job = (by_kind[k] for k in ("Secret", "ConfigMap", "Service", "Job"))
    assert set(secret["stringData"]) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    settings = config["data"]
    assert settings["CKPTD_CHECKPOINT_URL"].startswith("s3://")
    assert all(isinstance(v, str) for v in settings.values())  # ConfigMap values must be strings
    assert {k for k in settings if k.startswith("CKPTD_")} >= {"CKPTD_CHECKPOINT_URL", "CKPTD_STORAGE_OPTIONS"}
    assert service["spec"]["clusterIP"] == "None"
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 2
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    assert pod["terminationGracePeriodSeconds"] >= 120
    (container,) = pod["containers"]
    command = container["command"]
    assert command[0] == "torchrun" and "--rdzv_backend=c10d" in command
    endpoint = next(a for a in command if a.startswith("--rdzv_endpoint="))
    assert endpoint == f"--rdzv_endpoint={job['metadata']['name']}-0.{service['metadata']['name']}:29400"
    assert f"--nnodes={spec['completions']}" in command and command[-1].endswith("train.py")
    refs = {next(iter(ref)): ref[next(iter(ref))]["name"] for ref in container["envFrom"]}
    assert refs == {"configMapRef": config["metadata"]["name"], "secretRef": secret["metadata"]["name"]}
    assert "SIGTERM" in " ".join(container["lifecycle"]["preStop"]["exec"]["command"])
    assert container["image"] and container["volumeMounts"][0]["mountPath"] == "/dev/shm"
    assert pod["volumes"][0]["emptyDir"]["medium"] == "Memory"


def test_slurm_script_requeues_and_saves_on_sigterm():
    text = (DEPLOY / "slurm" / "train.sbatch").read_text()
    directives = re.findall(r"^#SBATCH (\S+)", text, re.MULTILINE)
    assert "--signal=B:TERM@120" in directives and "--requeue" in directives
    assert any(d.startswith("--nodes=") for d in directives)
    assert "trap on_term TERM" in text and "scontrol requeue" in text
    assert re.search(r"srun .*bash -c", text) and "torchrun" in text
    assert '--rdzv_endpoint="${HEAD_NODE}:29500"' in text and "scontrol show hostnames" in text
    assert "pkill -TERM -f" in text


def test_readme_mentions_every_recipe():
    readme = (DEPLOY / "README.md").read_text()
    for name in ("local/run.sh", "compose", "kubernetes", "slurm"):
        assert name in readme


def _port_open(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(0.5)
        return probe.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.slow
@pytest.mark.objectstore
@pytest.mark.multiprocess
def test_local_recipe_runs_end_to_end():
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    started = time.monotonic()
    out = subprocess.run(
        ["bash", str(DEPLOY / "local" / "run.sh")],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(PYTHON=sys.executable, STEPS="4"),
    )
    elapsed = time.monotonic() - started
    assert out.returncode == 0, out.stdout + out.stderr
    assert "[rank 0/2] starting from scratch" in out.stdout
    assert "[rank 0/2] resuming from step 4" in out.stdout
    assert "committed steps [6, 8]" in out.stdout or "committed steps [3, 4, 6, 8]" in out.stdout
    assert "OK: " in out.stdout and "sizes and CRC32C match" in out.stdout
    port = int(re.search(r"on http://127\.0\.0\.1:(\d+)", out.stdout).group(1))
    assert not _port_open(port), "the S3 server outlived the recipe"
    assert elapsed < 240, f"took {elapsed:.0f} s"


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.distributed
def test_train_saves_and_exits_on_sigterm(tmp_path):
    """What the Slurm/Kubernetes recipes rely on: SIGTERM to the trainers -> a final save -> exit 0."""
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
    root = str(tmp_path / "runs")
    process = subprocess.Popen(
        [
            torchrun,
            "--standalone",
            "--nproc_per_node=2",
            str(DEPLOY / "local" / "train.py"),
            "--url",
            root,
            "--steps",
            "100000",
            "--save-every",
            "1000",
            "--step-seconds",
            "0.05",
            "--heartbeat",
            str(tmp_path / "beat"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(OMP_NUM_THREADS="1"),
    )
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "beat").exists():
            assert time.monotonic() < deadline and process.poll() is None, "training did not start"
            time.sleep(0.2)
        time.sleep(1.0)
        trainers = [
            int(pid)
            for pid in os.listdir("/proc")
            if pid.isdigit() and "train.py" in _cmdline(pid) and _parent(pid) == process.pid
        ]
        assert len(trainers) == 2, trainers
        for pid in trainers:
            os.kill(pid, signal.SIGTERM)
        output, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output
    saved = re.search(r"SIGTERM: saved step (\d+)", output)
    assert saved, output
    import ckptd

    with ckptd.Checkpointer(root) as ckpt:
        assert ckpt.steps() == [int(saved.group(1))]
        assert ckpt.load("latest")["progress"]["step"] == int(saved.group(1))


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _parent(pid: str) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(") ", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1
