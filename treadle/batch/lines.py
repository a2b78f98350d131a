"""A batch file's lines: the envelope of each input line checked, and output lines made.

Owns the JSONL format OpenAI defines for batches. An input line is one JSON object with
`custom_id` (unique in the file), `method` ("POST"), `url` (the batch's endpoint) and
`body` (the request, as a live call would send it). `parse_input` checks every line's
envelope and reports each problem with its line number (1-based, as an editor counts) and
the field at fault; the body itself is judged when the line runs, by the same code as a
live request (server/batch_lines.py), and its errors land in the error file under the
line's custom_id. Output lines carry `custom_id`, `response` {status_code, request_id,
body} or an `error` {code, message} for lines that never ran (the batch expired or was
cancelled). Pure: no I/O beyond the iterator it is handed.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Iterable

LINE_KEYS = ("custom_id", "method", "url", "body")
MAX_CUSTOM_ID_CHARS = 512
MAX_REPORTED_ERRORS = 100
"""A file with more bad lines reports the first this many (and says how many more)."""

UNANSWERED = {
    "batch_expired": "This request could not be executed before the completion window "
                     "expired.",
    "batch_cancelled": "This request was not executed: the batch was cancelled first.",
}
"""Error codes (OpenAI's) of lines a batch ended without running."""


@dataclass(frozen=True)
class InputLine:
    """One checked input line: its number in the file, custom_id, endpoint, and the body
    as JSON."""

    line_no: int
    custom_id: str
    url: str
    body: str


@dataclass(frozen=True)
class LineError:
    """What is wrong with a batch's input (an entry of the batch's `errors.data`)."""

    code: str
    message: str
    param: str | None = None
    line: int | None = None

    def as_dict(self) -> dict:
        return {"code": self.code, "message": self.message, "param": self.param,
                "line": self.line}


def _valid_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # JSON's "\\ud800" decodes to a lone surrogate
        return False
    return True


def _check_envelope(n: int, raw: bytes, endpoints: tuple[str, ...]) -> InputLine | LineError:
    try:
        item = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return LineError("invalid_json_line", f"line {n}: not valid UTF-8 (byte {exc.start})",
                         None, n)
    except ValueError as exc:
        return LineError("invalid_json_line", f"line {n}: not valid JSON: {exc}", None, n)
    if not isinstance(item, dict):
        return LineError("invalid_json_line", f"line {n}: must be a JSON object with "
                         f"{', '.join(LINE_KEYS)}", None, n)
    unknown = next((key for key in item if key not in LINE_KEYS), None)
    if unknown is not None:
        return LineError("invalid_request", f"line {n}: {unknown}: unknown key (a line holds "
                         f"{', '.join(LINE_KEYS)})", str(unknown), n)
    missing = next((key for key in LINE_KEYS if key not in item), None)
    if missing is not None:
        return LineError("missing_required_parameter", f"line {n}: {missing}: required",
                         missing, n)
    custom_id, method, url, body = (item[key] for key in LINE_KEYS)
    if (not isinstance(custom_id, str) or not 1 <= len(custom_id) <= MAX_CUSTOM_ID_CHARS
            or not _valid_unicode(custom_id)):
        return LineError("invalid_value", f"line {n}: custom_id: must be a string of 1 to "
                         f"{MAX_CUSTOM_ID_CHARS} characters (valid Unicode)", "custom_id", n)
    if method != "POST":
        return LineError("invalid_value", f"line {n}: method: must be 'POST', got {method!r}",
                         "method", n)
    if url not in endpoints:
        where = (f"the batch's endpoint {endpoints[0]!r} (every line of a batch goes to its "
                 "endpoint)" if len(endpoints) == 1 else f"one of {', '.join(endpoints)}")
        return LineError("invalid_url", f"line {n}: url: {url!r} is not {where}", "url", n)
    if not isinstance(body, dict):
        return LineError("invalid_value", f"line {n}: body: must be a JSON object (the "
                         "request a live call would send)", "body", n)
    return InputLine(n, custom_id, url, json.dumps(body))  # ASCII: lone surrogates survive


def parse_input(raw_lines: Iterable[bytes], endpoints: tuple[str, ...],
                max_lines: int) -> tuple[list[InputLine], list[LineError]]:
    """Every request line of a batch file (blank lines skipped), or what is wrong with
    them: (lines, []) or ([], errors). A line's url must be one of `endpoints` (a batch's:
    its one endpoint). Reading stops past `max_lines` requests."""
    lines: list[InputLine] = []
    errors: list[LineError] = []
    first_seen: dict[str, int] = {}
    num_errors = 0
    for n, raw in enumerate(raw_lines, start=1):
        if not raw.strip():
            continue
        if len(lines) + num_errors >= max_lines:
            errors.append(LineError("too_many_requests", f"line {n}: the file holds more than "
                                    f"{max_lines} requests (batch_max_lines)", None, n))
            return [], errors
        checked = _check_envelope(n, raw, endpoints)
        if isinstance(checked, InputLine) and checked.custom_id in first_seen:
            checked = LineError("duplicate_custom_id", f"line {n}: custom_id: "
                                f"{checked.custom_id!r} is already used by line "
                                f"{first_seen[checked.custom_id]} (each must be unique)",
                                "custom_id", n)
        if isinstance(checked, LineError):
            num_errors += 1
            if len(errors) < MAX_REPORTED_ERRORS:
                errors.append(checked)
            continue
        first_seen[checked.custom_id] = n
        lines.append(checked)
    if num_errors > len(errors):
        errors.append(LineError("invalid_request", f"{num_errors - len(errors)} more lines "
                                "are invalid (the first ones are listed)"))
    if not errors and not lines:
        errors.append(LineError("empty_file", "the input file holds no request lines"))
    return ([], errors) if errors else (lines, [])


def new_line_id() -> str:
    return f"batch_req_{secrets.token_hex(12)}"


def output_line(custom_id: str, status_code: int, body: dict) -> dict:
    """The output (or error) file's line of a line that ran: its answer as a live call
    would have had it."""
    request_id = body.get("id") if status_code == 200 and isinstance(body.get("id"), str) \
        else f"req_{secrets.token_hex(12)}"
    return {"id": new_line_id(), "custom_id": custom_id,
            "response": {"status_code": status_code, "request_id": request_id, "body": body},
            "error": None}


def unanswered_line(custom_id: str, code: str) -> dict:
    """The error file's line of a line the batch ended without running."""
    return {"id": new_line_id(), "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": UNANSWERED[code]}}
