"""The container images and the registrable package, checked offline (no Docker, no registry).

- an image's tag (flytekit's own ImageSpec hash) follows the dependencies, not the library code;
- the generated Docker context installs the dependency list from where it lies and copies no code;
- the GPU image has wget (KubeRay's probes);
- the registry comes from DIFFUSIONRL_IMAGE_REGISTRY, with a clear error where an image would
  have to be built without it;
- `make package` writes both workflows and all tasks, fast-registered, naming the two images.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from flytekit.configuration import FastSerializationSettings, ImageConfig, SerializationSettings
from flytekit.core.python_auto_container import update_image_spec_copy_handling
from flytekit.image_spec.default_builder import create_docker_context
from packaging.requirements import Requirement

import images

ROOT = Path(__file__).resolve().parents[1]
REGISTRY = "registry.example.com/acme"


def _tags(root: Path) -> dict:
    """The images' tags for the checkout at ``root`` as fast registration sees them
    (`pyflyte package/register --copy all`, source root = the checkout)."""
    cpu, gpu = images.make_images(images.project_dependencies(root / "pyproject.toml"), REGISTRY)
    settings = SerializationSettings(
        image_config=ImageConfig.auto_default_image(),
        source_root=str(root),
        fast_serialization_settings=FastSerializationSettings(enabled=True, destination_dir="/root"),
    )
    tags = {}
    for spec in (cpu, gpu):
        update_image_spec_copy_handling(spec, settings)  # what serialization does to an ImageSpec
        tags[spec.name] = spec.tag
    return tags


@pytest.fixture
def checkout(tmp_path):
    """A copy of the parts of the repository an image could depend on."""
    root = tmp_path / "repo"
    root.mkdir()
    shutil.copy(ROOT / "pyproject.toml", root)
    shutil.copytree(ROOT / "diffusionrl", root / "diffusionrl", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "configs", root / "configs")
    return root


def test_tags_follow_dependencies_not_library_code(checkout):
    before = _tags(checkout)
    assert before == _tags(checkout)  # deterministic

    # Library edits (changed, added files; a config preset; pyproject outside the dependencies):
    # code travels with fast registration, the images stay.
    config_py = checkout / "diffusionrl" / "config" / "root.py"
    config_py.write_text(config_py.read_text() + "\n# edit\n")
    (checkout / "diffusionrl" / "new_module.py").write_text("X = 1\n")
    (checkout / "configs" / "tiny-cpu.yaml").write_text("edited: true\n")
    pyproject = checkout / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('version = "0.1.0"', 'version = "0.2.0"'))
    assert _tags(checkout) == before

    # A dependency change rebuilds both images.
    text = pyproject.read_text()
    assert '"pillow>=10"' in text
    pyproject.write_text(text.replace('"pillow>=10"', '"pillow>=11"'))
    after = _tags(checkout)
    assert after["diffusionrl-cpu"] != before["diffusionrl-cpu"]
    assert after["diffusionrl-gpu"] != before["diffusionrl-gpu"]


def test_tags_follow_each_images_own_lists(checkout, monkeypatch):
    before = _tags(checkout)
    monkeypatch.setattr(images, "GPU_APT", images.GPU_APT + ["curl"])
    after = _tags(checkout)
    assert after["diffusionrl-gpu"] != before["diffusionrl-gpu"]
    assert after["diffusionrl-cpu"] == before["diffusionrl-cpu"]
    monkeypatch.setattr(images, "CPU_PACKAGES", ["torch==2.12.0"])
    assert _tags(checkout)["diffusionrl-cpu"] != before["diffusionrl-cpu"]


def test_module_images_copy_no_code():
    """The specs the tasks use: no source_root/copy/commands, also after fast serialization."""
    settings = SerializationSettings(
        image_config=ImageConfig.auto_default_image(),
        source_root=str(ROOT),
        fast_serialization_settings=FastSerializationSettings(enabled=True, destination_dir="/root"),
    )
    for spec in (images.CPU_IMAGE, images.GPU_IMAGE):
        spec = copy.deepcopy(spec)
        update_image_spec_copy_handling(spec, settings)
        assert spec.source_root is None and spec.source_copy_mode is None
        assert spec.copy is None and spec.commands is None and spec.requirements is None
        assert spec.builder == images.BUILDER


@pytest.mark.parametrize("key", ["cpu", "gpu"])
def test_docker_context_installs_the_dependency_list(key, tmp_path):
    """flytekit's own Dockerfile generator: the requirements file it writes is the one the install
    step bind-mounts from the context root; nothing of the checkout is copied in."""
    spec = images.make_images(images.project_dependencies(), REGISTRY)[0 if key == "cpu" else 1]
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    create_docker_context(spec, ctx)

    assert sorted(p.name for p in ctx.iterdir()) == ["Dockerfile", "requirements_uv.txt"]
    dockerfile = (ctx / "Dockerfile").read_text()
    assert "--mount=type=bind,target=requirements_uv.txt,src=requirements_uv.txt" in dockerfile
    assert "uv pip install" in dockerfile and "--requirement requirements_uv.txt" in dockerfile
    assert "COPY" not in dockerfile  # no code, no pyproject: they come with fast registration
    assert "pip install ." not in dockerfile and "pip install --no-cache-dir ." not in dockerfile
    index = images.CPU_INDEX if key == "cpu" else images.GPU_INDEX
    assert f"--extra-index-url {index}" in dockerfile

    lines = (ctx / "requirements_uv.txt").read_text().splitlines()
    extra = images.CPU_PACKAGES if key == "cpu" else images.GPU_PACKAGES
    assert lines == images.project_dependencies() + extra
    names = [Requirement(line).name.lower().replace("_", "-") for line in lines]  # valid PEP 508
    assert "kubernetes" in names and "flytekitplugins-ray" in names
    # flytekit comes from pyproject's range: the builder must not add its own pin.
    assert names.count("flytekit") == 1


def test_gpu_image_has_wget(tmp_path):
    assert "wget" in images.GPU_IMAGE.apt_packages
    create_docker_context(images.GPU_IMAGE, tmp_path)
    apt = [line for line in (tmp_path / "Dockerfile").read_text().splitlines() if "apt-get install" in line]
    assert len(apt) == 1 and "wget" in apt[0].split()


def test_registry_from_env_and_clear_errors(monkeypatch, tmp_path):
    monkeypatch.delenv(images.REGISTRY_ENV, raising=False)
    monkeypatch.delenv(images.OFFLINE_ENV, raising=False)
    assert images.registry_from_env() == images.PLACEHOLDER_REGISTRY
    monkeypatch.setenv(images.REGISTRY_ENV, "ghcr.io/acme")
    assert images.registry_from_env() == "ghcr.io/acme"

    builder = images.DiffusionRLImageBuilder()
    cpu, _ = images.make_images(["numpy"], images.PLACEHOLDER_REGISTRY)
    with pytest.raises(RuntimeError, match=images.REGISTRY_ENV):
        builder.should_build(cpu)  # register/run --remote would have to build it
    monkeypatch.setenv(images.OFFLINE_ENV, "1")
    assert builder.should_build(cpu) is False  # make package: names only, looks nothing up
    named, _ = images.make_images(["numpy"], "ghcr.io/acme")
    assert builder.should_build(named) is False

    # `make images`: one line per missing piece.
    monkeypatch.setenv("PATH", str(tmp_path))  # no docker
    problems = images.build_problems("")
    assert len(problems) == 2
    assert images.REGISTRY_ENV in problems[0] and "docker is not installed" in problems[1]
    with pytest.raises(RuntimeError, match="docker is not installed"):
        builder.build_image(named)


def test_login_detection(monkeypatch, tmp_path):
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path))
    assert not images._logged_in("ghcr.io")
    (tmp_path / "config.json").write_text('{"auths": {"ghcr.io": {}, "https://index.docker.io/v1/": {}}}')
    assert images._logged_in("ghcr.io") and images._logged_in("docker.io") and images._logged_in("acme")
    assert not images._logged_in("registry.example.com")
    assert not images._needs_login("localhost:30000") and images._needs_login("ghcr.io")


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_package_writes_both_workflows_and_all_tasks(tmp_path):
    from flyteidl.admin import task_pb2, workflow_pb2

    out = tmp_path / "flyte-package.tgz"
    env = {**os.environ, images.REGISTRY_ENV: REGISTRY}
    env.pop(images.OFFLINE_ENV, None)  # the target sets it
    # -o setup: the environment running the tests is the one to package with.
    cmd = ["make", "--no-print-directory", "-o", "setup", "package"]
    cmd += [f"BIN={Path(sys.executable).parent}", f"PACKAGE={out}"]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    cpu, gpu = images.make_images(images.project_dependencies(), REGISTRY)
    with tarfile.open(out) as tar:
        names = tar.getnames()
        tasks = {}
        for name in names:
            if name.endswith("_1.pb"):
                spec = task_pb2.TaskSpec()
                spec.ParseFromString(tar.extractfile(name).read())
                tasks[spec.template.id.name] = spec.template
        workflows = set()
        for name in names:
            if name.endswith("_2.pb"):
                spec = workflow_pb2.WorkflowSpec()
                spec.ParseFromString(tar.extractfile(name).read())
                workflows.add(spec.template.id.name)
        (code,) = [n for n in names if n.startswith("fast") and n.endswith(".tar.gz")]
        with tarfile.open(fileobj=tar.extractfile(code)) as code_tar:
            shipped = set(code_tar.getnames())

    assert {"workflows.grpo.grpo", "workflows.bdlm.bdlm"} <= workflows
    for module in ("tasks.grpo", "tasks.bdlm"):
        assert any(name.startswith(module + ".") for name in tasks), module
    assert tasks["tasks.grpo.train"].type == "ray"
    assert tasks["tasks.grpo.train"].container.image == gpu.image_name()
    assert tasks["tasks.grpo.prepare_prompts"].container.image == cpu.image_name()
    assert {t.container.image for t in tasks.values()} == {cpu.image_name(), gpu.image_name()}
    assert all(t.container.args[0] == "pyflyte-fast-execute" for t in tasks.values())
    # The code tarball carries what the images no longer do.
    for path in (
        "pyproject.toml",
        "configs/tiny-cpu.yaml",
        "diffusionrl/__init__.py",
        "images/__init__.py",
        "tasks/grpo.py",
        "workflows/grpo.py",
    ):
        assert path in shipped, path
