"""The one error body every route answers with (`sits_api.http.error_replies`)."""

from __future__ import annotations

from pydantic import BaseModel, Field


class Error(BaseModel):
    """What went wrong and what to do, with a code a client can switch on (`broker.errors`)."""

    error: str = Field(description="what was wrong and what to do about it")
    code: str = Field(description="the error's class in one word: bad_input, not_found, queue_full, unauthorized, "
                                  "... (a 429 or a 503 may say when to come back in its Retry-After header)")
    predicted_finish: float | None = Field(None, description="deadline_infeasible only: the predicted finish "
                                                             "(unix seconds)")
    earliest_deadline: float | None = Field(None, description="deadline_infeasible only: the earliest deadline "
                                                              "that would be accepted now (unix seconds)")
