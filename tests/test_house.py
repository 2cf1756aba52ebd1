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
    assert "BROKEN" not in result.stdout and "10 kept, 0 broken" in result.stdout, result.stdout


def _lint_with_a_line_added(tmp_path: Path, module: str, line: str) -> subprocess.CompletedProcess[str]:
    """`lint-imports` over a copy of the packages in `tmp_path` with `line` appended to `module`."""
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    with open(tmp_path / module, "a") as handle:
        handle.write(f"\n{line}  # added by the test\n")
    return _lint_imports(tmp_path)


@pytest.mark.parametrize(("module", "line", "contract"), [
    ("sits_api/app.py", "import sits_worker.device.runtime",
     "the API imports of the worker only its light model package"),
    ("broker/state/keys.py", "import celery", "broker is the core"),
    ("sits_worker/device/runtime.py", "import sits_api.http.jsonio", "the worker never imports the API"),
    ("sits_worker/model/graph.py", "import sits_worker.tasks", "the light model package imports no Celery"),
])
def test_a_forbidden_import_breaks_its_contract(tmp_path: Path, module: str, line: str, contract: str) -> None:
    """The contracts are not vacuous: one added import of the kind each forbids fails `lint-imports`."""
    result = _lint_with_a_line_added(tmp_path, module, line)

    assert result.returncode != 0, result.stdout
    broken = result.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken and module.removesuffix(".py").replace("/", ".") in broken, result.stdout


@pytest.mark.parametrize(("module", "line", "contract", "edge"), [
    ("broker/state/keys.py", "import broker.jobs.records", "broker's rooms import each other one way",
     ".state -> .jobs"),
    ("sits_worker/device/runtime.py", "import sits_worker.serving.context",
     "the worker's rooms import each other one way", ".device -> .serving"),
    ("sits_api/tenancy/ab_routes.py", "import sits_api.v1.health", "the API's rooms import each other one way",
     ".tenancy -> .v1"),
])
def test_a_back_edge_between_rooms_breaks_their_order(tmp_path: Path, module: str, line: str, contract: str,
                                                       edge: str) -> None:
    """The rooms of each package import one way: one import back against the order fails `lint-imports`,
    naming the edge to remove (docs/architecture.md, "The house")."""
    result = _lint_with_a_line_added(tmp_path, module, line)

    assert result.returncode != 0, result.stdout
    broken = result.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken and edge in broken, result.stdout


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


_MD_REFERENCE = re.compile(r"(?<![\w$/{.-])((?:[\w.-]+/)*[\w-]+\.md)\b")


def test_every_md_file_a_file_names_is_in_the_repository() -> None:
    """A docstring, comment or page that cites a `.md` file cites one a clone has (a page of `docs/`,
    the README), never notes kept outside the repository. URLs and paths built from a variable
    (`$OUT/cores.md`) name no file of the repository and are left out."""
    tracked = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    suffixes = (".py", ".md", ".toml", ".yaml", ".yml", ".lua", ".sh", ".conf", ".cfg", ".txt", ".json")
    missing = []
    for name in tracked:
        path = ROOT / name
        if not name.endswith(suffixes) and name != ".ci/run" or not path.is_file():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for cited in _MD_REFERENCE.findall(re.sub(r"\w+://\S+", "", line)):
                if name.endswith(".sh") and "/" not in cited and cited.islower():
                    continue  # a shell script's bare lowercase name is a file it writes under $OUT
                candidates = [ROOT / cited, path.parent / cited, ROOT / "docs" / cited]
                if not any(candidate.is_file() for candidate in candidates):
                    missing.append(f"{name}:{number}: {cited}")
    assert not missing, missing


def test_the_concepts_page_defines_every_term_the_docs_set_in_italics() -> None:
    """Each term a page writes in *italics* is one `docs/concepts.md` defines, as `*Term*` on a line of
    its own, followed by its definition."""
    concepts = (ROOT / "docs" / "concepts.md").read_text()
    defined = {term.lower() for term in re.findall(r"^\*([^*\n]+)\*$", concepts, re.M)}
    assert len(defined) > 40, sorted(defined)
    undefined = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = re.sub(r"```.*?```|`[^`\n]*`", "", page.read_text(), flags=re.S)
        for term in re.findall(r"(?<![*\w])\*([A-Za-z][^*\n]*?)\*(?![*\w])", text):
            lowered = term.lower()
            if lowered not in defined and lowered.rstrip("s") not in defined:
                undefined.append(f"{page.name}: {term}")
    assert not undefined, undefined
