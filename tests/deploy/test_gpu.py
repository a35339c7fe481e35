"""The GPU verifier's deployment: the chart's GPU values, the Compose GPU override and the GPU image.

- the chart: with ``verifier.gpu.enabled``, one GPU per verifier pod (``nvidia.com/gpu`` limit), the GPU image,
  the backend ``verifier.gpu.backend`` (cuda by default; ONNX Runtime's CUDA provider as an option) on
  ``verifier.gpu.device``, the cuda backend's batch buckets, require_gpu, the GPU toleration and node selector,
  rolls without a spare GPU; nothing of it without the GPU; the values schema refuses what the verifier would;
- every variable the Compose files set for a service is a real setting that parses (Compose's default backend
  was once a name the verifier refused at start);
- ``docker-compose config`` of the GPU override: the GPU image on the cuda backend, a GPU reserved;
- docker/Dockerfile.gpu: the official CUDA PyTorch runtime image of the project's torch version, whose torch the
  build keeps (SpecRec's other dependencies in a virtual environment over it, the CPU torch's pin left out, a
  check that torch is unchanged and has CUDA), onnxruntime-gpu only on request.

Rendering and validation against the Kubernetes schemas (every ``ci/*-values.yaml``, the GPU ones included) is
tests/deploy/test_deploy.py's.
"""

from __future__ import annotations

import json
import os
import re
import tomllib

import pytest
import yaml

from .test_deploy import (
    CHART,
    ROOT,
    ci,
    compose_config,
    container,
    dockerfile_stages,
    env_of,
    named,
    of_kind,
    render,
    run,
)

GPU_VALUES = ("gpu-verifier", "gpu-onnx", "all-features")


def _verifier(helm, values, *sets):
    dep = named(render(helm, values, *sets), "Deployment", "verifier")
    return dep, container(dep)


def _settings(env: dict):
    """The verifier's settings from a container's SPECREC_VERIFIER_* variables (as the service reads them)."""
    from verifier_svc.service import VerifierSettings

    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("SPECREC_")}
    try:
        os.environ.update({k: str(v) for k, v in env.items() if k.startswith("SPECREC_VERIFIER_")})
        return VerifierSettings()
    finally:
        for k in [k for k in os.environ if k.startswith("SPECREC_")]:
            del os.environ[k]
        os.environ.update(saved)


@pytest.mark.parametrize("name", GPU_VALUES)
def test_gpu_values_give_each_verifier_pod_one_gpu_and_the_gpu_image(helm, name):
    dep, c = _verifier(helm, ci(name))
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1, name  # one GPU per pod: one process uses one
    assert "nvidia.com/gpu" not in c["resources"].get("requests", {})  # (extended resources: the limit is the request)
    assert "-gpu" in c["image"], c["image"]
    pod = dep["spec"]["template"]["spec"]
    assert any(t.get("key") == "nvidia.com/gpu" for t in pod.get("tolerations", [])), name
    # a roll never needs a spare GPU: the old pod goes first
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    s = _settings(env_of(c))
    assert s.require_gpu, name  # the verifier refuses to serve on the CPU when it was given a GPU
    assert s.device == "cuda"
    # only the verifier ever gets a GPU
    for other in of_kind(render(helm, ci(name)), "Deployment"):
        if other["metadata"]["labels"]["app.kubernetes.io/component"] != "verifier":
            assert "nvidia.com/gpu" not in yaml.safe_dump(other)


def test_the_gpu_verifier_runs_the_cuda_backend_by_default(helm):
    values = yaml.safe_load((CHART / "values.yaml").read_text())["verifier"]["gpu"]
    assert (values["backend"], values["device"]) == ("cuda", "cuda")
    for name in ("gpu-verifier", "all-features"):
        env = env_of(_verifier(helm, ci(name))[1])
        s = _settings(env)
        assert (s.backend, s.device) == ("cuda", "cuda"), name
        assert s.cuda_graph_batch_sizes == [1, 2, 4, 8, 16, 32, 64]
    env = env_of(_verifier(helm, ci("gpu-verifier"))[1])
    assert _settings(env).hang_s == 5.0
    assert json.loads(env["SPECREC_VERIFIER_CUDA_GRAPH_BATCH_SIZES"]) == [1, 2, 4, 8, 16, 32, 64]
    # the buckets and the device follow the values
    env = env_of(_verifier(helm, None, "verifier.gpu.enabled=true", "verifier.gpu.device=cuda:1",
                           "verifier.gpu.cudaGraphBatchSizes={1,4,16}")[1])
    s = _settings(env)
    assert (s.backend, s.device, s.cuda_graph_batch_sizes) == ("cuda", "cuda:1", [1, 4, 16])


def test_onnx_runtimes_cuda_provider_stays_an_option(helm):
    dep, c = _verifier(helm, ci("gpu-onnx"))
    env = env_of(c)
    s = _settings(env)
    assert (s.backend, s.require_gpu) == ("onnx", True)
    assert "SPECREC_VERIFIER_CUDA_GRAPH_BATCH_SIZES" not in env  # (the cuda backend's alone)
    assert c["image"] == "registry.example.com/specrec:0.3.0-gpu-ort"
    assert "nodeSelector" not in dep["spec"]["template"]["spec"]  # the GPU limit alone places the pod


def test_without_a_gpu_nothing_of_it_renders(helm):
    for name in ("default", "cpu-only", "external-redis", "minimal"):
        text = yaml.safe_dump_all(render(helm, ci(name)))
        assert "nvidia.com/gpu" not in text, f"{name}: renders a GPU resource or toleration"
        dep, c = _verifier(helm, ci(name))
        assert "-gpu" not in c["image"]
        assert "runtimeClassName" not in dep["spec"]["template"]["spec"]
        s = _settings(env_of(c))
        assert (s.backend, s.device, s.require_gpu) == ("onnx", "cpu", False), name  # ONNX Runtime: the CPU's path
        assert "SPECREC_VERIFIER_CUDA_GRAPH_BATCH_SIZES" not in env_of(c)
        # a CPU verifier surges as the other components do
        assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}, name
    # GPU node selector: given in gpu-verifier; the default ({}) adds none (the GPU limit places the pod)
    assert _verifier(helm, ci("gpu-verifier"))[0]["spec"]["template"]["spec"]["nodeSelector"] == {
        "nvidia.com/gpu.present": "true"}
    assert "nodeSelector" not in _verifier(helm, ci("all-features"))[0]["spec"]["template"]["spec"]


def test_verifier_require_gpu_follows_gpu_values(helm):
    def require(*sets):
        return env_of(_verifier(helm, None, *sets)[1])["SPECREC_VERIFIER_REQUIRE_GPU"]

    assert require() == "false"
    assert require("verifier.gpu.enabled=true") == "true"  # required defaults to true
    assert require("verifier.gpu.enabled=true", "verifier.gpu.required=false") == "false"
    assert require("verifier.gpu.enabled=false", "verifier.gpu.required=true") == "false"


def test_values_schema_refuses_what_the_verifier_would(helm):
    for bad in ("verifier.gpu.backend=tensorrt", "verifier.gpu.device=gpu", "verifier.gpu.device=cpu",
                "verifier.gpu.cudaGraphBatchSizes={0,1}", "verifier.backend=cuda", "verifier.hangS=-1"):
        p = run([helm, "lint", "--strict", str(CHART), "--set", "verifier.gpu.enabled=true", "--set", bad])
        assert p.returncode != 0, f"--set {bad} passed lint"
    p = run([helm, "lint", "--strict", str(CHART), "--set", "verifier.gpu.enabled=true",
             "--set", "verifier.gpu.backend=eager", "--set", "verifier.gpu.device=cuda:0"])
    assert p.returncode == 0, p.stdout + p.stderr


# ------------------------------------------------------------------ compose

def _compose_settings(env: dict, service: str):
    from drafter_svc.service import DrafterSettings
    from gateway.settings import GatewaySettings
    from itemset_svc.settings import ItemSetSettings
    from verifier_svc.service import VerifierSettings

    cls = {"itemset": ItemSetSettings, "drafter": DrafterSettings, "verifier": VerifierSettings,
           "gateway": GatewaySettings}[service]
    prefix = f"SPECREC_{service.upper()}_"
    unknown = [k for k in env if k.startswith(prefix) and k[len(prefix):].lower() not in cls.model_fields]
    # a variable without a value (`NAME:`) passes the shell's through: unset there, unset in the container
    ours = {k: str(v) for k, v in env.items() if k.startswith(prefix) and v is not None}
    assert not unknown, f"{service}: variables no setting reads: {unknown}"
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("SPECREC_")}
    try:
        os.environ.update(ours)
        return cls()
    finally:
        for k in [k for k in os.environ if k.startswith("SPECREC_")]:
            del os.environ[k]
        os.environ.update(saved)


@pytest.mark.parametrize("files", [("docker-compose.yml",), ("docker-compose.yml", "docker-compose.gpu.yml")],
                         ids=["cpu", "gpu"])
def test_compose_variables_are_real_settings_and_parse(compose, files):
    s = compose_config(compose, *files)["services"]
    for service in ("itemset", "drafter", "verifier", "gateway"):
        _compose_settings(s[service]["environment"], service)


def test_compose_gpu_override(compose):
    s = compose_config(compose, "docker-compose.yml", "docker-compose.gpu.yml")["services"]
    v = s["verifier"]
    settings = _compose_settings(v["environment"], "verifier")
    assert (settings.backend, settings.device, settings.require_gpu) == ("cuda", "cuda", True)
    assert v["build"]["dockerfile"] == "docker/Dockerfile.gpu" and v["image"].endswith("-gpu")
    (dev,) = v["deploy"]["resources"]["reservations"]["devices"]
    assert dev["driver"] == "nvidia" and "gpu" in dev["capabilities"] and int(dev["count"]) == 1
    assert v["healthcheck"]["test"][-1] == "127.0.0.1:50053"
    for other in ("itemset", "drafter", "gateway", "catalogue-loader"):
        assert "deploy" not in s[other] and s[other]["build"]["dockerfile"] == "docker/Dockerfile"
    # ONNX Runtime's CUDA provider by a variable
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPECREC_", "COMPOSE_"))}
    p = run([*compose, "-f", str(ROOT / "docker-compose.yml"), "-f", str(ROOT / "docker-compose.gpu.yml"), "config"],
            cwd=ROOT, env={**env, "SPECREC_GPU_VERIFIER_BACKEND": "onnx"})
    assert p.returncode == 0, p.stderr
    assert yaml.safe_load(p.stdout)["services"]["verifier"]["environment"]["SPECREC_VERIFIER_BACKEND"] == "onnx"


# ------------------------------------------------------------------ the GPU image

def test_gpu_image_is_cuda_torch_and_keeps_its_torch():
    path = ROOT / "docker" / "Dockerfile.gpu"
    text = path.read_text()
    args, froms = dockerfile_stages(path)
    from packaging.requirements import Requirement

    # the torch versions the project admits (pyproject: a range, so a machine with a torch keeps it), and the one
    # it runs in CI and the CPU image (docker/constraints.txt's CPU build)
    admitted = next(r.specifier for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
                    if (r := Requirement(d)).name == "torch")
    tested = re.search(r"^torch==(\d+\.\d+\.\d+)\+cpu$", (ROOT / "docker" / "constraints.txt").read_text(), re.M)
    assert tested, "docker/constraints.txt pins no CPU torch"
    for image in froms:  # both stages: the official CUDA runtime image of the project's torch
        m = re.fullmatch(r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda(\d+)\.\d+-cudnn\d+-runtime", image)
        assert m, image
        assert m.group(1) == tested.group(1) and m.group(1) in admitted, (image, tested.group(1), admitted)
        assert tuple(map(int, m.group(1).split("."))) >= (2, 11, 0)
    # torch is never installed: the base image's is kept (a venv over it; the CPU torch's pin left out)
    assert not re.search(r"pip install[^\n]*\btorch\b", text), "the GPU image installs a torch over the base image's"
    assert "python -m venv --system-site-packages /opt/venv" in text
    assert "grep -v -i '^torch==' /tmp/constraints.all.txt > /tmp/constraints.txt" in text
    assert "assert torch.version.cuda and torch.__version__ == open('/tmp/torch-version')" in text
    assert "sys.version_info[:2] == (3, 11)" in text  # the Python docker/constraints.txt is resolved for
    # ONNX Runtime's CUDA provider only on request
    assert args["ORT_GPU_VERSION"] == '""'
    assert 'onnxruntime-gpu==${ORT_GPU_VERSION}' in text and "pip uninstall -y onnxruntime" in text
    final = text[text.rindex("\nFROM "):]
    assert re.search(r"SPECREC_VERIFIER_BACKEND=cuda", final) and re.search(r"SPECREC_VERIFIER_DEVICE=cuda", final)
    assert re.search(r'^CMD \["verifier"\]', final, re.M)
