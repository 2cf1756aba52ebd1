"""Request bodies of the REST API, validated with pydantic (unknown fields rejected)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

MAX_JOBS_LISTED = 10_000
"""The most jobs `GET /v1/jobs?limit=` lists in one answer."""


def _whole(value: Any) -> Any:
    """A JSON number with no fraction (2.0, an integer to JSON Schema) as the int it is; anything else as sent."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


WholeNumber = Annotated[int, BeforeValidator(_whole)]
"""An int field of a strict body that also takes 2.0 for 2, as JSON Schema's `integer` does: the document
and the API agree on what a whole number is (a "2" or a true is still refused)."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # no coercion: "3" or true is not a priority


_ColumnNames = Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=65_536)]
"""A table's columns read into one model input, in order."""


class JobSubmission(_Body):
    """`POST /v1/jobs`: an offline job over an input file, paths as the workers see them."""

    model: str = Field(..., min_length=1, description="`name` (newest version) or `name@version`")
    input_batch: str = Field(..., min_length=1, description=".npy, .npz, .bin, .jsonl, .parquet, .arrow, .feather, "
                                                            ".ipc or .csv file")
    output_dir: str = Field(..., min_length=1, description="folder for <output>.npy files and manifest.json")
    priority: WholeNumber = Field(0, ge=0, le=15)
    chunk_size: Annotated[WholeNumber, Field(ge=1, le=10_000_000)] | Literal["auto"] | None = Field(
        None, description="rows per queue item; unset: the server's `jobs.chunk_size`; `auto`: about "
                          "`jobs.chunk_seconds` of work at the model's measured rows/s")
    batch_size: Annotated[WholeNumber, Field(ge=1, le=65_536)] | Literal["auto"] | None = Field(
        None, description="rows per ONNX Runtime run; unset: the server's `jobs.batch_size`; `auto`: the "
                          "model's best measured batch size")
    input_shape: list[Annotated[WholeNumber, Field(ge=1, le=2**31)]] | None = Field(
        None, max_length=8, description="per-sample shape of a raw .bin input")
    input_dtype: str | None = Field(None, description="dtype of a raw .bin input, e.g. float32")
    input_format: Literal["npy", "npz", "bin", "jsonl", "parquet", "arrow", "csv"] | None = Field(
        None, description="the input's format when its extension does not say it (.parquet; .arrow, .feather or "
                          ".ipc: Arrow IPC; .csv)")
    columns: dict[Annotated[str, Field(min_length=1)], _ColumnNames] | None = Field(
        None, description="a table's columns for each model input, stacked in this order into each row (unset: "
                          "every numeric column but `id_column`, into the model's one input)")
    id_column: str | None = Field(None, min_length=1, description="a table's column carried to the outputs and "
                                                                  "the quarantine listing")
    output_format: Literal["npy", "parquet"] = Field(
        "npy", description="`npy`: one <output>.npy per output; `parquet`: outputs.parquet, the id column and one "
                           "column per output")
    deadline: str | None = Field(None, min_length=1, max_length=64,
                                 description="when the job must be done: an RFC 3339 time with its offset, "
                                             "e.g. 2026-12-01T10:42:00Z")
    deadline_s: float | None = Field(None, gt=0, le=366 * 86400,
                                     description="the same, as seconds from now (give one of the two)")
    max_slots: WholeNumber | None = Field(None, ge=1, le=100_000,
                                  description="the most stream slots its chunks hold at once (unset: as many as "
                                              "are free); a schedule's plan sets it for each run")

    @model_validator(mode="after")
    def _one_deadline(self) -> JobSubmission:
        if self.deadline is not None and self.deadline_s is not None:
            raise ValueError("give either deadline (a time) or deadline_s (seconds from now), not both")
        return self


class ModelRegistration(_Body):
    """`POST /v1/models`: register an ONNX file under a name."""

    name: str = Field(..., pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    path: str = Field(..., min_length=1)
    profile_mode: Literal["static", "full"] = "static"
    enable_fusion: bool = False


class OnlineRequest(_Body):
    """`POST /v1/requests`: one inference request, answered at once (202) or when done (`wait`)."""

    model: str = Field(..., min_length=1, description="`name` (newest version) or `name@version`")
    inputs: dict[str, Any] = Field(..., description="input name -> nested lists, or {\"b64\": base64 .npy}")
    priority: WholeNumber = Field(0, ge=0, le=15)
    deadline_ms: float | None = Field(None, gt=0, description="remaining tolerable delay")
    timeout_ms: float | None = Field(None, gt=0, description="how long the request may wait for a worker, under "
                                     "its model's queue policy (docs/scheduling.md)")
    user_tier: Literal["vip", "premium", "free"] = "free"
    tokens: WholeNumber | None = Field(None, ge=1, description="default: the input's sequence length times its rows")
    wait: bool = False
