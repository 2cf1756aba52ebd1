"""The house rules that a tool can check: package layers, a light model package, docs that build and
name every module and configuration key (docs/architecture.md, "Packages")."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from broker.config.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("broker", "sits_worker", "sits_api")
BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    """A console script of this virtualenv (the dev extra installs it)."""
    path = BIN / name
    return str(path) if path.exists() else (shutil.which(name) or name)


def _lint_imports(cwd: Path) -> subprocess.CompletedProcess[str]:
    # PYTHONPATH first: the copy in `cwd` shadows the editable install of this checkout.
    return subprocess.run([_tool("lint-imports"), "--no-cache"], cwd=cwd, capture_output=True, text=True,
                          timeout=180, env={"PATH": str(BIN), "PYTHONPATH": str(cwd), "HOME": str(cwd)})


def test_the_package_layers_hold() -> None:
    result = _lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "BROKEN" not in result.stdout and "4 kept, 0 broken" in result.stdout, result.stdout


@pytest.mark.parametrize(("module", "line", "contract"), [
    ("sits_api/app.py", "import sits_worker.runtime", "the API imports of the worker only its light model package"),
    ("broker/state/keys.py", "import celery", "broker is the core"),
    ("sits_worker/runtime.py", "import sits_api.jsonio", "the worker never imports the API"),
    ("sits_worker/model/graph.py", "import sits_worker.tasks", "the light model package imports no Celery"),
])
def test_a_forbidden_import_breaks_its_contract(tmp_path: Path, module: str, line: str, contract: str) -> None:
    """The contracts are not vacuous: one added import of the kind each forbids fails `lint-imports`."""
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    with open(tmp_path / module, "a") as handle:
        handle.write(f"\n{line}  # added by the test\n")

    result = _lint_imports(tmp_path)

    assert result.returncode != 0, result.stdout
    broken = result.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken and module.removesuffix(".py").replace("/", ".") in broken, result.stdout


def _imported_by(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sorted(m.split('.')[0] for m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return set(out.stdout.split())


def test_the_light_model_package_imports_no_celery_onnxruntime_or_flask() -> None:
    """The API and benchmarks import the model package; the Celery app must not come along with it."""
    loaded = _imported_by("import sits_worker.model.graph, sits_worker.model.zoo, sits_worker.model.servable, "
                          "sits_worker.model.batch_probe, sits_worker.model.sequence_probe, sits_worker.model.inputs")
    assert not loaded & {"celery", "kombu", "onnxruntime", "flask"}, loaded


def test_celery_finds_the_app_in_the_worker_package(tmp_path: Path) -> None:
    """`celery -A sits_worker worker` still works although importing the package builds no app."""
    code = ("from celery.app.utils import find_app; app = find_app('sits_worker'); "
            "print(type(app).__name__, app.main, sorted(app.loader.default_modules))")
    # Reading the app's configuration needs a Redis URL (nothing connects to it here).
    env = {"PATH": str(BIN), "SITS_REDIS_URL": "redis://127.0.0.1:1/0", "SITS_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[:2] == ["_SitsCelery", "sits"], out.stdout
    assert "sits_worker.tasks" in out.stdout and "sits_worker.worker_hooks" in out.stdout, out.stdout


def test_the_docs_build_strictly(tmp_path: Path) -> None:
    """A broken link or a page left out of the nav fails `mkdocs build --strict`."""
    result = subprocess.run([_tool("mkdocs"), "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_architecture_page_names_every_module() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text()
    modules = [path.relative_to(ROOT).as_posix() for package in PACKAGES
               for path in sorted((ROOT / package).rglob("*")) if path.suffix in (".py", ".lua")]
    missing = [module for module in modules if f"`{module}`" not in page]
    assert len(modules) > 100 and not missing, missing


def _setting_paths(model: type, prefix: str = "") -> list[str]:
    paths = []
    for name, field in model.model_fields.items():  # type: ignore[attr-defined]
        paths.append(prefix + name)
        if hasattr(field.annotation, "model_fields"):
            paths += _setting_paths(field.annotation, f"{prefix}{name}.")
    return paths


def test_the_operations_page_names_every_configuration_key() -> None:
    page = (ROOT / "docs" / "operations.md").read_text()
    keys = _setting_paths(Settings)
    missing = [key for key in keys if f"`{key}`" not in page]
    assert len(keys) > 40 and not missing, missing


def test_the_readme_is_a_newcomers_page_whose_test_command_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    test_command = "python3 -m venv .venv && .venv/bin/pip install -q -e '.[cpu,dev]' && .venv/bin/python -m pytest"
    assert "sitsctl demo" in readme and test_command in readme
    assert test_command in (ROOT / ".ci" / "run").read_text()


def test_docs_link_only_inside_the_repository() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        text = page.read_text()
        outside = re.findall(r"\]\((https?://[^)]*|[^)]*shared/[^)]*)\)", text)
        assert not outside, f"{page.name} links outside the repository: {outside}"
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
            assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"
