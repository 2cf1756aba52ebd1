"""The templates of a schedule's paths: `{date}`, `{time}` and `{slot}` in `input_batch` and `output_dir`.

Each run writes into a folder of its own (a folder holding a finished job's results takes no other
job), and one step of a chain reads what the step before wrote at the same slot. Only these two
fields are templates, and only these three names; any other brace is refused, so that a typo is a
400 at creation rather than a literal `{dat}` folder every night.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from broker.errors import BadInput

TEMPLATE_FIELDS = ("input_batch", "output_dir")
PLACEHOLDERS = ("date", "time", "slot")
_BRACED = re.compile(r"\{([^{}]*)\}")


def check_templates(job: Mapping[str, Any]) -> None:
    """BadInput for a brace in `job` other than `{date}`, `{time}` and `{slot}` in the template fields."""
    for name in TEMPLATE_FIELDS:
        text = job.get(name)
        if not isinstance(text, str):
            continue
        for found in _BRACED.findall(text):
            if found not in PLACEHOLDERS:
                raise BadInput(f"job.{name} holds {{{found}}}; its templates are {{date}}, {{time}} and {{slot}}")
        if _BRACED.sub("", text).count("{") or _BRACED.sub("", text).count("}"):
            raise BadInput(f"job.{name} {text!r} holds an unmatched brace; its templates are {{date}}, {{time}} "
                           "and {slot}")


def render(job: Mapping[str, Any], labels: Mapping[str, str]) -> dict[str, Any]:
    """`job` with its template fields filled in with `labels` (`Cadence.labels` of a slot)."""
    rendered = dict(job)
    for name in TEMPLATE_FIELDS:
        if isinstance(rendered.get(name), str):
            rendered[name] = _BRACED.sub(lambda match: labels.get(match.group(1), match.group(0)), rendered[name])
    return rendered
